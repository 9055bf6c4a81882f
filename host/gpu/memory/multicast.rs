//! Multicast objects (NVLink SHARP): one address range that reaches the same offset of every
//! rank's segment at once, for `multimem` loads that reduce across GPUs in the switch and
//! stores that broadcast. A multicast object binds one allocation per device, so only a team
//! of distinct GPUs can form one, and only where the driver says the device supports it; the
//! device backend agrees on both across ranks before any window uses them.

use super::{result, Physical};
use crate::contracts::error::Result;
use crate::gpu::cuda;
use cudarc::driver::sys::{self, CUdeviceptr};
use std::sync::Arc;

/// Whether GPU `ordinal` supports multicast objects (sm_90 and later behind NVSwitch, with a
/// driver of CUDA 12.1 or later), as its driver reports at run time.
pub(crate) fn multicast_supported(ordinal: usize) -> Result<bool> {
    let ctx = cuda::context(ordinal)?;
    // An older driver does not know the attribute: that is a no, not an error.
    Ok(ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)
        .is_ok_and(|v| v != 0))
}

/// The multicast granularity of a team of `devices` GPUs binding `bytes` each: segments of a
/// window with multicast are a multiple of it.
/// Callers have checked `multicast_supported` (so the driver has the multicast API).
pub(crate) fn granularity(devices: usize, bytes: usize) -> Result<usize> {
    cuda::driver()?;
    // SAFETY: the driver is loaded and supports multicast (see above).
    unsafe { result::multicast_granularity(&result::multicast_prop(devices, bytes.max(1))) }
}

/// A new multicast object for `devices` GPUs with `bytes` (a granularity multiple) each.
pub(crate) fn create(devices: usize, bytes: usize) -> Result<Arc<Physical>> {
    cuda::driver()?;
    // SAFETY: as `granularity`; the caller rounded `bytes`.
    let handle = unsafe { result::multicast_create(&result::multicast_prop(devices, bytes)) }?;
    Ok(Physical::adopt(handle, bytes))
}

/// Adds GPU `ordinal` to the team of `mc`. Every member adds its own GPU before anyone binds
/// (binding blocks until the team is complete).
pub(crate) fn add_device(mc: &Physical, ordinal: usize) -> Result<()> {
    let dev = cuda::context(ordinal)?.cu_device();
    // SAFETY: `mc` is a live multicast object (create, or import of one).
    unsafe { result::multicast_add_device(mc.raw_handle(), dev) }
}

/// This rank's segment bound into a multicast object, and the object mapped for its GPU:
/// `addr() + offset` names byte `offset` of every rank's segment. Unbound and unmapped on drop.
pub(crate) struct MulticastMap {
    va: CUdeviceptr,
    bytes: usize,
    device: sys::CUdevice,
    mc: Arc<Physical>,
    /// The bound segment stays allocated until it is unbound.
    _segment: Arc<Physical>,
}

// SAFETY: device addresses and driver handles are process-wide values; the map is immutable.
unsafe impl Send for MulticastMap {}
// SAFETY: as above.
unsafe impl Sync for MulticastMap {}

impl MulticastMap {
    /// Binds `segment` (whole, at offset 0) and maps `mc` for GPU `ordinal`, aligned to the
    /// team's multicast granularity `g`. Every GPU of the team must have been added to `mc`,
    /// or the driver blocks.
    pub(crate) fn new(ordinal: usize, mc: Arc<Physical>, segment: Arc<Physical>, g: usize) -> Result<MulticastMap> {
        let device = cuda::context(ordinal)?.cu_device();
        let bytes = segment.bytes();
        // SAFETY: both handles are live; the segment's size is a multiple of the granularity
        // (the window rounded it) and no larger than the object's per-device size.
        unsafe { result::multicast_bind(mc.raw_handle(), segment.raw_handle(), bytes) }?;
        let unbind = |e| {
            // SAFETY: bound just above, used by nothing yet.
            let _ = unsafe { result::multicast_unbind(mc.raw_handle(), device, bytes) };
            e
        };
        // SAFETY: bytes and g are granularity multiples.
        let va = unsafe { result::reserve(bytes, g) }.map_err(unbind)?;
        // SAFETY: the range is reserved and unmapped; the object binds `bytes` per device.
        let mapped = unsafe { result::map(va, bytes, mc.raw_handle()) }
            // SAFETY: the range is mapped now.
            .and_then(|()| unsafe { result::allow(va, bytes, ordinal) });
        if let Err(e) = mapped {
            // SAFETY: undo what succeeded; nothing used the range.
            unsafe {
                let _ = result::unmap(va, bytes);
                let _ = result::free_range(va, bytes);
            }
            return Err(unbind(e));
        }
        Ok(MulticastMap {
            va,
            bytes,
            device,
            mc,
            _segment: segment,
        })
    }

    /// The multicast address of byte 0 of every segment.
    pub(crate) fn addr(&self) -> CUdeviceptr {
        self.va
    }
}

impl Drop for MulticastMap {
    fn drop(&mut self) {
        // SAFETY: mapped and bound by new(); the window synchronised its stream first.
        unsafe {
            let _ = result::unmap(self.va, self.bytes);
            if let Err(e) = result::free_range(self.va, self.bytes) {
                tracing::warn!("freeing a multicast address range: {e}");
            }
            if let Err(e) = result::multicast_unbind(self.mc.raw_handle(), self.device, self.bytes) {
                tracing::warn!("unbinding a window segment from its multicast object: {e}");
            }
        }
    }
}
