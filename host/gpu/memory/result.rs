//! One checked call per driver function of the virtual memory API (cudarc's `sys` layer
//! underneath). Callers must have passed `cuda::driver()`.

use crate::contracts::error::Result;
use crate::gpu::cuda::check;
use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle};

/// The allocation properties of every window segment: pinned device memory on `ordinal`,
/// exportable as a POSIX file descriptor, and reachable by NICs where `gpu_direct`.
pub(crate) fn device_prop(ordinal: usize, gpu_direct: bool) -> sys::CUmemAllocationProp {
    // SAFETY: the struct is plain data for which all-zero is the documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal as i32;
    prop.allocFlags.gpuDirectRDMACapable = gpu_direct.into();
    prop
}

/// # Safety: the driver is loaded.
pub(crate) unsafe fn granularity(prop: &sys::CUmemAllocationProp) -> Result<usize> {
    let mut g = 0usize;
    check(
        "cuMemGetAllocationGranularity",
        sys::cuMemGetAllocationGranularity(
            &mut g,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        ),
    )?;
    Ok(g)
}

/// # Safety: `bytes` is a multiple of the granularity of `prop`.
pub(crate) unsafe fn create(bytes: usize, prop: &sys::CUmemAllocationProp) -> Result<CUmemGenericAllocationHandle> {
    let mut h = 0;
    check("cuMemCreate", sys::cuMemCreate(&mut h, bytes, prop, 0))?;
    Ok(h)
}

/// # Safety: `h` is a live handle created with a POSIX FD handle type.
pub(crate) unsafe fn export_fd(h: CUmemGenericAllocationHandle) -> Result<i32> {
    let mut fd: i32 = -1;
    check(
        "cuMemExportToShareableHandle",
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut i32).cast(),
            h,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        ),
    )?;
    Ok(fd)
}

/// # Safety: `fd` came from `export_fd` in some process of this host.
pub(crate) unsafe fn import_fd(fd: i32) -> Result<CUmemGenericAllocationHandle> {
    let mut h = 0;
    // The driver takes the descriptor's value, passed in the pointer-sized argument.
    check(
        "cuMemImportFromShareableHandle",
        sys::cuMemImportFromShareableHandle(
            &mut h,
            fd as isize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        ),
    )?;
    Ok(h)
}

/// # Safety: `h` is live and no mapping uses it after its last release.
pub(crate) unsafe fn release(h: CUmemGenericAllocationHandle) -> Result<()> {
    check("cuMemRelease", sys::cuMemRelease(h))
}

/// # Safety: `bytes` and `align` are multiples of the granularity.
pub(crate) unsafe fn reserve(bytes: usize, align: usize) -> Result<CUdeviceptr> {
    let mut va = 0;
    check(
        "cuMemAddressReserve",
        sys::cuMemAddressReserve(&mut va, bytes, align, 0, 0),
    )?;
    Ok(va)
}

/// # Safety: `va..va+bytes` is reserved and unmapped; `bytes` is the handle's size.
pub(crate) unsafe fn map(va: CUdeviceptr, bytes: usize, h: CUmemGenericAllocationHandle) -> Result<()> {
    check("cuMemMap", sys::cuMemMap(va, bytes, 0, h, 0))
}

/// Read-write access for GPU `ordinal` to the mapped range `va..va+bytes`.
/// # Safety: the range is fully mapped.
pub(crate) unsafe fn allow(va: CUdeviceptr, bytes: usize, ordinal: usize) -> Result<()> {
    // SAFETY: plain data; zero is a valid start.
    let mut desc: sys::CUmemAccessDesc = std::mem::zeroed();
    desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal as i32;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check("cuMemSetAccess", sys::cuMemSetAccess(va, bytes, &desc, 1))
}

/// # Safety: the range was mapped by `map` and nothing uses it any more.
pub(crate) unsafe fn unmap(va: CUdeviceptr, bytes: usize) -> Result<()> {
    check("cuMemUnmap", sys::cuMemUnmap(va, bytes))
}

/// # Safety: the range came from `reserve` and is unmapped.
pub(crate) unsafe fn free_range(va: CUdeviceptr, bytes: usize) -> Result<()> {
    check("cuMemAddressFree", sys::cuMemAddressFree(va, bytes))
}

/// The properties of a multicast object over `devices` GPUs with `bytes` per GPU, shareable as
/// a POSIX file descriptor (how other processes of the team import it).
pub(crate) fn multicast_prop(devices: usize, bytes: usize) -> sys::CUmulticastObjectProp {
    // SAFETY: plain data; flags must be zero.
    let mut prop: sys::CUmulticastObjectProp = unsafe { std::mem::zeroed() };
    prop.numDevices = devices as u32;
    prop.size = bytes;
    prop.handleTypes = u64::from(sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0);
    prop
}

/// The smallest unit a multicast object binds and maps: segment sizes and offsets are
/// multiples of it.
/// # Safety: the driver is loaded and has the multicast API (CUDA 12.1 and later).
pub(crate) unsafe fn multicast_granularity(prop: &sys::CUmulticastObjectProp) -> Result<usize> {
    let mut g = 0usize;
    check(
        "cuMulticastGetGranularity",
        sys::cuMulticastGetGranularity(
            &mut g,
            prop,
            sys::CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_MINIMUM,
        ),
    )?;
    Ok(g)
}

/// # Safety: as `multicast_granularity`; `prop.size` is a multiple of that granularity.
pub(crate) unsafe fn multicast_create(prop: &sys::CUmulticastObjectProp) -> Result<CUmemGenericAllocationHandle> {
    let mut h = 0;
    check("cuMulticastCreate", sys::cuMulticastCreate(&mut h, prop))?;
    Ok(h)
}

/// # Safety: `mc` is a live multicast object; `dev` is a device handle of the driver.
pub(crate) unsafe fn multicast_add_device(mc: CUmemGenericAllocationHandle, dev: sys::CUdevice) -> Result<()> {
    check("cuMulticastAddDevice", sys::cuMulticastAddDevice(mc, dev))
}

/// Binds all of `mem` (`bytes`) at offset 0 of `mc`. Blocks until every device of the team
/// has been added.
/// # Safety: both handles are live; `bytes` is a multiple of the multicast granularity.
pub(crate) unsafe fn multicast_bind(
    mc: CUmemGenericAllocationHandle,
    mem: CUmemGenericAllocationHandle,
    bytes: usize,
) -> Result<()> {
    check("cuMulticastBindMem", sys::cuMulticastBindMem(mc, 0, mem, 0, bytes, 0))
}

/// # Safety: `bytes` at offset 0 of `mc` were bound for `dev` and nothing uses them any more.
pub(crate) unsafe fn multicast_unbind(
    mc: CUmemGenericAllocationHandle,
    dev: sys::CUdevice,
    bytes: usize,
) -> Result<()> {
    check("cuMulticastUnbind", sys::cuMulticastUnbind(mc, dev, 0, bytes))
}

/// A dma-buf descriptor for `[va, va + bytes)`, mapped memory of this process.
/// # Safety: the range is mapped and page-aligned; the driver supports dma-buf.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) unsafe fn dmabuf_fd(va: CUdeviceptr, bytes: usize) -> Result<i32> {
    let mut fd: i32 = -1;
    check(
        "cuMemGetHandleForAddressRange",
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast(),
            va,
            bytes,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        ),
    )?;
    Ok(fd)
}
