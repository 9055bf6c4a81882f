//! One NCCL communicator handle in nonblocking mode, so that no NCCL call can block past a
//! deadline: every call returns at once, and progress (init, split, finalize, a group) is
//! polled through `ncclCommGetAsyncError` until it completes, fails or runs out of time, when
//! the communicator is aborted.

use crate::contracts::error::{Error, Result};
use crate::gpu::nccl_library::{CommPtr, Config, Nccl, UniqueId, IN_PROGRESS, SUCCESS};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;
use std::time::{Duration, Instant};

pub(crate) struct NcclComm {
    pub lib: &'static Nccl,
    /// Null once aborted or destroyed: ncclCommAbort frees the communicator, so calls hold the
    /// read lock and abort takes the write lock.
    ptr: RwLock<CommPtr>,
    /// Polling loops see this and give up, releasing the read lock so that abort can proceed.
    stop: AtomicBool,
}

// SAFETY: NCCL communicators may be used from any thread; calls are serialised by the
// communicator's executor, and abort/async-error polling are the documented cross-thread calls.
unsafe impl Send for NcclComm {}
// SAFETY: as for Send; the pointer is behind an RwLock and the flag is atomic.
unsafe impl Sync for NcclComm {}

fn nonblocking() -> Config {
    let mut c = Config::new();
    c.blocking = 0;
    c
}

impl NcclComm {
    /// `ncclCommInitRankConfig`, bounded by `timeout` (a rank that never arrives fails here).
    pub(crate) fn init(lib: &'static Nccl, size: usize, id: UniqueId, rank: usize, timeout: Duration) -> Result<Self> {
        let mut ptr: CommPtr = std::ptr::null_mut();
        let mut config = nonblocking();
        // SAFETY: NCCL writes the handle; the id is passed by value; config outlives the call.
        let r = unsafe { (lib.api.ncclCommInitRankConfig)(&mut ptr, size as c_int, id, rank as c_int, &mut config) };
        Self::adopt(lib, ptr, r, "ncclCommInitRankConfig", timeout)
    }

    /// Wraps a handle NCCL returned from `call` (result `r`) and waits until it is ready.
    fn adopt(lib: &'static Nccl, ptr: CommPtr, r: c_int, call: &'static str, timeout: Duration) -> Result<Self> {
        if r != SUCCESS && r != IN_PROGRESS {
            let e = lib.check(call, r, ptr).err();
            if !ptr.is_null() {
                // SAFETY: a handle NCCL returned; it is not used again.
                unsafe { (lib.api.ncclCommAbort)(ptr) };
            }
            return Err(e.unwrap_or_else(|| Error::invalid(call, "failed")));
        }
        let comm = NcclComm {
            lib,
            ptr: RwLock::new(ptr),
            stop: AtomicBool::new(false),
        };
        if let Err(e) = comm.wait_ready(call, timeout) {
            comm.abort();
            return Err(e);
        }
        Ok(comm)
    }

    /// `ncclCommSplit` of this communicator: `color` < 0 joins no group (`None`).
    pub(crate) fn split(&self, color: c_int, key: c_int, timeout: Duration) -> Result<Option<NcclComm>> {
        let mut child: CommPtr = std::ptr::null_mut();
        let mut config = nonblocking();
        let r = self.with("ncclCommSplit", |p| {
            // SAFETY: a live parent; NCCL writes the child handle.
            Ok(unsafe { (self.lib.api.ncclCommSplit)(p, color, key, &mut child, &mut config) })
        })?;
        self.settle("ncclCommSplit", r, timeout)?;
        if child.is_null() {
            return Ok(None);
        }
        Self::adopt(self.lib, child, SUCCESS, "ncclCommSplit", timeout).map(Some)
    }

    /// Runs `f` with the live handle (the read lock keeps abort from freeing it meanwhile).
    pub(crate) fn with<T>(&self, call: &'static str, f: impl FnOnce(CommPtr) -> Result<T>) -> Result<T> {
        let p = self.ptr.read().unwrap_or_else(|p| p.into_inner());
        if p.is_null() {
            return Err(Error::Closed {
                op: call,
                state: "aborted",
            });
        }
        f(*p)
    }

    /// Turns the result of a call on this communicator into ferrocomm's result, waiting out
    /// `ncclInProgress` (nonblocking mode) for at most `timeout`.
    pub(crate) fn settle(&self, call: &'static str, r: c_int, timeout: Duration) -> Result<()> {
        match r {
            SUCCESS => Ok(()),
            IN_PROGRESS => self.wait_ready(call, timeout),
            _ => self.with(call, |p| self.lib.check(call, r, p)),
        }
    }

    /// Polls until the communicator has no operation in progress.
    pub(crate) fn wait_ready(&self, call: &'static str, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            match self.async_state(call)? {
                SUCCESS => return Ok(()),
                IN_PROGRESS => {}
                code => return self.with(call, |p| self.lib.check(call, code, p)),
            }
            if self.stop.load(Ordering::Acquire) {
                return Err(Error::Closed {
                    op: call,
                    state: "aborted",
                });
            }
            if start.elapsed() >= timeout {
                return Err(Error::Timeout {
                    op: call,
                    peer: None,
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// `ncclCommGetAsyncError`: `SUCCESS`, `IN_PROGRESS` or an error code.
    pub(crate) fn async_state(&self, call: &'static str) -> Result<c_int> {
        self.with(call, |p| {
            let mut state = SUCCESS;
            // SAFETY: a live communicator; NCCL writes one result code.
            let r = unsafe { (self.lib.api.ncclCommGetAsyncError)(p, &mut state) };
            self.lib.check("ncclCommGetAsyncError", r, p)?;
            Ok(state)
        })
    }

    /// Completes outstanding work and frees the communicator (`ncclCommFinalize` then
    /// `ncclCommDestroy`); aborts instead when that does not finish within `timeout`.
    pub(crate) fn finalize(&self, timeout: Duration) -> Result<()> {
        let r = self.with("ncclCommFinalize", |p| {
            // SAFETY: a live communicator.
            Ok(unsafe { (self.lib.api.ncclCommFinalize)(p) })
        });
        let done = r.and_then(|r| self.settle("ncclCommFinalize", r, timeout));
        if let Err(e) = done {
            self.abort();
            return Err(e);
        }
        let mut p = self.ptr.write().unwrap_or_else(|p| p.into_inner());
        if !p.is_null() {
            // SAFETY: finalized and live; not used after this.
            let r = unsafe { (self.lib.api.ncclCommDestroy)(*p) };
            *p = std::ptr::null_mut();
            return self.lib.check("ncclCommDestroy", r, std::ptr::null_mut());
        }
        Ok(())
    }

    /// `ncclCommAbort`: stops the communicator's kernels and frees it. Any thread, any time,
    /// idempotent.
    pub(crate) fn abort(&self) {
        self.stop.store(true, Ordering::Release);
        let mut p = self.ptr.write().unwrap_or_else(|p| p.into_inner());
        if !p.is_null() {
            // SAFETY: live; nobody holds the read lock now, and the handle is cleared below.
            unsafe { (self.lib.api.ncclCommAbort)(*p) };
            *p = std::ptr::null_mut();
        }
    }

    pub(crate) fn is_aborted(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let p = *self.ptr.get_mut().unwrap_or_else(|p| p.into_inner());
        if !p.is_null() {
            // Not finalized: a prompt abort rather than a destroy that may wait on peers.
            // SAFETY: live and no longer shared.
            unsafe { (self.lib.api.ncclCommAbort)(p) };
        }
    }
}
