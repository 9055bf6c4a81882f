//! Element types and reduction operators.

use half::{bf16, f16};

/// The element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum DType {
    F32 = 1,
    F64 = 2,
    F16 = 3,
    BF16 = 4,
    I8 = 5,
    U8 = 6,
    I32 = 7,
    I64 = 8,
    U32 = 9,
    U64 = 10,
}

impl DType {
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::U32,
        DType::U64,
    ];

    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U32 => "u32",
            DType::U64 => "u64",
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u8 == code)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A plain-old-data element that ferrocomm can move and reduce. Sealed: the byte views the
/// library takes of these slices are sound only for types without padding or invalid bit
/// patterns, which is exactly this list.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, i8 => I8, u8 => U8, i32 => I32, i64 => I64, u32 => U32, u64 => U64);

/// Views a slice of elements as bytes.
pub(crate) fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: `Element` is sealed to integer and float types: no padding, every byte initialised.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Views a mutable slice of elements as bytes.
pub(crate) fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and every bit pattern is a valid value of these types.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

/// A reduction operator.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum ReduceOp {
    Sum,
    Prod,
    Min,
    Max,
    /// Sum divided by the number of ranks (integer division for integer types).
    Avg,
    BAnd,
    BOr,
    BXor,
    /// Each rank's input is multiplied by the scalar before the sum.
    PremulSum(f64),
}

impl ReduceOp {
    pub fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Avg => 5,
            ReduceOp::BAnd => 6,
            ReduceOp::BOr => 7,
            ReduceOp::BXor => 8,
            ReduceOp::PremulSum(_) => 9,
        }
    }

    /// Checks that the operator is defined for `dtype`.
    pub(crate) fn check(self, op: &'static str, dtype: DType) -> crate::contracts::error::Result<()> {
        if self.is_bitwise() && dtype.is_float() {
            return Err(crate::contracts::error::Error::UnsupportedReduce {
                op,
                reduce: self.to_string(),
                dtype: dtype.name(),
            });
        }
        if let ReduceOp::PremulSum(s) = self {
            if !s.is_finite() {
                return Err(crate::contracts::error::Error::invalid(
                    op,
                    format!("premul_sum scalar {s} is not finite"),
                ));
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReduceOp::Sum => f.write_str("sum"),
            ReduceOp::Prod => f.write_str("prod"),
            ReduceOp::Min => f.write_str("min"),
            ReduceOp::Max => f.write_str("max"),
            ReduceOp::Avg => f.write_str("avg"),
            ReduceOp::BAnd => f.write_str("band"),
            ReduceOp::BOr => f.write_str("bor"),
            ReduceOp::BXor => f.write_str("bxor"),
            ReduceOp::PremulSum(s) => write!(f, "premul_sum({s})"),
        }
    }
}
