//! A job on several nodes: each node's launcher sees only its own ranks, so the launchers count
//! the job's failures in node 0's store (`--tolerate-failures`), and the one that sees a
//! failure past the tolerance tells the others to stop there.
//!
//! - A launcher whose rank fails adds 1 to `FAILURES`; the sum decides, the same way on every
//!   node: within the tolerance the failure is tolerated, past it this launcher stops its ranks
//!   and sets `STOP`. A store that cannot be reached fails closed: the failure stops the job.
//! - A thread of every launcher looks for `STOP` every `LOOK_EVERY` (with a connection of its
//!   own, so the launcher's loop never waits for the store), and checks once that every node
//!   was given the same tolerance (`TOLERATE`).

use ferrocomm::{Store, TcpStore};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The store key the launchers add each failed rank to.
const FAILURES: &str = "ferrocomm-run/failures";
/// Set by the launcher that saw a failure past the tolerance: every node stops its ranks.
const STOP: &str = "ferrocomm-run/stop";
/// The tolerance of the first launcher to set it; every other one compares its own.
const TOLERATE: &str = "ferrocomm-run/tolerate";
/// How often the watcher looks for `STOP` (a store round trip each time).
const LOOK_EVERY: Duration = Duration::from_millis(200);
/// How long a look for `STOP` may wait for an answer that is "not set".
const PROBE: Duration = Duration::from_millis(1);

/// The verdict on one failed rank.
pub(crate) enum Verdict {
    /// Failure `count` of the job, within the tolerance.
    Tolerated { count: i64 },
    /// Past the tolerance (failure `count`), or the count could not be taken (`why`).
    Stop { count: Option<i64>, why: Option<String> },
}

/// What the watcher thread found.
#[derive(Default)]
struct Seen {
    stop: AtomicBool,
    /// Another node's tolerance, where it differs from ours.
    differs: Mutex<Option<String>>,
    /// The launcher is done: the watcher ends.
    done: AtomicBool,
}

/// One node's view of the job's failures in node 0's store.
pub(crate) struct JobFailures {
    addr: (String, u16),
    token: String,
    wait: Duration,
    tolerate: usize,
    store: Option<TcpStore>,
    seen: Arc<Seen>,
}

impl JobFailures {
    /// For a launcher whose job's store is at `addr`; starts the watcher, which connects (and
    /// reconnects) on its own. Must be called after the launcher blocked its signals.
    pub(crate) fn start(addr: (String, u16), token: &str, wait: Duration, tolerate: usize) -> JobFailures {
        let seen = Arc::new(Seen::default());
        let (a, t, s) = (addr.clone(), token.to_string(), seen.clone());
        // Not joined: at the launcher's exit it may be waiting for a store that is gone.
        let _ = std::thread::Builder::new()
            .name("job-failures".into())
            .spawn(move || watch(&a, &t, wait, tolerate, &s));
        JobFailures {
            addr,
            token: token.to_string(),
            wait,
            tolerate,
            store: None,
            seen,
        }
    }

    fn store(&mut self) -> ferrocomm::Result<&TcpStore> {
        if self.store.is_none() {
            let (host, port) = (&self.addr.0, self.addr.1);
            self.store = Some(TcpStore::connect((host.as_str(), port), &self.token, self.wait)?);
        }
        Ok(self.store.as_ref().expect("connected above"))
    }

    /// Counts one failed rank of this node; a failure past the tolerance also tells every
    /// other node to stop.
    pub(crate) fn failed(&mut self) -> Verdict {
        let counted = self.store().and_then(|s| s.add(FAILURES, 1));
        let verdict = match counted {
            Ok(count) if count >= 1 && count as u64 <= self.tolerate as u64 => return Verdict::Tolerated { count },
            Ok(count) => Verdict::Stop {
                count: Some(count),
                why: None,
            },
            Err(e) => Verdict::Stop {
                count: None,
                why: Some(format!("cannot count the job's failures in node 0's store: {e}")),
            },
        };
        self.tell_stop();
        verdict
    }

    /// Tells every node to stop (best effort: their ranks lose this node's anyway).
    pub(crate) fn tell_stop(&mut self) {
        if let Err(e) = self.store().and_then(|s| s.set(STOP, b"1")) {
            eprintln!("ferrocomm-run: cannot tell the other nodes to stop: {e}");
        }
    }

    /// Whether another node has stopped the job.
    pub(crate) fn stopped_elsewhere(&self) -> bool {
        self.seen.stop.load(Ordering::Acquire)
    }

    /// Why this node's tolerance cannot be the job's, if another node has another.
    pub(crate) fn differs(&self) -> Option<String> {
        self.seen.differs.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl Drop for JobFailures {
    fn drop(&mut self) {
        self.seen.done.store(true, Ordering::Release);
    }
}

/// The watcher: connects, checks the tolerance once, then looks for `STOP` until told done.
fn watch(addr: &(String, u16), token: &str, wait: Duration, tolerate: usize, seen: &Seen) {
    let mut store = None;
    let mut checked = false;
    while !seen.done.load(Ordering::Acquire) {
        if store.is_none() {
            store = TcpStore::connect((addr.0.as_str(), addr.1), token, wait).ok();
        }
        if let Some(s) = &store {
            if !checked {
                let ours = tolerate.to_string();
                if let Ok(theirs) = s.compare_set(TOLERATE, b"", ours.as_bytes()) {
                    checked = true;
                    if theirs != ours.as_bytes() {
                        let theirs = String::from_utf8_lossy(&theirs).into_owned();
                        *seen.differs.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!(
                            "--tolerate-failures {ours} here, {theirs} on another node: every node must be given the same"
                        ));
                    }
                }
            }
            match s.get(STOP, PROBE) {
                Ok(_) => {
                    seen.stop.store(true, Ordering::Release);
                    return;
                }
                Err(ferrocomm::Error::StoreTimeout { .. }) => {}
                // A lost connection: a new one next time.
                Err(_) => store = None,
            }
        }
        std::thread::sleep(LOOK_EVERY);
    }
}
