//! fp8 e4m3 (the "fn" variant of the OCP 8-bit float spec, CUDA's `__nv_fp8_e4m3`): 1 sign,
//! 4 exponent (bias 7) and 3 mantissa bits, no infinities, one NaN per sign, largest finite
//! value 448. Conversions from wider types round to nearest even and saturate to ±448, as
//! CUDA's `__NV_SATFINITE` conversion does: a quantised activation that overflows clips, it
//! does not turn into NaN.

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
        let sign = ((x.to_bits() >> 24) & 0x80) as u8;
        if x.is_nan() {
            return F8E4M3(sign | 0x7F);
        }
        let a = x.abs();
        if a >= Self::MAX {
            return F8E4M3(sign | 0x7E);
        }
        // Below 2^-6 the values are subnormal: multiples of 2^-9.
        if a < f32::from_bits(0x3C80_0000) {
            // Exact: a scaling by a power of two; q <= 8, and 8 is the smallest normal's code.
            let q = (a * 512.0).round_ties_even() as u8;
            return F8E4M3(sign | q);
        }
        let e = ((a.to_bits() >> 23) as i32) - 127; // in -6..=8
        let scaled = a * f32::from_bits(((127 + 3 - e) as u32) << 23); // in [8, 16)
        let mut q = scaled.round_ties_even() as u32; // in 8..=16
        let mut e = e;
        if q == 16 {
            q = 8;
            e += 1;
        }
        let code = (((e + 7) as u32) << 3) | (q - 8);
        F8E4M3(sign | code.min(0x7E) as u8)
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

#[cfg(test)]
mod tests {
    use super::F8E4M3;

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
}
