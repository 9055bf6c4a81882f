//! The order of a communicator's own collective kernels across streams.
//!
//! Every call of the backend's own kernels uses the same window regions, signal ids and epoch
//! counters (kernels/collective.cuh), so two calls of one communicator must never run at once:
//! a second call beside the first would take the next epochs while the first still reads the
//! regions. Stream order keeps the calls of one stream apart; a call issued on another stream
//! than the previous one first makes its stream wait for an event recorded behind the previous
//! call, as NCCL orders a communicator's operations. Calls being captured into a CUDA graph are
//! left out: nothing outside a capture may wait on it, and a graph's replays run whenever the
//! user launches them, so the user orders them against the communicator's other calls (as
//! with NCCL).

use crate::contracts::error::Result;
use crate::gpu::cuda::stream::{is_capturing, Event};
use std::sync::Mutex;

/// `CU_STREAM_PER_THREAD`: one value that names another stream on each thread.
const PER_THREAD: u64 = 2;

pub(crate) struct CallOrder {
    state: Mutex<State>,
}

struct State {
    /// Recorded behind the last call that was not captured.
    behind_last: Event,
    /// That call's stream (compared only, never used: it may be gone by now).
    last: Option<u64>,
}

impl CallOrder {
    pub(crate) fn new() -> Result<CallOrder> {
        Ok(CallOrder {
            state: Mutex::new(State {
                behind_last: Event::new()?,
                last: None,
            }),
        })
    }

    /// Runs `enqueue`, which puts one call's kernels on `stream`, after the previous call's.
    pub(crate) fn run(&self, stream: u64, enqueue: impl FnOnce() -> Result<()>) -> Result<()> {
        if is_capturing(stream)? {
            return enqueue();
        }
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if needs_wait(s.last, stream) {
            s.behind_last.make_wait(stream)?;
        }
        // Recorded even when enqueueing failed part-way: later calls come after what it did
        // enqueue.
        let enqueued = enqueue();
        s.behind_last.record(stream)?;
        s.last = Some(stream);
        enqueued
    }
}

impl CallOrder {
    /// Blocks until the last call that was not captured has finished on its stream, or
    /// `limit` passes: the window its kernels use must outlive them.
    pub(crate) fn wait_last(&self, limit: std::time::Duration) -> Result<()> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.last.is_none() {
            return Ok(());
        }
        s.behind_last.wait("releasing the device collectives' window", limit)
    }
}

/// Whether a call on `stream` must wait for the previous one, made on `last`.
fn needs_wait(last: Option<u64>, stream: u64) -> bool {
    last.is_some_and(|l| l != stream || stream == PER_THREAD)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_waits_for_the_previous_one_unless_stream_order_already_does() {
        assert!(!needs_wait(None, 7), "the first call");
        assert!(!needs_wait(Some(7), 7), "same stream: stream order");
        assert!(needs_wait(Some(7), 9), "another stream");
        assert!(needs_wait(Some(0), 9), "from the legacy stream");
        assert!(
            needs_wait(Some(PER_THREAD), PER_THREAD),
            "the per-thread stream may be another thread's"
        );
    }
}
