//! Bounds work that NCCL left running on a stream after the call returned.
//!
//! A synchronous collective returns once it is enqueued, so nothing blocks on it; this thread
//! watches an event recorded behind each operation. If one is not done by its deadline, or
//! NCCL reports an asynchronous error (a peer gone, a network failure), the communicator is
//! aborted — which ends its kernels, so no stream waits forever — and the next operation of the
//! rank returns the cause.

use super::comm::NcclComm;
use crate::contracts::error::{Error, Result};
use crate::gpu::cuda::stream::Event;
use crate::gpu::nccl_library::{IN_PROGRESS, SUCCESS};
use cudarc::driver::CudaContext;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Pending {
    event: Event,
    op: &'static str,
    deadline: Instant,
    timeout: Duration,
}

#[derive(Default)]
struct State {
    pending: VecDeque<Pending>,
    /// Retired events, reused: creating one per operation would cost more than the rest of
    /// ferrocomm's per-call work.
    free: Vec<Event>,
    failure: Option<Error>,
    failed: bool,
    shutdown: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    pub(crate) fn start(comm: Arc<NcclComm>, ctx: Arc<CudaContext>) -> Result<Watchdog> {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ferrocomm-nccl-watchdog".into())
            .spawn(move || watch(&s, &comm, &ctx))
            .map_err(|e| Error::io("spawn NCCL watchdog", e))?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
        })
    }

    /// Records an event on `stream` behind the work enqueued so far and watches it until it
    /// completes or `timeout` passes.
    pub(crate) fn track(&self, op: &'static str, stream: u64, timeout: Duration) -> Result<()> {
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        let event = match st.free.pop() {
            Some(e) => e,
            None => Event::new()?,
        };
        event.record(stream)?;
        st.pending.push_back(Pending {
            event,
            op,
            deadline: Instant::now() + timeout,
            timeout,
        });
        self.shared.wake.notify_all();
        Ok(())
    }

    /// The failure that aborted the communicator: the first caller gets the cause, later ones
    /// `Error::Closed`.
    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        match (st.failure.take(), st.failed) {
            (Some(e), _) => Err(e),
            (None, true) => Err(Error::Closed {
                op,
                state: "aborted after an earlier NCCL failure",
            }),
            (None, false) => Ok(()),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch(shared: &Shared, comm: &NcclComm, ctx: &CudaContext) {
    // cuEventQuery needs the GPU's context on this thread.
    let _ = ctx.bind_to_thread();
    let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
    while !st.shutdown && !st.failed {
        let failure = check_front(&mut st).err().or_else(|| async_failure(comm));
        if let Some(e) = failure {
            tracing::error!(error = %e, "NCCL communicator failed; aborting it");
            st.pending.clear();
            st.failure = Some(e);
            st.failed = true;
            drop(st);
            comm.abort();
            return;
        }
        // Poll often while work is in flight, rarely when idle (asynchronous errors only).
        let pause = if st.pending.is_empty() {
            Duration::from_millis(100)
        } else {
            Duration::from_micros(200)
        };
        st = shared.wake.wait_timeout(st, pause).unwrap_or_else(|p| p.into_inner()).0;
    }
}

/// Retires finished operations from the front; an error for one past its deadline.
fn check_front(st: &mut State) -> Result<()> {
    while let Some(p) = st.pending.front() {
        if p.event.is_complete()? {
            if let Some(done) = st.pending.pop_front() {
                st.free.push(done.event);
            }
            continue;
        }
        if Instant::now() >= p.deadline {
            return Err(Error::Timeout {
                op: p.op,
                peer: None,
                after: p.timeout,
            });
        }
        break;
    }
    Ok(())
}

fn async_failure(comm: &NcclComm) -> Option<Error> {
    if comm.is_aborted() {
        return None;
    }
    match comm.async_state("ncclCommGetAsyncError") {
        Ok(SUCCESS) | Ok(IN_PROGRESS) => None,
        Ok(code) => comm
            .with("ncclCommGetAsyncError", |p| {
                comm.lib.check("NCCL (asynchronous error)", code, p)
            })
            .err(),
        Err(e) => Some(e),
    }
}
