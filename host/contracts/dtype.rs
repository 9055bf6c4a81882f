//! Element types and reduction operators.

use half::{bf16, f16};

/// The element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum DType {
    /// IEEE 754 binary32 (`f32`).
    F32 = 1,
    /// IEEE 754 binary64 (`f64`).
    F64 = 2,
    /// IEEE 754 binary16 ([`f16`](crate::f16)); reductions combine in `f32`.
    F16 = 3,
    /// bfloat16 ([`bf16`](crate::bf16)); reductions combine in `f32`.
    BF16 = 4,
    /// Signed 8-bit integer (`i8`); arithmetic wraps.
    I8 = 5,
    /// Unsigned 8-bit integer (`u8`); arithmetic wraps.
    U8 = 6,
    /// Signed 32-bit integer (`i32`); arithmetic wraps.
    I32 = 7,
    /// Signed 64-bit integer (`i64`); arithmetic wraps.
    I64 = 8,
    /// Unsigned 32-bit integer (`u32`); arithmetic wraps.
    U32 = 9,
    /// Unsigned 64-bit integer (`u64`); arithmetic wraps.
    U64 = 10,
    /// fp8 e4m3 ([`F8E4M3`](crate::F8E4M3)); reductions combine in `f32`, rounded (with
    /// saturation) once per step.
    F8E4M3 = 11,
    /// `bool`, one byte (0 or 1). Reductions are logical, as torch's are on bool tensors:
    /// `Sum`, `Max` and `BOr` are or, `Prod`, `Min` and `BAnd` are and, `BXor` is exclusive or;
    /// `Avg` and `PremulSum` are `Error::UnsupportedReduce`. A received byte other than 0 or 1
    /// (which a peer could only send from unsafe code or another language) reads as `true`.
    Bool = 12,
    /// Signed 16-bit integer (`i16`); arithmetic wraps.
    I16 = 13,
    /// Unsigned 16-bit integer (`u16`); arithmetic wraps.
    U16 = 14,
    /// fp8 e5m2 ([`F8E5M2`](crate::F8E5M2)); reductions combine in `f32`, rounded (with
    /// saturation) once per step.
    F8E5M2 = 15,
}

impl DType {
    /// Every element type, in the order of their wire codes.
    pub const ALL: [DType; 15] = [
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
        DType::F8E4M3,
        DType::Bool,
        DType::I16,
        DType::U16,
        DType::F8E5M2,
    ];

    /// Bytes per element (1, 2, 4 or 8).
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::F8E4M3 | DType::F8E5M2 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Whether the type is a floating-point one (bitwise reductions are refused on these).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    /// The Rust name of the type (`"f32"`, `"bf16"`, ...), as errors and logs print it.
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
            DType::F8E4M3 => "f8e4m3",
            DType::Bool => "bool",
            DType::I16 => "i16",
            DType::U16 => "u16",
            DType::F8E5M2 => "f8e5m2",
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
/// library takes of these slices are sound only for types without padding, which is exactly
/// this list.
///
/// Every type of the list but `bool` accepts every bit pattern. `bool` accepts 0 and 1 only, so
/// the library never leaves another byte where a caller can read a `bool`: every operation that
/// writes into host memory of `bool` elements (a collective's or a receive's output, a window's
/// `get` and `read_local`) rewrites each byte as 0 or 1 (any other byte becomes `true`)
/// before the caller gets the slice back, and a window cannot be registered over `bool` memory,
/// which peers could write at any time. Only a peer outside safe Rust (unsafe code, another
/// language, a device kernel) can send such a byte: safe `bool`s are 0 or 1, and every
/// reduction of them stays 0 or 1. `bool` elements in device memory are moved as they are.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The [`DType`] that buffers of this type carry.
    ///
    /// ```
    /// use ferrocomm::{bf16, DType, Element};
    /// assert_eq!(<bf16 as Element>::DTYPE, DType::BF16);
    /// assert_eq!(u64::DTYPE.size(), 8);
    /// assert_eq!(bool::DTYPE.size(), 1);
    /// ```
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(
    f32 => F32,
    f64 => F64,
    f16 => F16,
    bf16 => BF16,
    i8 => I8,
    u8 => U8,
    i16 => I16,
    u16 => U16,
    i32 => I32,
    i64 => I64,
    u32 => U32,
    u64 => U64,
    bool => Bool,
    crate::contracts::fp8::F8E4M3 => F8E4M3,
    crate::contracts::fp8::F8E5M2 => F8E5M2
);

/// Views a slice of elements as bytes.
pub(crate) fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: `Element` is sealed to integer, float and bool types: no padding, every byte
    // initialised.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Views a mutable slice of elements as bytes. The caller writes only valid values of `T`
/// through it, or calls [`normalise`] on the bytes before `s` is read as `T` again (the one
/// element type with invalid bit patterns is `bool`).
pub(crate) fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as above; every bit pattern is a valid value of these types but `bool`'s, whose
    // bytes the library normalises before the slice is read again (see `Element`).
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Makes `bytes`, just written as elements of `dtype`, valid values of it: a `bool` byte other
/// than 0 or 1 becomes 1 (`true`). Every other element type accepts every bit pattern.
pub(crate) fn normalise(dtype: DType, bytes: &mut [u8]) {
    if dtype == DType::Bool {
        bytes.iter_mut().for_each(|b| *b = u8::from(*b != 0));
    }
}

/// A reduction operator.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Elementwise sum (logical or on `bool`).
    Sum,
    /// Elementwise product (logical and on `bool`).
    Prod,
    /// Elementwise minimum (exact: no rounding; logical and on `bool`).
    Min,
    /// Elementwise maximum (exact: no rounding; logical or on `bool`).
    Max,
    /// Sum divided by the number of ranks (integer division for integer types;
    /// `Error::UnsupportedReduce` on `bool`).
    Avg,
    /// Bitwise AND; integer types and `bool` only (`Error::UnsupportedReduce` on floats).
    BAnd,
    /// Bitwise OR; integer types and `bool` only (`Error::UnsupportedReduce` on floats).
    BOr,
    /// Bitwise exclusive OR; integer types and `bool` only (`Error::UnsupportedReduce` on
    /// floats).
    BXor,
    /// Each rank's input is multiplied by the scalar before the sum; the scalar must be
    /// finite (`Error::InvalidArgument` otherwise); `Error::UnsupportedReduce` on `bool`.
    PremulSum(f64),
}

impl ReduceOp {
    /// Whether the op is `BAnd`, `BOr` or `BXor`, defined on integer types and `bool` only.
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

    /// Whether the operator is defined for `dtype`: bitwise ops are not on floats, and `bool`
    /// has no average or scaled sum (its other ops are logical; see [`DType::Bool`]).
    pub fn is_defined_for(self, dtype: DType) -> bool {
        let float_bits = self.is_bitwise() && dtype.is_float();
        let bool_arith = dtype == DType::Bool && matches!(self, ReduceOp::Avg | ReduceOp::PremulSum(_));
        !float_bits && !bool_arith
    }

    /// Checks that the operator is defined for `dtype`.
    pub(crate) fn check(self, op: &'static str, dtype: DType) -> crate::contracts::error::Result<()> {
        if !self.is_defined_for(dtype) {
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
