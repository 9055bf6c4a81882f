//! Element-wise reduction of byte buffers on the host: the arithmetic of every CPU collective.
//!
//! Integers wrap (as NCCL's do); f16, bf16 and both fp8 types are combined in f32 and rounded
//! once per step; bools are logical (see [`DType::Bool`]).

use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::fp8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

trait Arith: Copy + Default {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn bitand(self, o: Self) -> Self;
    fn bitor(self, o: Self) -> Self;
    fn bitxor(self, o: Self) -> Self;
    fn div_count(self, n: usize) -> Self;
    fn scale(self, s: f64) -> Self;
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            fn min(self, o: Self) -> Self { Ord::min(self, o) }
            fn max(self, o: Self) -> Self { Ord::max(self, o) }
            fn bitand(self, o: Self) -> Self { self & o }
            fn bitor(self, o: Self) -> Self { self | o }
            fn bitxor(self, o: Self) -> Self { self ^ o }
            fn div_count(self, n: usize) -> Self { self.wrapping_div(n as $t) }
            // The scalar is converted to the element type first (truncating), as NCCL does.
            fn scale(self, s: f64) -> Self { self.wrapping_mul(s as $t) }
        }
    )*};
}
int_arith!(i8, u8, i16, u16, i32, i64, u32, u64);

/// The operand that `m`, the min or max of the values `a` (of `x`) and `b` (of `y`), is: min and
/// max of fp8 elements never convert back from f32, whose conversions saturate (an e5m2
/// infinity stays one). Like f32's min and max, NaN loses to a number.
fn picked<T, W: PartialEq + Copy>(x: T, y: T, a: W, m: W) -> T {
    // `m != m`: both were NaN.
    #[allow(clippy::eq_op)]
    let keep_x = m == a || m != m;
    if keep_x {
        x
    } else {
        y
    }
}

macro_rules! float_arith {
    ($t:ty, $w:ty, $to:expr, $from:expr) => {
        float_arith!($t, $w, $to, $from, |x: $t, y: $t, f: fn($w, $w) -> $w| $from(f(
            $to(x),
            $to(y)
        )));
    };
    ($t:ty, $w:ty, $to:expr, $from:expr, exact) => {
        float_arith!($t, $w, $to, $from, |x: $t, y: $t, f: fn($w, $w) -> $w| {
            let a = $to(x);
            picked(x, y, a, f(a, $to(y)))
        });
    };
    ($t:ty, $w:ty, $to:expr, $from:expr, $minmax:expr) => {
        impl Arith for $t {
            fn add(self, o: Self) -> Self {
                $from($to(self) + $to(o))
            }
            fn mul(self, o: Self) -> Self {
                $from($to(self) * $to(o))
            }
            fn min(self, o: Self) -> Self {
                $minmax(self, o, <$w>::min)
            }
            fn max(self, o: Self) -> Self {
                $minmax(self, o, <$w>::max)
            }
            // Bitwise ops on floats are rejected by `ReduceOp::check` before any data moves.
            fn bitand(self, _: Self) -> Self {
                self
            }
            fn bitor(self, _: Self) -> Self {
                self
            }
            fn bitxor(self, _: Self) -> Self {
                self
            }
            fn div_count(self, n: usize) -> Self {
                $from($to(self) / n as $w)
            }
            fn scale(self, s: f64) -> Self {
                $from($to(self) * s as $w)
            }
        }
    };
}
float_arith!(f32, f32, |x: f32| x, |x: f32| x);
float_arith!(f64, f64, |x: f64| x, |x: f64| x);
float_arith!(f16, f32, f16::to_f32, f16::from_f32);
float_arith!(bf16, f32, bf16::to_f32, bf16::from_f32);
float_arith!(F8E4M3, f32, F8E4M3::to_f32, F8E4M3::from_f32, exact);
float_arith!(F8E5M2, f32, F8E5M2::to_f32, F8E5M2::from_f32, exact);

/// A `bool` as the byte it is stored in, so that a byte other than 0 or 1 from a peer is never
/// read as a `bool`: any nonzero byte is `true`, and every result is 0 or 1.
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
struct BoolByte(u8);

impl BoolByte {
    fn of(b: bool) -> Self {
        BoolByte(u8::from(b))
    }
    fn get(self) -> bool {
        self.0 != 0
    }
}

impl Arith for BoolByte {
    // Sum is or and product is and, as torch reduces bool tensors.
    fn add(self, o: Self) -> Self {
        Self::of(self.get() | o.get())
    }
    fn mul(self, o: Self) -> Self {
        Self::of(self.get() & o.get())
    }
    fn min(self, o: Self) -> Self {
        Self::of(self.get() & o.get())
    }
    fn max(self, o: Self) -> Self {
        Self::of(self.get() | o.get())
    }
    fn bitand(self, o: Self) -> Self {
        Self::of(self.get() & o.get())
    }
    fn bitor(self, o: Self) -> Self {
        Self::of(self.get() | o.get())
    }
    fn bitxor(self, o: Self) -> Self {
        Self::of(self.get() ^ o.get())
    }
    // Avg and premul_sum on bool are rejected by `ReduceOp::check` before any data moves.
    fn div_count(self, _: usize) -> Self {
        self
    }
    fn scale(self, _: f64) -> Self {
        self
    }
}

/// Runs `f` on `bytes` viewed as a slice of `T`, copying through an aligned temporary when the
/// bytes are not aligned for `T` (scratch space is aligned, so that path is rare).
fn with_typed<T: Arith, R>(bytes: &mut [u8], f: impl FnOnce(&mut [T]) -> R) -> R {
    // SAFETY: every `Arith` type is plain old data; `align_to_mut` only yields whole elements.
    let (pre, mid, post) = unsafe { bytes.align_to_mut::<T>() };
    if pre.is_empty() && post.is_empty() {
        return f(mid);
    }
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut tmp = vec![T::default(); n];
    // SAFETY: `tmp` holds exactly `n` elements, `bytes` at least `n * size_of::<T>()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), tmp.as_mut_ptr().cast(), bytes.len()) };
    let r = f(&mut tmp);
    // SAFETY: as above, in the other direction.
    unsafe { std::ptr::copy_nonoverlapping(tmp.as_ptr().cast(), bytes.as_mut_ptr(), bytes.len()) };
    r
}

fn read_typed<T: Arith>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    // SAFETY: as in `with_typed`.
    let (pre, mid, post) = unsafe { bytes.align_to::<T>() };
    if pre.is_empty() && post.is_empty() {
        return std::borrow::Cow::Borrowed(mid);
    }
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut tmp = vec![T::default(); n];
    // SAFETY: `tmp` holds `n` elements and `bytes` has `n * size_of::<T>()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), tmp.as_mut_ptr().cast(), bytes.len()) };
    std::borrow::Cow::Owned(tmp)
}

/// `acc[i] = f(acc[i], src[i])`, monomorphised per operator so the loop vectorises.
#[inline(always)]
fn zip_apply<T: Arith>(acc: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (a, b) in acc.iter_mut().zip(src) {
        *a = f(*a, *b);
    }
}

fn combine<T: Arith>(op: ReduceOp, acc: &mut [u8], src: &[u8]) {
    let src = read_typed::<T>(src);
    with_typed::<T, ()>(acc, |acc| match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => zip_apply(acc, &src, T::add),
        ReduceOp::Prod => zip_apply(acc, &src, T::mul),
        ReduceOp::Min => zip_apply(acc, &src, T::min),
        ReduceOp::Max => zip_apply(acc, &src, T::max),
        ReduceOp::BAnd => zip_apply(acc, &src, T::bitand),
        ReduceOp::BOr => zip_apply(acc, &src, T::bitor),
        ReduceOp::BXor => zip_apply(acc, &src, T::bitxor),
    });
}

macro_rules! dispatch {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            DType::I8 => $f::<i8>($($arg),*),
            DType::U8 => $f::<u8>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
            DType::U32 => $f::<u32>($($arg),*),
            DType::U64 => $f::<u64>($($arg),*),
            DType::F8E4M3 => $f::<F8E4M3>($($arg),*),
            DType::Bool => $f::<BoolByte>($($arg),*),
            DType::I16 => $f::<i16>($($arg),*),
            DType::U16 => $f::<u16>($($arg),*),
            DType::F8E5M2 => $f::<F8E5M2>($($arg),*),
        }
    };
}

/// `acc[i] = acc[i] (op) src[i]`. Avg and premul_sum combine as sums; see [`prologue`] and
/// [`epilogue`] for their scaling. `acc` and `src` must have the same length.
pub(crate) fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8]) {
    debug_assert_eq!(acc.len(), src.len());
    dispatch!(dtype, combine(op, acc, src))
}

fn scale_all<T: Arith>(buf: &mut [u8], s: f64) {
    with_typed::<T, ()>(buf, |b| b.iter_mut().for_each(|x| *x = x.scale(s)));
}

fn div_all<T: Arith>(buf: &mut [u8], n: usize) {
    with_typed::<T, ()>(buf, |b| b.iter_mut().for_each(|x| *x = x.div_count(n)));
}

/// Applied to a rank's own contribution before it is combined with anyone's.
pub(crate) fn prologue(dtype: DType, op: ReduceOp, contribution: &mut [u8]) {
    if let ReduceOp::PremulSum(s) = op {
        dispatch!(dtype, scale_all(contribution, s))
    }
}

/// Applied once to a fully reduced result.
pub(crate) fn epilogue(dtype: DType, op: ReduceOp, world: usize, result: &mut [u8]) {
    if op == ReduceOp::Avg {
        dispatch!(dtype, div_all(result, world))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduced(dtype: DType, op: ReduceOp, acc: &[u8], src: &[u8]) -> Vec<u8> {
        let mut acc = acc.to_vec();
        reduce_into(dtype, op, &mut acc, src);
        acc
    }

    /// Logical on bools, as torch reduces them; any nonzero byte is true, and every result
    /// byte is 0 or 1.
    #[test]
    fn bools_reduce_logically_to_zero_or_one_whatever_the_bytes() {
        let (a, b) = ([0u8, 0, 1, 1, 2, 0xFF], [0u8, 1, 0, 1, 0x80, 7]);
        let or = [0u8, 1, 1, 1, 1, 1];
        let and = [0u8, 0, 0, 1, 1, 1];
        let xor = [0u8, 1, 1, 0, 0, 0];
        for (op, want) in [
            (ReduceOp::Sum, or),
            (ReduceOp::Max, or),
            (ReduceOp::BOr, or),
            (ReduceOp::Prod, and),
            (ReduceOp::Min, and),
            (ReduceOp::BAnd, and),
            (ReduceOp::BXor, xor),
        ] {
            assert_eq!(reduced(DType::Bool, op, &a, &b), want, "{op}");
        }
    }

    /// 16-bit integers wrap like the others; averages divide the wrapped sum.
    #[test]
    fn sixteen_bit_integers_wrap() {
        let bytes = |v: &[i16]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        let got = reduced(DType::I16, ReduceOp::Sum, &bytes(&[i16::MAX, -5]), &bytes(&[1, -7]));
        assert_eq!(got, bytes(&[i16::MIN, -12]));
        let mut avg = bytes(&[30_000]);
        reduce_into(DType::I16, ReduceOp::Avg, &mut avg, &bytes(&[30_000]));
        epilogue(DType::I16, ReduceOp::Avg, 2, &mut avg);
        assert_eq!(avg, bytes(&[60_000u16 as i16 / 2]));
        let u = |v: &[u16]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        let got = reduced(DType::U16, ReduceOp::Prod, &u(&[300, 65_535]), &u(&[300, 2]));
        assert_eq!(got, u(&[(300u32 * 300 % 65_536) as u16, 65_534]));
    }

    /// e5m2 sums round (and saturate) once per step.
    #[test]
    fn e5m2_reduces_in_f32_rounded_and_saturated_per_step() {
        let e = |x: f32| F8E5M2::from_f32(x).to_bits();
        let got = reduced(
            DType::F8E5M2,
            ReduceOp::Sum,
            &[e(1.0), e(40_000.0), e(-3.0)],
            &[e(0.25), e(40_000.0), e(f32::NAN)],
        );
        assert_eq!(got[0], e(1.25));
        assert_eq!(got[1], e(F8E5M2::MAX), "saturates, does not become infinity");
        assert!(F8E5M2::from_bits(got[2]).is_nan());
        // Min and max pick an operand: an infinity stays one, NaN loses to a number.
        let got = reduced(
            DType::F8E5M2,
            ReduceOp::Max,
            &[e(-0.5), 0x7C, 0x7E],
            &[e(0.75), e(1.0), e(2.0)],
        );
        assert_eq!(got, [e(0.75), 0x7C, e(2.0)]);
        let got = reduced(
            DType::F8E5M2,
            ReduceOp::Min,
            &[0xFC, e(3.0), 0x7E],
            &[e(1.0), 0x7F, 0xFF],
        );
        assert_eq!(got[..2], [0xFC, e(3.0)]);
        assert!(F8E5M2::from_bits(got[2]).is_nan());
    }
}
