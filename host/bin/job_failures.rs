//! `--tolerate-failures` across nodes: each node's launcher sees only its own ranks, so the
//! launchers count the job's failures in node 0's store, and the one whose failure goes past
//! the tolerance tells the others to stop there.
//!
//! - A launcher whose rank fails adds 1 to `FAILURES`; the sum decides, the same way on every
//!   node: within the tolerance the failure is tolerated, past it this launcher stops its ranks
//!   and sets `STOP`.
//! - Every launcher looks for `STOP` every `LOOK_EVERY` while its ranks run, and stops them
//!   when it is there.
//! - A store that cannot be reached fails closed: the failure counts as one too many.

use ferrocomm::{Store, TcpStore};
use std::time::{Duration, Instant};

/// The store key the launchers add each failed rank to.
const FAILURES: &str = "ferrocomm-run/failures";
/// Set by the launcher that saw a failure past the tolerance: every node stops its ranks.
const STOP: &str = "ferrocomm-run/stop";
/// How often a launcher looks for `STOP` (a store round trip each time).
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

/// One node's view of the job's failures in node 0's store.
pub(crate) struct JobFailures {
    addr: (String, u16),
    token: String,
    wait: Duration,
    tolerate: usize,
    store: Option<TcpStore>,
    looked: Option<Instant>,
}

impl JobFailures {
    /// For a launcher whose job's store is at `addr`; connects at its first use.
    pub(crate) fn new(addr: (String, u16), token: &str, wait: Duration, tolerate: usize) -> JobFailures {
        JobFailures {
            addr,
            token: token.to_string(),
            wait,
            tolerate,
            store: None,
            looked: None,
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

    /// Whether another node has stopped the job; looks at most every `LOOK_EVERY`. A store that
    /// cannot be reached is not a stop by itself: the ranks find out about a lost node.
    pub(crate) fn stopped_elsewhere(&mut self) -> bool {
        if self.looked.is_some_and(|t| t.elapsed() < LOOK_EVERY) {
            return false;
        }
        self.looked = Some(Instant::now());
        match self.store() {
            Ok(s) => s.get(STOP, PROBE).is_ok(),
            Err(_) => false,
        }
    }
}
