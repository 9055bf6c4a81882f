//! Issue order: operations of one communicator run one at a time in issue order. A synchronous
//! call runs on the caller's thread when nothing is queued (no hand-off latency); otherwise it
//! queues behind the asynchronous ones, which run on the communicator's worker thread. Every
//! operation ends by itself (its timeout bounds every stall; on the CPU engine it runs from the
//! first one), so every wait here is bounded too.

use crate::contracts::backend::{Backend, RunOptions};
use crate::contracts::error::{Error, Result};
use crate::contracts::fence::FenceSlot;
use crate::contracts::ops::Op;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The outcome of one operation, filled in once.
#[derive(Default)]
pub(crate) struct Completion {
    result: Mutex<Option<Result<()>>>,
    done: Condvar,
    pub(crate) fence: FenceSlot,
}

impl Completion {
    pub(crate) fn finish(&self, r: Result<()>) {
        *self.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        self.done.notify_all();
    }

    pub(crate) fn is_done(&self) -> bool {
        self.result.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Waits up to `limit` for the outcome without taking it; whether it is there.
    pub(crate) fn wait_done(&self, limit: Duration) -> bool {
        let g = self.result.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .done
            .wait_timeout_while(g, limit, |r| r.is_none())
            .unwrap_or_else(|p| p.into_inner());
        g.is_some()
    }

    /// Waits up to `limit` (forever if `None`); takes the result the first time it is seen.
    pub(crate) fn wait(&self, limit: Option<Duration>) -> Option<Result<()>> {
        let mut g = self.result.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = limit.map(|d| std::time::Instant::now() + d);
        while g.is_none() {
            match deadline {
                None => g = self.done.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(dl) => {
                    let now = std::time::Instant::now();
                    if now >= dl {
                        return None;
                    }
                    g = self.done.wait_timeout(g, dl - now).unwrap_or_else(|p| p.into_inner()).0;
                }
            }
        }
        // Leave Ok behind so a second wait reports success rather than blocking.
        Some(g.replace(Ok(())).unwrap_or(Ok(())))
    }
}

/// One unit of work for the backend: a collective, or a window operation. The slot is where an
/// asynchronous operation may leave its device fence.
pub(crate) type Task<'a> = Box<dyn FnOnce(&dyn Backend, Option<&FenceSlot>) -> Result<()> + Send + 'a>;

struct Job {
    /// Lifetime erased; see `Executor::submit` for why the borrows outlive the job.
    task: Task<'static>,
    done: Arc<Completion>,
}

/// No hints at all, neither the communicator's nor the operation's: most calls.
static NO_HINTS: BTreeMap<String, String> = BTreeMap::new();

/// Everything an operation runs with but the operation itself: its timeout and hints (the
/// communicator's defaults merged with the operation's own; `None`: there are none), the call
/// check, and the issuing thread's current stream, read when the operation is issued (it may
/// run on the worker). Kept apart from the operation so that a synchronous call runs its
/// operation where it lies, borrowed, instead of moving it into a task.
pub(crate) struct OpRun {
    timeout: Duration,
    hints: Option<BTreeMap<String, String>>,
    /// (this rank, the world size): check the call against the other ranks' first (see
    /// `call_check`).
    check: Option<(usize, usize)>,
    stream: u64,
}

impl OpRun {
    // Inlined: see `Engine::begin_call` in the CPU backend.
    #[inline(always)]
    pub(crate) fn new(
        timeout: Duration,
        hints: Option<BTreeMap<String, String>>,
        check: Option<(usize, usize)>,
    ) -> OpRun {
        OpRun {
            timeout,
            hints,
            check,
            stream: crate::gpu::cuda::stream::current(),
        }
    }

    fn options<'a>(&'a self, fence: Option<&'a FenceSlot>) -> RunOptions<'a> {
        RunOptions {
            timeout: self.timeout,
            hints: self.hints.as_ref().unwrap_or(&NO_HINTS),
            stream: self.stream,
            fence,
        }
    }

    /// Runs `op` on `b`.
    pub(crate) fn run(&self, b: &dyn Backend, op: &mut Op<'_>, fence: Option<&FenceSlot>) -> Result<()> {
        // A world of one cannot disagree with itself.
        if let Some((rank, size @ 2..)) = self.check {
            crate::call_check::check(b, op, rank, size, self.timeout)?;
        }
        let r = b.run(op, &self.options(fence));
        // Before the caller can read its outputs again, also after a failure that left some
        // bytes written: a peer's bytes must not become invalid `bool`s.
        op.normalise_outputs();
        r
    }

    /// Runs `Backend::refuse` for `op`, which failed this rank's checks (`reason`).
    pub(crate) fn refuse(&self, b: &dyn Backend, op: &Op<'_>, reason: &str) {
        b.refuse(op, reason, &self.options(None));
    }
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    shutdown: bool,
    worker: Option<std::thread::JoinHandle<()>>,
}

pub(crate) struct Executor {
    backend: Box<dyn Backend>,
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Held while an operation runs: the backend sees one operation at a time.
    running: Mutex<()>,
    /// Queued plus running jobs. Changed only under the queue's lock, so that waiters on
    /// `wake` see it move; read without it by a synchronous call, so that one with nothing
    /// queued takes one lock, not two.
    in_flight: AtomicUsize,
}

impl Executor {
    pub(crate) fn new(backend: Box<dyn Backend>) -> Arc<Executor> {
        Arc::new(Executor {
            backend,
            queue: Mutex::default(),
            wake: Condvar::new(),
            running: Mutex::new(()),
            in_flight: AtomicUsize::new(0),
        })
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// Runs `task` to completion in issue order. Generic, so that a call that runs in place
    /// (the common case) moves no task into a box.
    pub(crate) fn run<'a>(
        self: &Arc<Self>,
        task: impl FnOnce(&dyn Backend, Option<&FenceSlot>) -> Result<()> + Send + 'a,
    ) -> Result<()> {
        // Nothing queued: run here. This thread's own earlier submissions show in `in_flight`
        // (it counted them before `submit` returned), and it is looked at again once `running`
        // is held: a job queued by another thread meanwhile is not ordered against this call,
        // but one the worker has taken waits for `running`, so the backend still sees one
        // operation at a time.
        if self.in_flight.load(Ordering::Acquire) == 0 {
            let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            if self.in_flight.load(Ordering::Acquire) == 0 {
                let r = task(&*self.backend, None);
                drop(running);
                return r;
            }
            drop(running);
        }
        // SAFETY: we block below until the job has completed, so the task's borrows outlive it.
        let done = unsafe { self.submit(Box::new(task), "queued operation") }?;
        done.wait(None).unwrap_or(Ok(()))
    }

    /// Runs `task` here if nothing is queued or running, else returns `None` without running
    /// it (for a question that must not wait behind a stuck operation).
    pub(crate) fn run_if_idle(&self, task: Task<'_>) -> Option<Result<()>> {
        let q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let _running = match self.running.try_lock() {
            Ok(r) => r,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        drop(q);
        Some(task(&*self.backend, None))
    }

    /// Queues `task` for the worker thread.
    ///
    /// # Safety
    /// Everything `task` borrows must stay valid until the returned completion is finished.
    pub(crate) unsafe fn submit(self: &Arc<Self>, task: Task<'_>, name: &'static str) -> Result<Arc<Completion>> {
        // SAFETY: only the lifetime changes; the caller guarantees the borrows.
        let task: Task<'static> = unsafe { std::mem::transmute::<Task<'_>, Task<'static>>(task) };
        let done = Arc::new(Completion::default());
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.shutdown {
            return Err(Error::Closed {
                op: name,
                state: "shut down",
            });
        }
        if q.worker.is_none() {
            let me = Arc::clone(self);
            let h = std::thread::Builder::new()
                .name("ferrocomm-worker".into())
                .spawn(move || me.work())
                .map_err(|e| Error::io("spawn communicator worker", e))?;
            q.worker = Some(h);
        }
        q.jobs.push_back(Job {
            task,
            done: done.clone(),
        });
        self.in_flight.fetch_add(1, Ordering::Release);
        self.wake.notify_all();
        Ok(done)
    }

    fn work(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if let Some(j) = q.jobs.pop_front() {
                        break j;
                    }
                    if q.shutdown {
                        return;
                    }
                    q = self.wake.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let Job { task, done } = job;
            // The task (and the buffers it borrows) is consumed here, before anyone learns the
            // job is done.
            let r = {
                let _running = self.running.lock().unwrap_or_else(|p| p.into_inner());
                // A panic must still finish the completion: waiters (and a dropped owned
                // Work, which waits before it frees buffers) would wait forever otherwise.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(&*self.backend, Some(&done.fence))))
                    .unwrap_or_else(|_| {
                        Err(Error::Backend {
                            backend: self.backend.name().into(),
                            call: "run".into(),
                            message: "the backend panicked while running a queued operation".into(),
                        })
                    })
            };
            {
                let _q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                self.in_flight.fetch_sub(1, Ordering::Release);
            }
            self.wake.notify_all();
            done.finish(r);
        }
    }

    /// Waits for every queued operation (used by finalize).
    pub(crate) fn drain(&self) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        while self.in_flight.load(Ordering::Acquire) > 0 {
            q = self
                .wake
                .wait_timeout(q, Duration::from_millis(5))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Stops the worker once the queue is empty.
    pub(crate) fn shutdown(&self) {
        let h = {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.shutdown = true;
            self.wake.notify_all();
            q.worker.take()
        };
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}
