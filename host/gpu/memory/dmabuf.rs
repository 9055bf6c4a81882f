//! GPU memory that a NIC reaches directly (GPUDirect RDMA): with the `rdma` feature, window
//! segments are created RDMA-capable where the driver allows it, and a segment is handed to the verbs layer as a
//! dma-buf descriptor (net::select_links registers it with `ibv_reg_dmabuf_mr`). Whether the
//! NIC's driver can import it is only known when it tries.

use super::result;
use crate::contracts::error::{Error, Result};
use crate::gpu::cuda;
use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr};
use std::os::fd::{FromRawFd, OwnedFd};

/// Whether GPU `ordinal` lets NICs reach cuMem allocations (an older driver does not know the
/// attribute: that is a no).
pub(crate) fn gpu_direct_capable(ordinal: usize) -> bool {
    attribute(
        ordinal,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
    )
}

fn attribute(ordinal: usize, a: CUdevice_attribute) -> bool {
    cuda::context(ordinal).is_ok_and(|ctx| ctx.attribute(a).is_ok_and(|v| v != 0))
}

/// A dma-buf for the `bytes` of GPU `ordinal`'s memory mapped at `va` (a window segment:
/// granularity-aligned, so page-aligned). `Error::Unavailable` where the GPU or its driver
/// cannot export one.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn export(ordinal: usize, va: CUdeviceptr, bytes: usize) -> Result<OwnedFd> {
    let unavailable = |reason: &str| Error::Unavailable {
        backend: "rdma".into(),
        reason: format!("GPU {ordinal} memory cannot be registered with the NIC: {reason}"),
    };
    if !gpu_direct_capable(ordinal) {
        return Err(unavailable(
            "the driver reports no GPUDirect RDMA for cuMem allocations",
        ));
    }
    if !attribute(ordinal, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) {
        return Err(unavailable("the driver does not export dma-bufs"));
    }
    // SAFETY: the caller passes a mapped segment; dma-buf support was checked above.
    let fd = unsafe { result::dmabuf_fd(va, bytes) }?;
    // SAFETY: the driver returned a fresh descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
