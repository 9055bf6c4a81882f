//! Host arithmetic of the inference collectives, shared by the CPU backend (the oracle) and
//! the device backend's host paths: element rows to and from f32, the residual add and
//! RMSNorm of one token row, and fp8 quantisation. The device kernels implement the same
//! definitions in device-api/include/ferrocomm/norm.cuh.
//!
//! May import: the contracts.

/// Defines `$name` to run `$body` (a function always inlined) compiled for AVX2 + FMA where the
/// CPU has them, else as the build compiled it. A build for baseline x86-64 has 4-wide vectors
/// and a library call per fused multiply-add or round-to-even; the wide copy does the same
/// arithmetic, element by element in the same order (Rust never contracts a multiply and an
/// add on its own, and the sums over a row stay sequential), so it gives the same bits.
macro_rules! wide_where_possible {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $body:ident) => {
        $(#[$doc])*
        pub(crate) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                /// # Safety
                /// The CPU must have AVX2 and FMA.
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if $crate::compute::wide_cpu() {
                    // SAFETY: the CPU has the features `wide` is compiled for.
                    return unsafe { wide($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

/// Whether the CPU has AVX2 and FMA (the standard library caches the answer).
#[cfg(target_arch = "x86_64")]
pub(crate) fn wide_cpu() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

pub(crate) mod rmsnorm;
pub(crate) mod rows;
