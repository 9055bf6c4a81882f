//! Copies between host memory and device memory on a raw stream, for the paths that stage
//! device buffers through the host.

use super::check;
use crate::contracts::error::Result;
use cudarc::driver::sys;

/// Copies `dst.len()` bytes of device memory at `src` into `dst` on the raw stream `stream`,
/// after the stream's earlier work. A copy into pageable memory returns once it is complete.
///
/// # Safety
/// `src` must be a device range of at least `dst.len()` bytes that the caller may read.
pub(crate) unsafe fn device_to_host(dst: &mut [u8], src: u64, stream: u64) -> Result<()> {
    // SAFETY: the caller vouches for `src`; `dst` is ours for its whole length.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), stream as sys::CUstream)
    })
}

/// Copies `src` into device memory at `dst` on the raw stream `stream`. A copy from pageable
/// memory has read `src` when the call returns, so `src` may change then.
///
/// # Safety
/// `dst` must be a device range of at least `src.len()` bytes that the caller may write.
pub(crate) unsafe fn host_to_device(dst: u64, src: &[u8], stream: u64) -> Result<()> {
    // SAFETY: the caller vouches for `dst`; `src` is ours for its whole length.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream as sys::CUstream)
    })
}
