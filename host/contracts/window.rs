//! The window contract's vocabulary (signal operations, comparisons, sources, what a wait
//! observed, a window's options and spec) and the trait a backend's window implements
//! (`WindowBackend`). The ordering contract is docs/memory-model.md; the public `Window`
//! (window.rs of the public face) checks every argument before it calls a `WindowBackend`.

use crate::contracts::error::{Error, Result};
use crate::contracts::window_handle::WindowHandle;
use cudarc::driver::CudaStream;
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

/// How a signal changes its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalOp {
    /// Store the value (release).
    Set,
    /// Add the value (release read-modify-write).
    Add,
}

/// The comparison a `wait_signal` waits for: `slot <cmp> value`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    /// `slot == value`.
    Eq,
    /// `slot != value`.
    Ne,
    /// `slot >= value` (the usual wait for an epoch counter).
    Ge,
    /// `slot > value`.
    Gt,
    /// `slot <= value`.
    Le,
    /// `slot < value`.
    Lt,
}

impl Cmp {
    /// Whether `have <cmp> want` holds, `have` being the slot's value.
    ///
    /// ```
    /// use ferrocomm::Cmp;
    /// assert!(Cmp::Ge.holds(3, 3));
    /// assert!(!Cmp::Gt.holds(3, 3));
    /// ```
    pub fn holds(self, have: u64, want: u64) -> bool {
        match self {
            Cmp::Eq => have == want,
            Cmp::Ne => have != want,
            Cmp::Ge => have >= want,
            Cmp::Gt => have > want,
            Cmp::Le => have <= want,
            Cmp::Lt => have < want,
        }
    }
}

/// Whose signals a `wait_signal` looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalSource {
    /// The slot written by this rank.
    Rank(usize),
    /// Any one source's slot.
    Any,
    /// The sum over all sources' slots.
    Sum,
}

/// What a `wait_signal` saw when its condition held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observed {
    /// The source whose slot satisfied the condition (`None` for `Sum`).
    pub source: Option<usize>,
    /// That slot's value, or the sum.
    pub value: u64,
}

/// Options of a new window.
#[derive(Clone, Copy, Debug)]
pub struct WindowOptions {
    /// Signal ids per source rank (default 64).
    pub signals: usize,
}

impl Default for WindowOptions {
    fn default() -> Self {
        WindowOptions { signals: 64 }
    }
}

/// What a backend is asked to build. Collective: every rank passes the same values.
pub struct WindowSpec {
    /// Unique per communicator, equal on every rank.
    pub id: u64,
    /// Bytes of data per rank (the segment's user part).
    pub bytes: usize,
    /// Signal ids per source rank.
    pub signals: usize,
    /// User memory to expose (`register`), or `None` to allocate.
    pub registered: Option<*mut u8>,
    /// Bound of every wait of the window (its communicator's timeout).
    pub timeout: Duration,
}

/// A backend's window for one rank. `Window` has checked ranks, ranges and ids before any call.
/// Each method implements the verb of the same name of [`Window`](crate::Window) with the
/// guarantees of docs/memory-model.md.
pub trait WindowBackend: Send + Sync {
    /// Copies `src` into rank `dst`'s segment at byte `offset`; `src` is reusable on return.
    fn put(&self, dst: usize, offset: usize, src: &[u8]) -> Result<()>;
    /// Copies rank `src`'s segment at byte `offset` into `dst`, complete on return.
    fn get(&self, src: usize, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Release-writes this rank's slot of signal `id` on rank `dst` (rule 1).
    fn signal(&self, dst: usize, id: usize, op: SignalOp, value: u64) -> Result<()>;
    /// Waits (acquire, rule 2) until signal `id` from `from` satisfies `cmp value` on this
    /// rank's pad; `Error::Timeout` after `timeout`.
    fn wait_signal(&self, id: usize, from: SignalSource, cmp: Cmp, value: u64, timeout: Duration) -> Result<Observed>;
    /// Atomically adds `value` to the aligned u64 at `dst`:`offset`; returns the old value.
    fn fetch_add(&self, dst: usize, offset: usize, value: u64) -> Result<u64>;
    /// Atomically replaces the aligned u64 at `dst`:`offset` by `desired` if it equals
    /// `expected`; returns the old value.
    fn compare_swap(&self, dst: usize, offset: usize, expected: u64, desired: u64) -> Result<u64>;
    /// Orders this rank's earlier puts and signals to each target before its later ones.
    fn fence(&self) -> Result<()>;
    /// Waits until every earlier put, signal and atomic of this rank is complete at its target.
    fn flush(&self) -> Result<()>;
    /// This rank's segment.
    fn local_base(&self) -> *mut u8;
    /// `rank`'s segment mapped into this process, where it can be.
    fn remote_base(&self, rank: usize) -> Option<*mut u8>;
    /// For windows in GPU memory: the handle kernels take and the rank's stream. The bases
    /// above are then device addresses, never dereferenced on the host.
    fn device(&self) -> Option<(WindowHandle, Arc<CudaStream>)> {
        None
    }
    /// The handle kernels take: for windows in GPU memory, and for the host device's windows
    /// (host memory that the host device's kernels use; `device` is then `None`).
    fn handle(&self) -> Option<WindowHandle> {
        self.device().map(|d| d.0)
    }
    /// The window's proxy queue toward ranks reached over the network, started on first use:
    /// the window network's `HostQueue`, which this layer cannot name
    /// (the network sits above the contracts), so it travels as `Any`.
    fn proxy_queue(&self) -> Result<Arc<dyn Any + Send + Sync>> {
        Err(Error::Unavailable {
            backend: "window".into(),
            reason: "this backend's windows have no host proxy queue".into(),
        })
    }
    /// Waits for the rank's stream and reports an error a kernel recorded (device windows).
    fn synchronize(&self, timeout: Duration) -> Result<()> {
        let _ = timeout;
        Ok(())
    }
}
