//! Scoped asynchronous operations: [`Scope`] issues them (like `std::thread::scope`, it waits
//! for all of them before it returns, so the borrowed buffers provably outlive the work) and
//! [`ScopedWork`] is one of them in flight. They run in issue order on the communicator's
//! executor. Operations that own their buffers, and so can outlive any scope, are
//! `owned_work.rs`'s.

use crate::comm::Comm;
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::Op;
use crate::contracts::options::OpOptions;
use crate::executor::{Completion, Task};
use crate::gpu::cuda::stream;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An operation of a [`Scope`] in flight. The scope waits for it anyway; only `wait` (or
/// `wait_timeout`) reports its result. (An operation that owns its buffers returns a
/// [`Work`](crate::Work), which can be kept beyond any scope.)
#[must_use = "the scope waits for an unwaited ScopedWork, but its error is then lost"]
pub struct ScopedWork<'scope> {
    done: Arc<Completion>,
    op: &'static str,
    _scope: PhantomData<&'scope ()>,
}

impl ScopedWork<'_> {
    /// Blocks until the operation ends (it ends by itself: its timeout bounds every stall).
    /// An operation a GPU backend left running on its own stream is then ordered before later
    /// work on the calling thread's current stream (the host does not wait for the GPU).
    pub fn wait(self) -> Result<()> {
        self.done.wait(None).unwrap_or(Ok(()))?;
        self.done.fence.stream_wait(stream::current())
    }

    /// Blocks at most `limit`; `Error::Timeout` if the operation is still running then (it
    /// keeps running; wait again later).
    pub fn wait_timeout(&self, limit: Duration) -> Result<()> {
        self.done.wait(Some(limit)).unwrap_or(Err(Error::Timeout {
            op: self.op,
            peer: None,
            after: limit,
        }))?;
        self.done.fence.stream_wait(stream::current())
    }

    /// Whether the operation has finished, on the device too (a failed device query counts as
    /// finished: `wait` reports it).
    pub fn is_completed(&self) -> bool {
        self.done.is_done() && self.done.fence.is_complete().unwrap_or(true)
    }
}

/// Issues asynchronous operations whose buffers live at least as long as the scope.
/// Created by `Comm::scope`.
pub struct Scope<'scope, 'env: 'scope> {
    pub(crate) comm: &'scope Comm,
    pending: Mutex<Vec<Arc<Completion>>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'scope, 'env> Scope<'scope, 'env> {
    pub(crate) fn new(comm: &'scope Comm) -> Self {
        Scope {
            comm,
            pending: Mutex::default(),
            _scope: PhantomData,
            _env: PhantomData,
        }
    }

    /// Validates `op` and queues it; returns its [`ScopedWork`].
    pub fn start(&'scope self, op: Op<'scope>, opts: &OpOptions) -> Result<ScopedWork<'scope>> {
        let name = op.name();
        self.spawn(self.comm.prepare(op, opts)?, name)
    }

    /// Queues a task that borrows data for 'scope.
    pub(crate) fn spawn(&'scope self, task: Task<'scope>, name: &'static str) -> Result<ScopedWork<'scope>> {
        // SAFETY: the task borrows for 'scope, and `Comm::scope` waits for every pending
        // completion (also when the scope body panics) before 'scope ends.
        let done = unsafe { self.comm.executor().submit(task, name) }?;
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(done.clone());
        Ok(ScopedWork {
            done,
            op: name,
            _scope: PhantomData,
        })
    }

    pub(crate) fn wait_all(&self) {
        for c in self.pending.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = c.wait(None);
            // Device buffers borrowed by the scope are in use until the GPU passes the fence;
            // order the current stream after it, as `Work::wait` would.
            let _ = c.fence.stream_wait(stream::current());
        }
    }
}

/// Asynchronous operations on the communicator.
impl Comm {
    /// Runs `f` with a [`Scope`] for asynchronous operations on buffers that outlive the scope;
    /// returns after every operation started in it has ended. Results reach the caller through
    /// [`ScopedWork::wait`]; the error of a `ScopedWork` that is never waited for is dropped.
    pub fn scope<'env, F, T>(&self, f: F) -> T
    where
        F: for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> T,
    {
        let scope = Scope::new(self);
        // Waits even when `f` panics: queued operations must not outlive their buffers.
        struct WaitOnExit<'a, 's, 'e>(&'a Scope<'s, 'e>);
        impl Drop for WaitOnExit<'_, '_, '_> {
            fn drop(&mut self) {
                self.0.wait_all();
            }
        }
        let _guard = WaitOnExit(&scope);
        f(&scope)
    }
}
