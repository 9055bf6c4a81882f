//! Streams of the host device: ordered queues, each drained by a worker thread of its own, so
//! work is enqueued and returns as on a GPU stream, and runs in issue order; an event is a
//! point in that order. A job that fails
//! (a launch the host device cannot run) leaves its error for the next wait, like a sticky CUDA
//! error; jobs after it still run, so a later wait cannot hang on a job that never ran.

use crate::contracts::error::{Error, Result};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce() -> Result<()> + Send>;

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// Jobs enqueued so far, and finished so far (a job's ticket is its issue number).
    issued: u64,
    done: u64,
    error: Option<Error>,
    closed: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A host-device stream. Cloning shares the queue.
#[derive(Clone)]
pub(crate) struct Stream {
    shared: Arc<Shared>,
    _worker: Arc<Worker>,
}

/// Closes the queue when the last handle goes; the worker finishes what was enqueued.
struct Worker(Arc<Shared>);

impl Drop for Worker {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.changed.notify_all();
    }
}

/// A point in a stream's order: complete once every job enqueued before it has finished.
#[derive(Clone)]
pub(crate) struct Event {
    shared: Arc<Shared>,
    ticket: u64,
}

impl Stream {
    pub(crate) fn new() -> Result<Stream> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let for_worker = shared.clone();
        std::thread::Builder::new()
            .name("ferrocomm-host-stream".into())
            .spawn(move || drain(&for_worker))
            .map_err(|e| Error::Backend {
                backend: "host device".into(),
                call: "stream worker".into(),
                message: e.to_string(),
            })?;
        Ok(Stream {
            _worker: Arc::new(Worker(shared.clone())),
            shared,
        })
    }

    /// Puts `job` behind everything enqueued so far and returns at once.
    pub(crate) fn enqueue(&self, job: impl FnOnce() -> Result<()> + Send + 'static) {
        let mut s = self.shared.lock();
        s.jobs.push_back(Box::new(job));
        s.issued += 1;
        drop(s);
        self.shared.changed.notify_all();
    }

    /// An event behind everything enqueued so far.
    pub(crate) fn record(&self) -> Event {
        Event {
            shared: self.shared.clone(),
            ticket: self.shared.lock().issued,
        }
    }

    /// Blocks until everything enqueued so far has finished (then reports the first error a
    /// job left), or `limit` passes (`Error::Timeout` naming `op`).
    pub(crate) fn wait_idle(&self, op: &'static str, limit: Duration) -> Result<()> {
        self.record().wait(op, limit)?;
        match self.shared.lock().error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Event {
    pub(crate) fn wait(&self, op: &'static str, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        let mut s = self.shared.lock();
        while s.done < self.ticket {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    op,
                    peer: None,
                    after: limit,
                });
            }
            s = self
                .shared
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }
}

fn drain(shared: &Shared) {
    let mut s = shared.lock();
    loop {
        if let Some(job) = s.jobs.pop_front() {
            drop(s);
            // A job that panics is an error of that job; the queue goes on.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).unwrap_or_else(|_| {
                Err(Error::Backend {
                    backend: "host device".into(),
                    call: "stream job".into(),
                    message: "a job on the stream panicked".into(),
                })
            });
            s = shared.lock();
            if let Err(e) = r {
                s.error.get_or_insert(e);
            }
            s.done += 1;
            shared.changed.notify_all();
        } else if s.closed {
            return;
        } else {
            s = shared.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn jobs_run_in_issue_order_and_events_follow_them() {
        let s = Stream::new().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..50 {
            let log = log.clone();
            s.enqueue(move || {
                log.lock().unwrap().push(i);
                Ok(())
            });
        }
        s.record().wait("test", Duration::from_secs(10)).unwrap();
        assert_eq!(*log.lock().unwrap(), (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn a_failed_job_is_reported_once_by_the_next_wait() {
        let s = Stream::new().unwrap();
        s.enqueue(|| Err(Error::invalid("job", "bad")));
        let ran = Arc::new(AtomicU64::new(0));
        let r = ran.clone();
        s.enqueue(move || {
            r.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        assert!(matches!(
            s.wait_idle("test", Duration::from_secs(10)),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(ran.load(Ordering::SeqCst), 1, "jobs after a failed one still run");
        s.wait_idle("test", Duration::from_secs(10)).unwrap();
    }

    #[test]
    fn a_wait_past_its_deadline_is_a_timeout_naming_the_operation() {
        let s = Stream::new().unwrap();
        s.enqueue(|| {
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        });
        match s.wait_idle("slow op", Duration::from_millis(20)) {
            Err(Error::Timeout { op, .. }) => assert_eq!(op, "slow op"),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
}
