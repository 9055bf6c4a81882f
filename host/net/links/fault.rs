//! The fault record: the first cause of a communicator's failure, kept in its store so that
//! every rank, on every transport, reports the same cause.
//!
//! A rank that sees a failure first hand (a link that broke, a peer process that exited, a
//! header that does not match, its own abort) records it before it tells its peers (shared-memory
//! state, TCP shutdown). A rank that then sees *that* rank go away finds the record already
//! there and reports the recorded cause instead of the neighbour it saw leave. The store's
//! compare-and-set keeps the first record, so concurrent observers agree on one cause.
//!
//! The store may itself be gone (it lived in the lost process) or hang: then, after a short
//! bounded wait, a rank reports what it saw.

use crate::contracts::error::Error;
use crate::contracts::store::Store;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Why a communicator failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Cause {
    /// `root` is gone (exited, killed, aborted, timed out); `noticed_by` saw it first hand.
    Lost {
        root: usize,
        noticed_by: usize,
        reason: String,
    },
    /// `noticed_by` found that its call and `peer`'s differ.
    Mismatch {
        noticed_by: usize,
        peer: usize,
        detail: String,
    },
}

impl Cause {
    fn encode(&self) -> Vec<u8> {
        match self {
            Cause::Lost {
                root,
                noticed_by,
                reason,
            } => format!("lost\n{root}\n{noticed_by}\n{reason}"),
            Cause::Mismatch {
                noticed_by,
                peer,
                detail,
            } => format!("mismatch\n{noticed_by}\n{peer}\n{detail}"),
        }
        .into_bytes()
    }

    fn decode(raw: &[u8]) -> Option<Cause> {
        let text = std::str::from_utf8(raw).ok()?;
        let mut f = text.splitn(4, '\n');
        let (kind, a, b, rest) = (f.next()?, f.next()?.parse().ok()?, f.next()?.parse().ok()?, f.next()?);
        match kind {
            "lost" => Some(Cause::Lost {
                root: a,
                noticed_by: b,
                reason: rest.to_owned(),
            }),
            "mismatch" => Some(Cause::Mismatch {
                noticed_by: a,
                peer: b,
                detail: rest.to_owned(),
            }),
            _ => None,
        }
    }

    /// What `op` reports on a rank that learned of this cause.
    pub(crate) fn error(&self, op: &'static str, me: usize) -> Error {
        match self {
            Cause::Lost {
                root,
                noticed_by,
                reason,
            } if *noticed_by == me || noticed_by == root => Error::PeerLost {
                op,
                peer: *root,
                reason: reason.clone(),
            },
            Cause::Lost {
                root,
                noticed_by,
                reason,
            } => Error::PeerLost {
                op,
                peer: *root,
                reason: format!("{reason} (rank {noticed_by} failed after losing rank {root})"),
            },
            Cause::Mismatch {
                noticed_by,
                peer,
                detail,
            } if *noticed_by == me => Error::Mismatch {
                op,
                peer: *peer,
                detail: detail.clone(),
            },
            Cause::Mismatch {
                noticed_by,
                peer,
                detail,
            } => Error::Mismatch {
                op,
                peer: *noticed_by,
                detail: format!("rank {noticed_by} found its call and rank {peer}'s differ: {detail}"),
            },
        }
    }
}

/// How long recording a cause may wait for the store: a failing rank tells its peers only
/// after it recorded, and they must learn at once. A store that does not answer in time is not
/// asked again.
const STORE_WAIT: Duration = Duration::from_millis(500);

/// One rank's access to a fault record: its communicator's, or one window's.
#[derive(Clone)]
pub(crate) struct FaultRecord {
    store: Arc<dyn Store>,
    key: String,
    rank: usize,
    /// Set once the store failed or did not answer in time.
    unreachable: Arc<AtomicBool>,
}

impl FaultRecord {
    /// `store` must be private to the communicator (its prefix store).
    pub(crate) fn new(store: Arc<dyn Store>, rank: usize) -> FaultRecord {
        FaultRecord {
            store,
            key: "fault/first".into(),
            rank,
            unreachable: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The record of one part of the communicator (a window): its failures do not close the
    /// communicator, so they must not stand as the cause of a later, unrelated one.
    pub(crate) fn scoped(&self, scope: &str) -> FaultRecord {
        FaultRecord {
            key: format!("{scope}/fault/first"),
            ..self.clone()
        }
    }

    /// Records `cause` unless another cause came first; returns the first cause (`cause` itself
    /// when the store cannot be reached in time).
    pub(crate) fn record(&self, cause: Cause) -> Cause {
        if self.unreachable.load(Ordering::Relaxed) {
            return cause;
        }
        // A helper thread bounds the wait: a store call may retry its connection or wait for
        // a server that hangs for many seconds.
        let (tx, rx) = std::sync::mpsc::channel();
        let (store, key, mine) = (self.store.clone(), self.key.clone(), cause.encode());
        let asked = std::thread::Builder::new()
            .name("ferrocomm-fault-record".into())
            .spawn(move || {
                let _ = tx.send(store.compare_set(&key, b"", &mine));
            });
        let answer = match asked {
            Ok(_) => rx.recv_timeout(STORE_WAIT).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match answer {
            Ok(Ok(first)) => Cause::decode(&first).unwrap_or(cause),
            Ok(Err(e)) => self.give_up(e.to_string(), cause),
            Err(e) => self.give_up(e, cause),
        }
    }

    fn give_up(&self, why: String, cause: Cause) -> Cause {
        tracing::debug!(
            rank = self.rank,
            why,
            "fault record: store unreachable, reporting what this rank saw"
        );
        self.unreachable.store(true, Ordering::Relaxed);
        cause
    }

    /// The error this rank reports for `e`, its own view of a failure: the recorded cause
    /// where a rank lost a peer or found a mismatch first, otherwise `e`, recorded for the rest.
    /// Errors that say nothing about other ranks pass through.
    pub(crate) fn resolve(&self, e: Error) -> Error {
        let me = self.rank;
        let (op, seen) = match &e {
            Error::PeerLost { op, peer, reason } => (
                *op,
                Cause::Lost {
                    root: *peer,
                    noticed_by: me,
                    reason: reason.clone(),
                },
            ),
            Error::Mismatch { op, peer, detail } => (
                *op,
                Cause::Mismatch {
                    noticed_by: me,
                    peer: *peer,
                    detail: detail.clone(),
                },
            ),
            Error::Timeout {
                op,
                peer: Some(p),
                after,
            } => {
                let reason = format!("rank {me} waited {after:?} for it in {op}");
                let first = self.record(Cause::Lost {
                    root: *p,
                    noticed_by: me,
                    reason,
                });
                // A timeout on the rank the record names (or the first one) stays this rank's
                // own finding; any other recorded cause came first and is the true one.
                return match first {
                    Cause::Lost { root, .. } if root == *p => e,
                    other => other.error(op, me),
                };
            }
            _ => return e,
        };
        match self.record(seen.clone()) {
            // What this rank saw first hand is the first cause: its own words are the most precise.
            first if first == seen => e,
            first => first.error(op, me),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::MemoryStore;

    fn lost(peer: usize, reason: &str) -> Error {
        Error::PeerLost {
            op: "all_reduce",
            peer,
            reason: reason.into(),
        }
    }

    #[test]
    fn the_first_cause_wins_and_later_observers_name_its_root() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let (r0, r1) = (FaultRecord::new(store.clone(), 0), FaultRecord::new(store, 1));
        // Rank 0 sees rank 3's process exit; rank 1 then sees rank 0 shut its links.
        let e0 = r0.resolve(lost(3, "process 42 exited"));
        assert!(
            matches!(&e0, Error::PeerLost { peer: 3, reason, .. } if reason == "process 42 exited"),
            "{e0}"
        );
        let e1 = r1.resolve(lost(0, "connection closed by peer"));
        match e1 {
            Error::PeerLost { peer: 3, reason, .. } => {
                assert!(reason.contains("process 42 exited") && reason.contains("rank 0 failed after losing rank 3"))
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_recorded_mismatch_reaches_ranks_that_only_saw_a_link_break() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let (r0, r2) = (FaultRecord::new(store.clone(), 0), FaultRecord::new(store, 2));
        let m = Error::Mismatch {
            op: "broadcast",
            peer: 1,
            detail: "root: this rank 0, rank 1 has 1".into(),
        };
        assert!(matches!(r0.resolve(m), Error::Mismatch { peer: 1, .. }));
        match r2.resolve(lost(0, "Broken pipe")) {
            Error::Mismatch { peer: 0, detail, .. } => assert!(detail.contains("root: this rank 0"), "{detail}"),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_timeout_stays_a_timeout_unless_a_cause_came_first() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let t = || Error::Timeout {
            op: "barrier",
            peer: Some(2),
            after: std::time::Duration::from_secs(1),
        };
        let r0 = FaultRecord::new(store.clone(), 0);
        assert!(matches!(r0.resolve(t()), Error::Timeout { peer: Some(2), .. }));
        // Rank 1 times out later, on rank 0 this time: the record still says rank 2.
        let r1 = FaultRecord::new(store, 1);
        let e = r1.resolve(Error::Timeout {
            op: "barrier",
            peer: Some(0),
            after: std::time::Duration::from_secs(1),
        });
        assert!(matches!(e, Error::PeerLost { peer: 2, .. }), "{e}");
    }

    #[test]
    fn malformed_records_are_ignored() {
        assert_eq!(Cause::decode(b"lost\nx\n1\nr"), None);
        assert_eq!(Cause::decode(b""), None);
        assert_eq!(Cause::decode(b"other\n1\n2\nr"), None);
    }
}
