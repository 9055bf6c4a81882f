//! Symmetric windows on the GPU: every rank allocates its segment as physical memory
//! (cuMemCreate, exportable as a POSIX fd), and every rank maps all segments side by side into
//! one virtual range of its own, rank r at `base + r * stride`. A device handle then reaches
//! any peer with one multiply-add, in one process (ranks share the physical handles) or across
//! processes (handles travel as fds, gpu/fd_passing.rs).

use super::result;
use crate::contracts::error::{Error, Result};
use crate::gpu::cuda::{self, check};
use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

/// The allocation granularity of GPU `ordinal` for window segments.
pub(crate) fn granularity(ordinal: usize) -> Result<usize> {
    let prop = segment_prop(ordinal)?;
    // SAFETY: the driver is loaded (segment_prop).
    unsafe { result::granularity(&prop) }
}

/// In a build with the `rdma` feature, segments are made reachable by NICs (GPUDirect RDMA)
/// wherever the driver allows it, so a window can carry its links to other hosts over RDMA
/// (net::select_links); without it nothing would register them, so they are plain.
fn segment_prop(ordinal: usize) -> Result<cudarc::driver::sys::CUmemAllocationProp> {
    cuda::driver()?;
    let gpu_direct = cfg!(feature = "rdma") && super::dmabuf::gpu_direct_capable(ordinal);
    Ok(result::device_prop(ordinal, gpu_direct))
}

/// One physical allocation (a rank's segment), released when the last owner drops it.
pub(crate) struct Physical {
    handle: CUmemGenericAllocationHandle,
    bytes: usize,
    /// Created exportable as a POSIX file descriptor (ranks in other processes can map it).
    exportable: bool,
}

// SAFETY: a generic allocation handle is a process-wide value with no thread affinity.
unsafe impl Send for Physical {}
// SAFETY: as above; `Physical` has no interior mutability.
unsafe impl Sync for Physical {}

impl Physical {
    /// `bytes` rounded up to the granularity of `ordinal`.
    pub(crate) fn create(ordinal: usize, bytes: usize) -> Result<Arc<Physical>> {
        let g = granularity(ordinal)?;
        let bytes = bytes.div_ceil(g).max(1) * g;
        let mut prop = segment_prop(ordinal)?;
        // SAFETY: bytes is a multiple of the granularity of this prop.
        let (handle, exportable) = match unsafe { result::create(bytes, &prop) } {
            Ok(h) => (h, true),
            Err(e) if retry_without_fd(&e) => {
                // Some drivers (virtual machines, WSL) cannot make memory exportable as a file
                // descriptor: ranks of this process can still share it.
                tracing::debug!("window memory without a POSIX file descriptor handle: {e}");
                prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
                // SAFETY: as above; the granularity does not depend on the handle type.
                (unsafe { result::create(bytes, &prop) }?, false)
            }
            Err(e) => return Err(e),
        };
        Ok(Arc::new(Physical {
            handle,
            bytes,
            exportable,
        }))
    }

    /// Takes ownership of a handle the driver made (a multicast object), released on drop.
    pub(crate) fn adopt(handle: CUmemGenericAllocationHandle, bytes: usize) -> Arc<Physical> {
        Arc::new(Physical {
            handle,
            bytes,
            exportable: true,
        })
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The driver's handle value: a key for sharing within this process, never a capability.
    pub(crate) fn raw_handle(&self) -> u64 {
        self.handle
    }

    /// A descriptor another process imports with [`Physical::import`].
    pub(crate) fn export(&self) -> Result<OwnedFd> {
        if !self.exportable {
            return Err(Error::Unavailable {
                backend: "device".into(),
                reason: "this driver cannot export GPU memory as a file descriptor, so ranks in other \
                         processes cannot map this rank's window (ranks of one process can)"
                    .into(),
            });
        }
        // SAFETY: the handle is live and was created exportable as a POSIX fd.
        let fd = unsafe { result::export_fd(self.handle) }?;
        // SAFETY: the driver returned a fresh descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub(crate) fn import(fd: &OwnedFd, bytes: usize) -> Result<Arc<Physical>> {
        use std::os::fd::AsRawFd;
        cuda::driver()?;
        // SAFETY: the fd came from export() of a peer on this host (fd_passing checked its uid).
        let handle = unsafe { result::import_fd(fd.as_raw_fd()) }?;
        Ok(Arc::new(Physical {
            handle,
            bytes,
            exportable: true,
        }))
    }
}

/// Whether cuMemCreate's error says the requested POSIX-FD handle type is not supported, so
/// the allocation is worth retrying without it.
fn retry_without_fd(e: &Error) -> bool {
    matches!(e, Error::Backend { call, message, .. }
        if call == "cuMemCreate" && message.contains("CUDA_ERROR_NOT_SUPPORTED"))
}

impl Drop for Physical {
    fn drop(&mut self) {
        // SAFETY: mappings hold their own reference (cuMemMap) so releasing here only frees
        // the memory once it is unmapped everywhere.
        if let Err(e) = unsafe { result::release(self.handle) } {
            tracing::warn!("releasing a window segment: {e}");
        }
    }
}

/// Every rank's segment mapped into this process: segment r at `base + r * stride`, readable
/// and writable by GPU `ordinal`. Ranks of other hosts have no segment here: their slot of the
/// range stays reserved but unmapped (kernels reach them through the proxy queue). Unmapped on
/// drop.
pub(crate) struct SymmetricMap {
    base: CUdeviceptr,
    stride: usize,
    total: usize,
    /// Per rank, the segment mapped in its slot.
    segments: Vec<Option<Arc<Physical>>>,
}

// SAFETY: a device address range is a process-wide value; the map is immutable after creation.
unsafe impl Send for SymmetricMap {}
// SAFETY: as above.
unsafe impl Sync for SymmetricMap {}

impl SymmetricMap {
    /// Maps `segments` (all of one size, a granularity multiple; `None` for a rank that is not
    /// mapped) for GPU `ordinal`.
    pub(crate) fn new(ordinal: usize, segments: Vec<Option<Arc<Physical>>>) -> Result<SymmetricMap> {
        let present = || segments.iter().flatten();
        let stride = present().next().map_or(0, |s| s.bytes);
        if stride == 0 || present().any(|s| s.bytes != stride) {
            return Err(Error::invalid(
                "new_window",
                "window segments differ in size across ranks",
            ));
        }
        let g = granularity(ordinal)?;
        let total = stride * segments.len();
        // SAFETY: total and g are granularity multiples.
        let base = unsafe { result::reserve(total, g) }?;
        let mut map = SymmetricMap {
            base,
            stride,
            total,
            segments: Vec::with_capacity(segments.len()),
        };
        for seg in segments {
            let slot = base + (map.segments.len() * stride) as u64;
            if let Some(seg) = &seg {
                // SAFETY: the slot is reserved and unmapped, its size the segment's.
                unsafe { result::map(slot, stride, seg.handle) }?;
            }
            // Pushed once mapped, so that drop unmaps exactly what was mapped.
            let mapped = seg.is_some();
            map.segments.push(seg);
            if mapped {
                // SAFETY: the slot is mapped now.
                unsafe { result::allow(slot, stride, ordinal) }?;
            }
        }
        Ok(map)
    }

    pub(crate) fn base(&self) -> CUdeviceptr {
        self.base
    }

    pub(crate) fn stride(&self) -> usize {
        self.stride
    }

    /// Whether `rank`'s segment is mapped here.
    pub(crate) fn is_mapped(&self, rank: usize) -> bool {
        self.segments.get(rank).is_some_and(Option::is_some)
    }

    /// The device address of byte `offset` of `rank`'s segment (mapped only where
    /// `is_mapped(rank)`).
    pub(crate) fn addr(&self, rank: usize, offset: usize) -> CUdeviceptr {
        self.base + (rank * self.stride + offset) as u64
    }
}

impl Drop for SymmetricMap {
    fn drop(&mut self) {
        // SAFETY: the slots holding a segment were mapped by new(); the caller synchronised
        // the stream that used them before dropping.
        unsafe {
            for (i, seg) in self.segments.iter().enumerate() {
                if seg.is_some() {
                    let _ = result::unmap(self.base + (i * self.stride) as u64, self.stride);
                }
            }
            if let Err(e) = result::free_range(self.base, self.total) {
                tracing::warn!("freeing a window's address range: {e}");
            }
        }
    }
}

/// Zeroes `bytes` at `addr` on `stream` (used for fresh signal pads and barrier slots).
pub(crate) fn memset_zero(addr: CUdeviceptr, bytes: usize, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller passes a mapped range and a live stream.
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(addr, 0, bytes, stream)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unsupported_handle_type_is_retried() {
        let err = |call: &str, message: &str| Error::Backend {
            backend: "cuda".into(),
            call: call.into(),
            message: message.into(),
        };
        assert!(retry_without_fd(&err(
            "cuMemCreate",
            "CUDA_ERROR_NOT_SUPPORTED: operation not supported"
        )));
        assert!(!retry_without_fd(&err(
            "cuMemCreate",
            "CUDA_ERROR_OUT_OF_MEMORY: out of memory"
        )));
        assert!(!retry_without_fd(&err(
            "cuMemMap",
            "CUDA_ERROR_NOT_SUPPORTED: operation not supported"
        )));
    }
}
