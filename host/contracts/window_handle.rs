//! Rust mirrors of device-api/include/ferrocomm/abi.h. The test `abi_layout` compiles that
//! header with the C compiler and compares every size and offset with these.

use cudarc::driver::DeviceRepr;

/// A device wait's error record (`ferrocomm_status`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStatus {
    /// Why the wait gave up: one of the `STATUS_*` constants ([`STATUS_OK`] while none did).
    pub code: u32,
    /// The device verb that recorded it: one of the `OP_*` constants.
    pub op: u32,
    /// The awaited rank, or [`SOURCE_ANY`] / [`SOURCE_SUM`].
    pub peer: i32,
    /// The signal id, for [`OP_WAIT_SIGNAL`] and [`OP_BAD_SIGNAL`].
    pub signal_id: u32,
    /// The value waited for (for [`STATUS_MISMATCH`]: this rank's bytes; for
    /// [`STATUS_ABI_MISMATCH`]: the kernel's ABI version).
    pub expected: u64,
    /// The last value seen (for [`STATUS_MISMATCH`]: the peer's bytes; for
    /// [`STATUS_ABI_MISMATCH`]: the handle's ABI version).
    pub observed: u64,
}

/// [`DeviceStatus::code`]: no device wait has given up.
pub const STATUS_OK: u32 = 0;
/// [`DeviceStatus::code`]: a device wait passed [`WindowHandle::timeout_ns`].
pub const STATUS_TIMEOUT: u32 = 1;
/// [`DeviceStatus::code`]: the communicator was aborted while a kernel waited.
pub const STATUS_ABORTED: u32 = 2;
/// [`DeviceStatus::code`]: a peer's part of a collective disagreed with this rank's
/// (`expected`: this rank's bytes, `observed`: the peer's).
pub const STATUS_MISMATCH: u32 = 3;
/// [`DeviceStatus::code`]: a verb's argument the device cannot carry out (a proxy put whose
/// source is not in the window).
pub const STATUS_INVALID: u32 = 4;
/// [`DeviceStatus::code`]: the handle was made for another ABI than the kernel was compiled
/// for (`expected`: the kernel's version, `observed`: the handle's; `op` 0).
pub const STATUS_ABI_MISMATCH: u32 = 5;
/// [`DeviceStatus::code`]: a peer refused its call of a collective (an argument error found
/// on its host; `peer`: that rank), so nothing moved.
pub const STATUS_REFUSED: u32 = 6;
/// [`DeviceStatus::op`]: `wait_signal`.
pub const OP_WAIT_SIGNAL: u32 = 1;
/// [`DeviceStatus::op`]: the device barrier.
pub const OP_BARRIER: u32 = 2;
/// [`DeviceStatus::op`]: `flush` (waiting for the proxy queue's completions).
pub const OP_FLUSH: u32 = 3;
/// [`DeviceStatus::op`]: one of the library's collective kernels.
pub const OP_COLLECTIVE: u32 = 4;
/// [`DeviceStatus::op`]: a proxy queue push (the queue stayed full past the deadline), or a
/// proxy put whose source (its address in `observed`, `expected` bytes) is not window data.
pub const OP_PROXY: u32 = 5;
/// [`DeviceStatus::op`]: a put, get or atomic whose bytes (`expected` of them, at offset
/// `observed`) leave a segment's data; the verb did nothing.
pub const OP_OUT_OF_WINDOW: u32 = 6;
/// [`DeviceStatus::op`]: a get, atomic or device barrier toward a rank behind the proxy queue,
/// which carries puts and signals only.
pub const OP_NOT_VIA_PROXY: u32 = 7;
/// [`DeviceStatus::op`]: a verb named a rank (`peer`) that is not one of the window's
/// (`expected`: its size); the verb did nothing.
pub const OP_BAD_RANK: u32 = 8;
/// [`DeviceStatus::op`]: a verb named a signal id (`signal_id`) past the pad (`expected`: ids
/// per source); the verb did nothing.
pub const OP_BAD_SIGNAL: u32 = 9;
/// [`DeviceStatus::op`]: an atomic's offset (`observed`) is not 8-byte aligned; it did nothing.
pub const OP_MISALIGNED: u32 = 10;
/// A `wait_signal` source meaning "any one rank's slot satisfies the comparison"
/// (the device form of [`SignalSource::Any`](crate::SignalSource::Any)).
pub const SOURCE_ANY: i32 = -1;
/// A `wait_signal` source meaning "the sum over every rank's slot satisfies the comparison"
/// (the device form of [`SignalSource::Sum`](crate::SignalSource::Sum)).
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
    /// Device address of rank 0's segment.
    pub base: u64,
    /// Bytes between consecutive ranks' segments.
    pub stride: u64,
    /// User bytes per rank, at offset 0 of each segment.
    pub data_bytes: u64,
    /// Byte offset of the signal pad in every segment: `u64` slots `[signal_id][source_rank]`.
    pub signal_offset: u64,
    /// Byte offset of the barrier slots in every segment: `u64` slots `[source_rank]`.
    pub barrier_offset: u64,
    /// Multicast address of the data (`ferrocomm/multimem.cuh`); 0 without multicast.
    pub multicast: u64,
    /// Address of this rank's [`DeviceStatus`] (host-pinned, mapped into the device).
    pub status: u64,
    /// Address of a `u32` that is nonzero once the communicator is aborted.
    pub abort_flag: u64,
    /// Address of the [`ProxyQueue`] toward ranks that are not load/store reachable; 0: none.
    pub fifo: u64,
    /// Deadline of every device wait, nanoseconds.
    pub timeout_ns: u64,
    /// This rank.
    pub rank: i32,
    /// Ranks in the window's communicator.
    pub size: i32,
    /// Signal ids per source rank.
    pub signals: u32,
    /// [`ABI_VERSION`] of the host that made the handle.
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
    /// Address of the descriptor ring, `u64[2 * capacity]` (host-pinned, mapped into the
    /// device).
    pub slots: u64,
    /// Address of the `u64` count of tickets producers have taken (device memory).
    pub head: u64,
    /// Address of the `u64` count of descriptors the proxy has consumed (host-pinned).
    pub tail: u64,
    /// Address of the `u64` count of descriptors complete at their targets (host-pinned);
    /// `flush` waits for it to reach the `head` it saw.
    pub done: u64,
    /// Address of `u8[size]`: nonzero where a rank is reached through this queue.
    pub remote: u64,
    /// Slots in the ring, a power of two.
    pub capacity: u32,
    /// Reserved, 0.
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
