//! Rust mirrors of device-api/include/ferrocomm/abi.h. The test `abi_layout` compiles that
//! header with the C compiler and compares every size and offset with these.

use cudarc::driver::DeviceRepr;

/// A device wait's error record (`ferrocomm_status`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStatus {
    pub code: u32,
    pub op: u32,
    pub peer: i32,
    pub signal_id: u32,
    pub expected: u64,
    pub observed: u64,
}

pub const STATUS_OK: u32 = 0;
pub const STATUS_TIMEOUT: u32 = 1;
pub const STATUS_ABORTED: u32 = 2;
pub const STATUS_MISMATCH: u32 = 3;
pub const STATUS_INVALID: u32 = 4;
pub const STATUS_ABI_MISMATCH: u32 = 5;
pub const OP_WAIT_SIGNAL: u32 = 1;
pub const OP_BARRIER: u32 = 2;
pub const OP_FLUSH: u32 = 3;
pub const OP_COLLECTIVE: u32 = 4;
pub const OP_PROXY: u32 = 5;
pub const SOURCE_ANY: i32 = -1;
pub const SOURCE_SUM: i32 = -2;

/// `FERROCOMM_ABI_VERSION`: the layout of these structs, carried by every [`WindowHandle`].
pub const ABI_VERSION: u32 = 2;

/// One rank's view of a window, passed by value to kernels (`ferrocomm_window_handle`).
/// Rank `r`'s segment is at `base + r * stride`; see the header for the segment layout.
/// `abi_version` is [`ABI_VERSION`] (also in `Default`): kernels compiled for another version
/// refuse the handle.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowHandle {
    pub base: u64,
    pub stride: u64,
    pub data_bytes: u64,
    pub signal_offset: u64,
    pub barrier_offset: u64,
    pub multicast: u64,
    pub status: u64,
    pub abort_flag: u64,
    pub fifo: u64,
    pub timeout_ns: u64,
    pub rank: i32,
    pub size: i32,
    pub signals: u32,
    pub abi_version: u32,
}

impl Default for WindowHandle {
    fn default() -> Self {
        Self {
            base: 0,
            stride: 0,
            data_bytes: 0,
            signal_offset: 0,
            barrier_offset: 0,
            multicast: 0,
            status: 0,
            abort_flag: 0,
            fifo: 0,
            timeout_ns: 0,
            rank: 0,
            size: 0,
            signals: 0,
            abi_version: ABI_VERSION,
        }
    }
}

/// What `WindowHandle::fifo` points at (`ferrocomm_proxy_queue`): the proxy queue toward ranks
/// that are not load/store reachable. The descriptor format is the window network's (net/windows/descriptor.rs).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyQueue {
    pub slots: u64,
    pub head: u64,
    pub tail: u64,
    pub done: u64,
    pub remote: u64,
    pub capacity: u32,
    pub flags: u32,
}

// SAFETY: plain-old-data with the C layout the kernels expect.
unsafe impl DeviceRepr for WindowHandle {}
// SAFETY: as above.
unsafe impl DeviceRepr for ProxyQueue {}
// SAFETY: as above.
unsafe impl DeviceRepr for DeviceStatus {}

const _: () = assert!(std::mem::size_of::<DeviceStatus>() == 32);
const _: () = assert!(std::mem::size_of::<WindowHandle>() == 96);
const _: () = assert!(std::mem::size_of::<ProxyQueue>() == 48);
