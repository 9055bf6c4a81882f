//! One checked call per driver function of the virtual memory API (cudarc's `sys` layer
//! underneath). Callers must have passed `cuda::driver()`.
//!
//! Every function here is `unsafe` for the driver's preconditions, written in its `# Safety`
//! section; each body's one `unsafe` block is the driver call, whose pointer arguments are
//! references or locals that outlive it, so the caller's contract is all that it needs.

use crate::contracts::error::Result;
use crate::gpu::cuda::check;
use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle};

/// The allocation properties of every window segment: pinned device memory on `ordinal`,
/// exportable as a POSIX file descriptor, and reachable by NICs where `gpu_direct`.
pub(crate) fn device_prop(ordinal: usize, gpu_direct: bool) -> sys::CUmemAllocationProp {
    // SAFETY: a C struct of integers, C enums and raw pointers, for which all-zero is valid
    // (null pointers, the zero enum values) and is the documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal as i32;
    prop.allocFlags.gpuDirectRDMACapable = gpu_direct.into();
    prop
}

/// # Safety
/// The driver is loaded.
pub(crate) unsafe fn granularity(prop: &sys::CUmemAllocationProp) -> Result<usize> {
    let mut g = 0usize;
    // SAFETY: the caller's contract; `g` and `prop` are valid for the call.
    let r = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    };
    check("cuMemGetAllocationGranularity", r)?;
    Ok(g)
}

/// # Safety
/// The driver is loaded; `bytes` is a multiple of the granularity of `prop`.
pub(crate) unsafe fn create(bytes: usize, prop: &sys::CUmemAllocationProp) -> Result<CUmemGenericAllocationHandle> {
    let mut h = 0;
    // SAFETY: the caller's contract; `h` and `prop` are valid for the call.
    check("cuMemCreate", unsafe { sys::cuMemCreate(&mut h, bytes, prop, 0) })?;
    Ok(h)
}

/// # Safety
/// `h` is a live handle created with a POSIX FD handle type.
pub(crate) unsafe fn export_fd(h: CUmemGenericAllocationHandle) -> Result<i32> {
    let mut fd: i32 = -1;
    // SAFETY: the caller's contract; for the POSIX FD type the driver writes an int, for which
    // `fd` has room.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut i32).cast(),
            h,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    check("cuMemExportToShareableHandle", r)?;
    Ok(fd)
}

/// # Safety
/// The driver is loaded; `fd` came from `export_fd` in some process of this host.
pub(crate) unsafe fn import_fd(fd: i32) -> Result<CUmemGenericAllocationHandle> {
    let mut h = 0;
    // The driver takes the descriptor's value, passed in the pointer-sized argument.
    // SAFETY: the caller's contract; the argument is a value, not dereferenced; `h` is valid.
    let r = unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut h,
            fd as isize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    check("cuMemImportFromShareableHandle", r)?;
    Ok(h)
}

/// # Safety
/// `h` is live and no mapping uses it after its last release.
pub(crate) unsafe fn release(h: CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
}

/// # Safety
/// The driver is loaded; `bytes` and `align` are multiples of the granularity.
pub(crate) unsafe fn reserve(bytes: usize, align: usize) -> Result<CUdeviceptr> {
    let mut va = 0;
    // SAFETY: the caller's contract; `va` is valid for the call.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut va, bytes, align, 0, 0)
    })?;
    Ok(va)
}

/// # Safety
/// `va..va+bytes` is reserved and unmapped; `bytes` is the handle's size.
pub(crate) unsafe fn map(va: CUdeviceptr, bytes: usize, h: CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemMap", unsafe { sys::cuMemMap(va, bytes, 0, h, 0) })
}

/// Read-write access for GPU `ordinal` to the mapped range `va..va+bytes`.
///
/// # Safety
/// The range is fully mapped.
pub(crate) unsafe fn allow(va: CUdeviceptr, bytes: usize, ordinal: usize) -> Result<()> {
    // SAFETY: a C struct of integers and C enums whose zero value is valid (all-zero is
    // CU_MEM_LOCATION_TYPE_INVALID / CU_MEM_ACCESS_FLAGS_PROT_NONE); the fields are set below.
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal as i32;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: the caller's contract; `desc` is one valid descriptor, as the count says.
    check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(va, bytes, &desc, 1) })
}

/// # Safety
/// The range was mapped by `map` and nothing uses it any more.
pub(crate) unsafe fn unmap(va: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(va, bytes) })
}

/// # Safety
/// The range came from `reserve` and is unmapped.
pub(crate) unsafe fn free_range(va: CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(va, bytes) })
}

/// The properties of a multicast object over `devices` GPUs with `bytes` per GPU, shareable as
/// a POSIX file descriptor (how other processes of the team import it).
pub(crate) fn multicast_prop(devices: usize, bytes: usize) -> sys::CUmulticastObjectProp {
    // SAFETY: a C struct of integers, for which all-zero is valid; `flags` must be zero.
    let mut prop: sys::CUmulticastObjectProp = unsafe { std::mem::zeroed() };
    prop.numDevices = devices as u32;
    prop.size = bytes;
    prop.handleTypes = u64::from(sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0);
    prop
}

/// The smallest unit a multicast object binds and maps: segment sizes and offsets are
/// multiples of it.
///
/// # Safety
/// The driver is loaded and has the multicast API (CUDA 12.1 and later).
pub(crate) unsafe fn multicast_granularity(prop: &sys::CUmulticastObjectProp) -> Result<usize> {
    let mut g = 0usize;
    // SAFETY: the caller's contract; `g` and `prop` are valid for the call.
    let r = unsafe {
        sys::cuMulticastGetGranularity(
            &mut g,
            prop,
            sys::CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_MINIMUM,
        )
    };
    check("cuMulticastGetGranularity", r)?;
    Ok(g)
}

/// # Safety
/// As `multicast_granularity`; `prop.size` is a multiple of that granularity.
pub(crate) unsafe fn multicast_create(prop: &sys::CUmulticastObjectProp) -> Result<CUmemGenericAllocationHandle> {
    let mut h = 0;
    // SAFETY: the caller's contract; `h` and `prop` are valid for the call.
    check("cuMulticastCreate", unsafe { sys::cuMulticastCreate(&mut h, prop) })?;
    Ok(h)
}

/// # Safety
/// `mc` is a live multicast object; `dev` is a device handle of the driver.
pub(crate) unsafe fn multicast_add_device(mc: CUmemGenericAllocationHandle, dev: sys::CUdevice) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMulticastAddDevice", unsafe { sys::cuMulticastAddDevice(mc, dev) })
}

/// Binds all of `mem` (`bytes`) at offset 0 of `mc`. Blocks until every device of the team
/// has been added.
///
/// # Safety
/// Both handles are live; `bytes` is a multiple of the multicast granularity.
pub(crate) unsafe fn multicast_bind(
    mc: CUmemGenericAllocationHandle,
    mem: CUmemGenericAllocationHandle,
    bytes: usize,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMulticastBindMem", unsafe {
        sys::cuMulticastBindMem(mc, 0, mem, 0, bytes, 0)
    })
}

/// # Safety
/// `bytes` at offset 0 of `mc` were bound for `dev` and nothing uses them any more.
pub(crate) unsafe fn multicast_unbind(
    mc: CUmemGenericAllocationHandle,
    dev: sys::CUdevice,
    bytes: usize,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMulticastUnbind", unsafe {
        sys::cuMulticastUnbind(mc, dev, 0, bytes)
    })
}

/// A dma-buf descriptor for `[va, va + bytes)`, mapped memory of this process.
///
/// # Safety
/// The range is mapped and page-aligned; the driver supports dma-buf.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) unsafe fn dmabuf_fd(va: CUdeviceptr, bytes: usize) -> Result<i32> {
    let mut fd: i32 = -1;
    // SAFETY: the caller's contract; for the dma-buf type the driver writes an int, for which
    // `fd` has room.
    let r = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast(),
            va,
            bytes,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    check("cuMemGetHandleForAddressRange", r)?;
    Ok(fd)
}
