//! Host-pinned memory mapped into the device: words a kernel writes and the host reads without
//! a copy (a device wait's error record) or the host writes and kernels poll (the abort flag).
//! On the host device ([`Pinned::host`]) plain host memory plays that part: its device address
//! is its host address.

use crate::contracts::error::Result;
use crate::gpu::cuda::{self, check};
use cudarc::driver::sys;

/// `len` zeroed values of `T` in pinned host memory, with their device address.
pub(crate) struct Pinned<T: Copy> {
    host: *mut T,
    device: sys::CUdeviceptr,
    len: usize,
    /// Allocated by the Rust allocator (the host device), not by CUDA.
    on_host: bool,
}

// SAFETY: the memory is owned by this value; accesses go through volatile reads and writes.
unsafe impl<T: Copy + Send> Send for Pinned<T> {}
// SAFETY: as above; concurrent host access is by volatile word reads/writes only.
unsafe impl<T: Copy + Send> Sync for Pinned<T> {}

impl<T: Copy> Pinned<T> {
    /// Needs a current context (cuda::context).
    pub(crate) fn zeroed(len: usize) -> Result<Pinned<T>> {
        cuda::driver()?;
        let bytes = std::mem::size_of::<T>() * len.max(1);
        let mut p = std::ptr::null_mut();
        // PORTABLE: usable from every context, so ranks on different GPUs of one process may
        // share it; DEVICEMAP: it has a device address.
        // SAFETY: the driver writes the pointer; bytes > 0.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(
                &mut p,
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        })?;
        // SAFETY: p is a fresh allocation of `bytes`.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
        let mut device = 0;
        // SAFETY: p is pinned and device-mapped.
        let r = check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, p, 0)
        });
        if let Err(e) = r {
            // SAFETY: p came from cuMemHostAlloc.
            unsafe { sys::cuMemFreeHost(p) };
            return Err(e);
        }
        Ok(Pinned {
            host: p.cast(),
            device,
            len,
            on_host: false,
        })
    }

    /// `len` zeroed values in host memory, for the host device.
    pub(crate) fn host(len: usize) -> Pinned<T> {
        let layout = Self::host_layout(len);
        // SAFETY: the layout has a nonzero size (at least one element, padded to 64 bytes).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Pinned {
            host: p.cast(),
            device: p as u64,
            len,
            on_host: true,
        }
    }

    /// Whole cache lines, so that kernels polling a word share its line with nothing else.
    fn host_layout(len: usize) -> std::alloc::Layout {
        let bytes = std::mem::size_of::<T>()
            .checked_mul(len.max(1))
            .expect("a record count that fits memory")
            .max(1)
            .next_multiple_of(64);
        std::alloc::Layout::from_size_align(bytes, std::mem::align_of::<T>().max(64)).expect("a small layout")
    }

    pub(crate) fn device_addr(&self) -> u64 {
        self.device
    }

    /// The host address of element 0, for callers that share the words through atomics.
    pub(crate) fn host_ptr(&self) -> *mut T {
        self.host
    }

    /// Reads element `i` as the device last wrote it (volatile: the device writes behind our back).
    pub(crate) fn read(&self, i: usize) -> T {
        debug_assert!(i < self.len);
        // SAFETY: in bounds; volatile because the GPU writes concurrently.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }

    pub(crate) fn write(&self, i: usize, v: T) {
        debug_assert!(i < self.len);
        // SAFETY: in bounds; volatile because the GPU reads concurrently.
        unsafe { std::ptr::write_volatile(self.host.add(i), v) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl<T: Copy> Drop for Pinned<T> {
    fn drop(&mut self) {
        if self.on_host {
            // SAFETY: allocated in `host` with this layout; no kernel uses it any more.
            unsafe { std::alloc::dealloc(self.host.cast(), Self::host_layout(self.len)) };
            return;
        }
        // SAFETY: allocated by cuMemHostAlloc; no kernel uses it once its owner is dropped.
        unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}
