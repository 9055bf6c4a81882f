//! The two 8-bit float types of the OCP spec, as CUDA has them:
//!
//! - fp8 e4m3 (the "fn" variant, CUDA's `__nv_fp8_e4m3`): 1 sign, 4 exponent (bias 7) and 3
//!   mantissa bits, no infinities, one NaN per sign, largest finite value 448;
//! - fp8 e5m2 (CUDA's `__nv_fp8_e5m2`): 1 sign, 5 exponent (bias 15) and 2 mantissa bits, the
//!   upper byte of an IEEE binary16: infinities and NaNs like f16's, largest finite value
//!   57344.
//!
//! Conversions from wider types round to nearest even and saturate to the largest finite
//! value, infinities too, as CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)` does: a
//! quantised activation (or a reduction) that overflows clips, it does not turn into NaN or
//! infinity. NaN stays NaN. Decoding is exact (an e5m2 infinity decodes to an infinity).

/// An fp8 e4m3 value (`__nv_fp8_e4m3`). Moves like any 1-byte element; reductions on it are
/// computed in f32 and rounded once per step.
///
/// ```
/// use ferrocomm::F8E4M3;
/// assert_eq!(F8E4M3::from_f32(1.0).to_bits(), 0x38);
/// assert_eq!(F8E4M3::from_f32(1000.0).to_f32(), 448.0, "saturates");
/// assert_eq!(F8E4M3::from_f32(0.3).to_f32(), 0.3125, "rounds to the nearest of 3 mantissa bits");
/// ```
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F8E4M3(u8);

/// An fp8 format's layout: mantissa bits, exponent bias, largest finite value and its code.
struct Format {
    man: u32,
    bias: i32,
    max: f32,
    max_code: u8,
}

/// `x` in format `f`, rounded once to nearest (ties to even), saturating to ±`f.max`
/// (infinities too); NaN stays NaN (code 0x7F, a NaN in both formats).
fn round_to_fp8(x: f32, f: Format) -> u8 {
    // 2^k as an f32, for the k in range here (exact scalings, no rounding).
    let pow2 = |k: i32| f32::from_bits(((127 + k) as u32) << 23);
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs();
    if a >= f.max {
        return sign | f.max_code;
    }
    let lead = 1u32 << f.man; // the implicit leading bit, as a mantissa count
                              // Below the smallest normal, 2^(1 - bias), values are multiples of 2^(1 - bias - man).
    if a < pow2(1 - f.bias) {
        // At most `lead`, which is also the smallest normal's code.
        return sign | (a * pow2(f.bias - 1 + f.man as i32)).round_ties_even() as u8;
    }
    let mut e = ((a.to_bits() >> 23) as i32) - 127;
    let mut q = (a * pow2(f.man as i32 - e)).round_ties_even() as u32; // in lead..=2 * lead
    if q == 2 * lead {
        q = lead;
        e += 1;
    }
    let code = (((e + f.bias) as u32) << f.man) | (q - lead);
    sign | code.min(u32::from(f.max_code)) as u8
}

impl F8E4M3 {
    /// The largest finite value, 448.
    pub const MAX: f32 = 448.0;

    /// The value with these bits.
    pub const fn from_bits(bits: u8) -> F8E4M3 {
        F8E4M3(bits)
    }

    /// The bits of the value.
    pub const fn to_bits(self) -> u8 {
        self.0
    }

    /// `x` rounded to nearest (ties to even), saturating to ±448; NaN stays NaN.
    pub fn from_f32(x: f32) -> F8E4M3 {
        F8E4M3(round_to_fp8(
            x,
            Format {
                man: 3,
                bias: 7,
                max: Self::MAX,
                max_code: 0x7E,
            },
        ))
    }

    /// The value as f32 (exact).
    pub fn to_f32(self) -> f32 {
        let sign = if self.0 & 0x80 != 0 { -1.0 } else { 1.0 };
        let (exp, man) = ((self.0 >> 3) & 0xF, self.0 & 7);
        let magnitude = match (exp, man) {
            (15, 7) => return f32::NAN,
            (0, m) => m as f32 / 512.0,
            (e, m) => (1.0 + m as f32 / 8.0) * f32::from_bits(((e as u32 + 120) & 0xFF) << 23),
        };
        sign * magnitude
    }

    /// Whether the value is NaN.
    pub fn is_nan(self) -> bool {
        self.0 & 0x7F == 0x7F
    }
}

impl std::fmt::Debug for F8E4M3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.to_f32())
    }
}

impl std::fmt::Display for F8E4M3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.to_f32(), f)
    }
}

impl From<F8E4M3> for f32 {
    fn from(x: F8E4M3) -> f32 {
        x.to_f32()
    }
}

/// An fp8 e5m2 value (`__nv_fp8_e5m2`): the upper byte of an f16. Moves like any 1-byte
/// element; reductions on it are computed in f32 and rounded once per step.
///
/// ```
/// use ferrocomm::F8E5M2;
/// assert_eq!(F8E5M2::from_f32(1.0).to_bits(), 0x3C);
/// assert_eq!(F8E5M2::from_f32(1e6).to_f32(), 57344.0, "saturates");
/// assert_eq!(F8E5M2::from_f32(f32::INFINITY).to_f32(), 57344.0, "infinities too");
/// assert_eq!(F8E5M2::from_bits(0x7C).to_f32(), f32::INFINITY, "but decode exactly");
/// assert_eq!(F8E5M2::from_f32(0.3).to_f32(), 0.3125, "rounds to the nearest of 2 mantissa bits");
/// ```
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F8E5M2(u8);

impl F8E5M2 {
    /// The largest finite value, 57344.
    pub const MAX: f32 = 57344.0;

    /// The value with these bits.
    pub const fn from_bits(bits: u8) -> F8E5M2 {
        F8E5M2(bits)
    }

    /// The bits of the value.
    pub const fn to_bits(self) -> u8 {
        self.0
    }

    /// `x` rounded to nearest (ties to even), saturating to ±57344 (infinities too); NaN stays
    /// NaN. Rounds once, from f32 (not through f16, which would round twice).
    pub fn from_f32(x: f32) -> F8E5M2 {
        F8E5M2(round_to_fp8(
            x,
            Format {
                man: 2,
                bias: 15,
                max: Self::MAX,
                max_code: 0x7B,
            },
        ))
    }

    /// The value as f32 (exact): the f16 whose upper byte this is.
    pub fn to_f32(self) -> f32 {
        half::f16::from_bits(u16::from(self.0) << 8).to_f32()
    }

    /// Whether the value is NaN.
    pub fn is_nan(self) -> bool {
        self.0 & 0x7F > 0x7C
    }

    /// Whether the value is infinite (only decoding gives one: conversions saturate).
    pub fn is_infinite(self) -> bool {
        self.0 & 0x7F == 0x7C
    }
}

impl std::fmt::Debug for F8E5M2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.to_f32())
    }
}

impl std::fmt::Display for F8E5M2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.to_f32(), f)
    }
}

impl From<F8E5M2> for f32 {
    fn from(x: F8E5M2) -> f32 {
        x.to_f32()
    }
}

#[cfg(test)]
mod tests {
    use super::{F8E4M3, F8E5M2};

    /// Every code decodes, and encodes back to itself (but for the negative zero's and NaN's
    /// sign, which round-trip as well).
    #[test]
    fn every_code_round_trips() {
        for bits in 0..=255u8 {
            let v = F8E4M3::from_bits(bits);
            if v.is_nan() {
                assert!(v.to_f32().is_nan());
                assert!(F8E4M3::from_f32(v.to_f32()).is_nan());
                continue;
            }
            assert_eq!(
                F8E4M3::from_f32(v.to_f32()).to_bits(),
                bits,
                "code {bits:#04x} = {}",
                v.to_f32()
            );
        }
    }

    /// The reference: the nearest representable value, ties to the even code, by exhaustive
    /// search; over a dense sweep of f32 values of both signs.
    #[test]
    fn conversion_is_round_to_nearest_even_with_saturation() {
        let finite: Vec<(u8, f64)> = (0..=255u8)
            .map(F8E4M3::from_bits)
            .filter(|v| !v.is_nan())
            .map(|v| (v.to_bits(), v.to_f32() as f64))
            .collect();
        let nearest = |x: f64| -> u8 {
            if x >= 448.0 {
                return 0x7E;
            }
            if x <= -448.0 {
                return 0xFE;
            }
            let best = finite
                .iter()
                .map(|&(b, v)| ((v - x).abs(), b))
                .fold((f64::INFINITY, 0u8), |acc, (d, b)| {
                    // Ties: the even mantissa (bit 0 clear); the signs agree with x.
                    let same_sign = (b & 0x80 != 0) == x.is_sign_negative();
                    if d < acc.0 || (d == acc.0 && b & 1 == 0 && same_sign) {
                        (d, b)
                    } else {
                        acc
                    }
                });
            best.1
        };
        let mut x = 1e-4f64;
        while x < 600.0 {
            for v in [x, -x] {
                let got = F8E4M3::from_f32(v as f32);
                let want = F8E4M3::from_bits(nearest(v as f32 as f64));
                assert_eq!(got.to_f32(), want.to_f32(), "{v}");
            }
            x *= 1.0007;
        }
        assert_eq!(F8E4M3::from_f32(f32::INFINITY).to_f32(), 448.0);
        assert_eq!(F8E4M3::from_f32(f32::NEG_INFINITY).to_f32(), -448.0);
        assert!(F8E4M3::from_f32(f32::NAN).is_nan());
        // Halfway between 0 and the smallest subnormal (2^-9) rounds to even: zero.
        assert_eq!(F8E4M3::from_f32(2f32.powi(-10)).to_f32(), 0.0);
    }

    /// Every e5m2 code decodes to the f16 it is the upper byte of, and encodes back to itself
    /// (NaNs to a NaN of their sign; infinities saturate to the largest finite value).
    #[test]
    fn every_e5m2_code_round_trips_through_f32() {
        for bits in 0..=255u8 {
            let v = F8E5M2::from_bits(bits);
            let f = v.to_f32();
            let as_f16 = half::f16::from_bits(u16::from(bits) << 8);
            assert_eq!(f.is_nan(), as_f16.is_nan(), "code {bits:#04x}");
            if v.is_nan() {
                assert!(f.is_nan());
                let back = F8E5M2::from_f32(f);
                assert!(
                    back.is_nan() && back.to_bits() & 0x80 == bits & 0x80,
                    "code {bits:#04x}"
                );
                continue;
            }
            assert_eq!(f.to_bits(), as_f16.to_f32().to_bits(), "code {bits:#04x}");
            if v.is_infinite() {
                assert!(f.is_infinite());
                assert_eq!(F8E5M2::from_f32(f).to_bits(), (bits & 0x80) | 0x7B, "saturates");
                continue;
            }
            assert_eq!(F8E5M2::from_f32(f).to_bits(), bits, "code {bits:#04x} = {f}");
        }
        assert_eq!(F8E5M2::from_bits(0x7C).to_f32(), f32::INFINITY);
        assert_eq!(F8E5M2::from_bits(0xFC).to_f32(), f32::NEG_INFINITY);
        assert_eq!(F8E5M2::from_bits(0x7B).to_f32(), F8E5M2::MAX);
        assert_eq!(F8E5M2::from_bits(0x01).to_f32(), 2f32.powi(-16), "smallest subnormal");
        assert_eq!(F8E5M2::from_bits(0x04).to_f32(), 2f32.powi(-14), "smallest normal");
    }

    /// The reference: the nearest finite value, ties to the even code, by exhaustive search;
    /// over a dense sweep of both signs, every midpoint between neighbours and just off it.
    #[test]
    fn e5m2_conversion_is_round_to_nearest_even_with_saturation() {
        let finite: Vec<(u8, f64)> = (0..=255u8)
            .map(F8E5M2::from_bits)
            .filter(|v| !v.is_nan() && !v.is_infinite())
            .map(|v| (v.to_bits(), v.to_f32() as f64))
            .collect();
        let nearest = |x: f64| -> u8 {
            if x >= 57344.0 {
                return 0x7B;
            }
            if x <= -57344.0 {
                return 0xFB;
            }
            finite
                .iter()
                .map(|&(b, v)| ((v - x).abs(), b))
                .fold((f64::INFINITY, 0u8), |acc, (d, b)| {
                    let same_sign = (b & 0x80 != 0) == x.is_sign_negative();
                    if d < acc.0 || (d == acc.0 && b & 1 == 0 && same_sign) {
                        (d, b)
                    } else {
                        acc
                    }
                })
                .1
        };
        let check = |v: f32| {
            let got = F8E5M2::from_f32(v);
            let want = F8E5M2::from_bits(nearest(v as f64));
            assert_eq!(
                got.to_f32(),
                want.to_f32(),
                "{v:e}: got {:#04x}, want {:#04x}",
                got.to_bits(),
                want.to_bits()
            );
        };
        let mut x = 1e-6f64;
        while x < 1e5 {
            check(x as f32);
            check(-x as f32);
            x *= 1.0007;
        }
        // Ties: the midpoint between neighbours goes to the even code; a hair off it does not.
        for c in 0..0x7Bu8 {
            let (lo, hi) = (F8E5M2::from_bits(c).to_f32(), F8E5M2::from_bits(c + 1).to_f32());
            let mid = (lo + hi) / 2.0;
            let even = if c % 2 == 0 { c } else { c + 1 };
            assert_eq!(
                F8E5M2::from_f32(mid).to_bits(),
                even,
                "midpoint of {c:#04x} and {:#04x}",
                c + 1
            );
            assert_eq!(F8E5M2::from_f32(-mid).to_bits(), 0x80 | even);
            let (above, below) = (f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1));
            assert_eq!(F8E5M2::from_f32(above).to_bits(), c + 1);
            assert_eq!(F8E5M2::from_f32(below).to_bits(), c);
            check(mid);
        }
        // A midpoint that f16 rounding would move: rounding through f16 would round twice.
        let through_f16 = |v: f32| F8E5M2::from_f32(half::f16::from_f32(v).to_f32());
        let tricky = 1.125f32 + 2f32.powi(-12); // just above the 1.0 / 1.25 midpoint
        assert_eq!(F8E5M2::from_f32(tricky).to_f32(), 1.25);
        assert_ne!(
            through_f16(tricky).to_f32(),
            1.25,
            "the test value shows double rounding"
        );
        // Saturation, infinities, NaN, zeros, subnormals.
        assert_eq!(F8E5M2::from_f32(57344.0).to_bits(), 0x7B);
        assert_eq!(
            F8E5M2::from_f32(61440.0).to_bits(),
            0x7B,
            "would round to 65536: saturates"
        );
        assert_eq!(F8E5M2::from_f32(f32::MAX).to_bits(), 0x7B);
        assert_eq!(F8E5M2::from_f32(f32::INFINITY).to_bits(), 0x7B);
        assert_eq!(F8E5M2::from_f32(f32::NEG_INFINITY).to_bits(), 0xFB);
        assert!(F8E5M2::from_f32(f32::NAN).is_nan());
        assert!(F8E5M2::from_f32(-f32::NAN).is_nan());
        assert_eq!(F8E5M2::from_f32(0.0).to_bits(), 0x00);
        assert_eq!(F8E5M2::from_f32(-0.0).to_bits(), 0x80);
        // Halfway between 0 and the smallest subnormal (2^-16) rounds to even: zero; above, up.
        assert_eq!(F8E5M2::from_f32(2f32.powi(-17)).to_bits(), 0x00);
        assert_eq!(
            F8E5M2::from_f32(f32::from_bits(2f32.powi(-17).to_bits() + 1)).to_bits(),
            0x01
        );
        assert_eq!(F8E5M2::from_f32(f32::from_bits(1)).to_bits(), 0x00, "f32 subnormals");
    }
}
