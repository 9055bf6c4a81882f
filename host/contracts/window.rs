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
    Eq,
    Ne,
    Ge,
    Gt,
    Le,
    Lt,
}

impl Cmp {
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
    pub bytes: usize,
    pub signals: usize,
    /// User memory to expose (`register`), or `None` to allocate.
    pub registered: Option<*mut u8>,
    pub timeout: Duration,
}

/// A backend's window for one rank. `Window` has checked ranks, ranges and ids before any call.
pub trait WindowBackend: Send + Sync {
    fn put(&self, dst: usize, offset: usize, src: &[u8]) -> Result<()>;
    fn get(&self, src: usize, offset: usize, dst: &mut [u8]) -> Result<()>;
    fn signal(&self, dst: usize, id: usize, op: SignalOp, value: u64) -> Result<()>;
    fn wait_signal(&self, id: usize, from: SignalSource, cmp: Cmp, value: u64, timeout: Duration) -> Result<Observed>;
    fn fetch_add(&self, dst: usize, offset: usize, value: u64) -> Result<u64>;
    fn compare_swap(&self, dst: usize, offset: usize, expected: u64, desired: u64) -> Result<u64>;
    fn fence(&self) -> Result<()>;
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
