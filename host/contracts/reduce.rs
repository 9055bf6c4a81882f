//! Element-wise reduction of byte buffers on the host: the arithmetic of every CPU collective.
//!
//! Integers wrap (as NCCL's do); f16 and bf16 are combined in f32 and rounded once per step.

use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::fp8::F8E4M3;
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
int_arith!(i8, u8, i32, i64, u32, u64);

macro_rules! float_arith {
    ($t:ty, $w:ty, $to:expr, $from:expr) => {
        impl Arith for $t {
            fn add(self, o: Self) -> Self {
                $from($to(self) + $to(o))
            }
            fn mul(self, o: Self) -> Self {
                $from($to(self) * $to(o))
            }
            fn min(self, o: Self) -> Self {
                $from($to(self).min($to(o)))
            }
            fn max(self, o: Self) -> Self {
                $from($to(self).max($to(o)))
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
float_arith!(F8E4M3, f32, F8E4M3::to_f32, F8E4M3::from_f32);

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
