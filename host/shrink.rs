//! Going on after a rank is lost: [`Comm::shrink`] builds a communicator of the ranks still
//! alive (NCCL's `ncclCommShrink`, torchcomms' shrink), agreed by all of them without the old
//! communicator's transports, which a lost peer broke.
//!
//! The agreement runs through the job store, which outlives any rank but the one hosting it
//! (under `ferrocomm-run` the launcher hosts it; in a `new_group` it is in memory). Each
//! attempt `a` of shrink number `g` has keys under `<comm prefix>/shrink<g>/<a>/`:
//!
//! 1. every survivor sets `alive/<rank>`, then waits (at most the timeout) for the `alive` key
//!    of every rank it has no reason to think lost;
//! 2. every survivor proposes the ranks whose `alive` key it sees, and the store's
//!    compare-and-set keeps the first proposal as `members`: one list for everyone, whatever
//!    each one saw (a rank the list leaves out gets an error saying so);
//! 3. the members create the new communicator under `<attempt>/comm` and set `ok/<rank>`
//!    (`1` created, `0` failed); each waits for the members' `ok` keys and proposes `done`
//!    (all created) or a retry without the members whose key never came, and compare-and-set
//!    again keeps the first `outcome`. On a retry every member drops what it created and
//!    starts attempt `a + 1`, so a rank that dies during the shrink is left out as well.

use crate::comm::Comm;
use crate::contracts::error::{Error, Result};
use crate::contracts::store::Store;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// How long a probe of a key that should already be there may take.
const PROBE: Duration = Duration::from_millis(1);

impl Comm {
    /// A communicator of this one's ranks that are still alive, agreed by every one of them
    /// (collective over the survivors; the lost ranks do not call it). `lost` lists ranks known
    /// to be gone, such as the `peer` of an `Error::PeerLost`: nobody waits for them, but a
    /// listed rank that does call `shrink` in time is kept. Any other rank that has not called
    /// `shrink` within the timeout is left out, and so is a rank that dies during it.
    ///
    /// The new communicator has the same backend, device, name and options; ranks keep their
    /// order (new rank = position among the survivors). This one is closed for good: its
    /// calls, and its windows', return `Error::Closed`. Works after this communicator failed
    /// (a `PeerLost`, an abort): only the job store is needed, so the store must not have been
    /// hosted by a lost rank (`ferrocomm-run` and `new_group` host it themselves).
    ///
    /// Errors: `Error::InvalidArgument` when `lost` names this rank or one out of range, or
    /// when the survivors agreed without this rank (it came too late); store errors as the
    /// store reports them.
    ///
    /// ```
    /// use ferrocomm::prelude::*;
    ///
    /// let comms = Comm::new_group("cpu", &[Device::Cpu; 3], "elastic-doc", CommOptions::from_env()?)?;
    /// std::thread::scope(|s| {
    ///     for c in comms {
    ///         s.spawn(move || {
    ///             if c.rank() == 1 {
    ///                 return; // rank 1 leaves: its communicator is dropped
    ///             }
    ///             let small = c.shrink(&[1]).unwrap();
    ///             assert_eq!((small.size(), small.rank()), (2, c.rank() / 2));
    ///             let mut x = [c.rank() as u32];
    ///             small.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    ///             assert_eq!(x, [2]); // ranks 0 and 2 of the old communicator
    ///         });
    ///     }
    /// });
    /// # Ok::<(), ferrocomm::Error>(())
    /// ```
    pub fn shrink(&self, lost: &[usize]) -> Result<Comm> {
        let (me, size) = (self.rank(), self.size());
        let mut known_lost = BTreeSet::new();
        for &r in lost {
            if r >= size {
                return Err(Error::InvalidRank {
                    op: "shrink",
                    rank: r,
                    size,
                });
            }
            if r == me {
                return Err(Error::invalid("shrink", format!("rank {me} lists itself as lost")));
            }
            known_lost.insert(r);
        }
        let (store, prefix, options, generation) = self.shrink_parts();
        let timeout = options.timeout;
        let base = format!("{prefix}/shrink{generation}");
        // Every attempt but the last leaves out at least one rank, so `size` attempts suffice.
        for attempt in 0..size {
            let keys = format!("{base}/{attempt}");
            let members = agree_members(&*store, &keys, me, size, &known_lost, timeout)?;
            let Some(new_rank) = members.iter().position(|&r| r == me) else {
                return Err(Error::invalid(
                    "shrink",
                    format!(
                        "the survivors agreed on ranks {members:?} without rank {me}: it reached \
                         shrink after their timeout of {timeout:?}"
                    ),
                ));
            };
            let created = Comm::create(
                self.backend_name(),
                self.device(),
                self.name(),
                new_rank,
                members.len(),
                store.clone(),
                format!("{keys}/comm"),
                options.clone(),
                None,
                None,
            );
            if let Err(e) = &created {
                tracing::warn!(rank = me, attempt, error = %e, "shrink: creating the smaller communicator failed");
            }
            store.set(&format!("{keys}/ok/{me}"), if created.is_ok() { b"1" } else { b"0" })?;
            match agree_outcome(&*store, &keys, &members, timeout)? {
                Outcome::Done => {
                    // `done` needs this rank's `1`, so `created` is a communicator.
                    let comm = created?;
                    self.mark_shrunk();
                    tracing::info!(rank = me, new_rank, members = ?members, "communicator shrunk");
                    return Ok(comm);
                }
                Outcome::Retry(gone) => {
                    tracing::warn!(
                        rank = me,
                        attempt,
                        ?gone,
                        "shrink: members lost while creating; retrying without them"
                    );
                    known_lost.extend(gone);
                }
            }
        }
        Err(Error::invalid(
            "shrink",
            format!("no agreement after {size} attempts: ranks kept failing during the shrink"),
        ))
    }
}

/// Steps 1 and 2: announce this rank, wait for the others, and take the store's first
/// proposal of who is alive.
fn agree_members(
    store: &dyn Store,
    keys: &str,
    me: usize,
    size: usize,
    known_lost: &BTreeSet<usize>,
    timeout: Duration,
) -> Result<Vec<usize>> {
    let alive = |r: usize| format!("{keys}/alive/{r}");
    store.set(&alive(me), b"1")?;
    let deadline = Instant::now() + timeout;
    for r in (0..size).filter(|r| *r != me && !known_lost.contains(r)) {
        let left = deadline.saturating_duration_since(Instant::now());
        match store.wait(&[&alive(r)], left.max(PROBE)) {
            Ok(()) | Err(Error::StoreTimeout { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let mut seen = Vec::new();
    for r in 0..size {
        if r == me || present(store, &alive(r))? {
            seen.push(r);
        }
    }
    let agreed = decode(&store.compare_set(&format!("{keys}/members"), b"", &encode(&seen))?)?;
    if agreed.is_empty() || agreed.windows(2).any(|w| w[0] >= w[1]) || agreed.iter().any(|&r| r >= size) {
        return Err(Error::Protocol {
            context: "shrink agreement",
            reason: format!("the store holds members {agreed:?}, not ascending ranks below {size}"),
        });
    }
    Ok(agreed)
}

enum Outcome {
    Done,
    /// The members whose `ok` key never came.
    Retry(Vec<usize>),
}

/// Step 3: wait for the members' `ok` keys and take the store's first verdict. Creating a
/// communicator may itself take up to the timeout, so members wait twice that for each other.
fn agree_outcome(store: &dyn Store, keys: &str, members: &[usize], timeout: Duration) -> Result<Outcome> {
    let ok = |r: usize| format!("{keys}/ok/{r}");
    let deadline = Instant::now() + 2 * timeout;
    let mut gone = Vec::new();
    let mut all_created = true;
    for &r in members {
        let left = deadline.saturating_duration_since(Instant::now());
        match store.get(&ok(r), left.max(PROBE)) {
            Ok(v) => all_created &= v == b"1",
            Err(Error::StoreTimeout { .. }) => gone.push(r),
            Err(e) => return Err(e),
        }
    }
    let verdict = match (all_created, gone.is_empty()) {
        (true, true) => b"done".to_vec(),
        _ => [b"retry".to_vec(), encode(&gone)].concat(),
    };
    let agreed = store.compare_set(&format!("{keys}/outcome"), b"", &verdict)?;
    match agreed.strip_prefix(b"retry") {
        Some(rest) => Ok(Outcome::Retry(decode(rest)?)),
        None if agreed == b"done" => Ok(Outcome::Done),
        None => Err(Error::Protocol {
            context: "shrink agreement",
            reason: format!(
                "the store holds an unknown shrink outcome {:?}",
                String::from_utf8_lossy(&agreed)
            ),
        }),
    }
}

/// Whether `key` exists (it is set before anyone probes for it, so a short wait suffices).
fn present(store: &dyn Store, key: &str) -> Result<bool> {
    match store.get(key, PROBE) {
        Ok(_) => Ok(true),
        Err(Error::StoreTimeout { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Ranks as the store keeps them: comma-separated decimals (`[]` for none).
fn encode(ranks: &[usize]) -> Vec<u8> {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    format!("[{}]", list.join(",")).into_bytes()
}

fn decode(bytes: &[u8]) -> Result<Vec<usize>> {
    let bad = || Error::Protocol {
        context: "shrink agreement",
        reason: format!("malformed rank list in the store: {:?}", String::from_utf8_lossy(bytes)),
    };
    let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
    let inner = text
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .ok_or_else(bad)?;
    if inner.is_empty() {
        return Ok(Vec::new());
    }
    inner.split(',').map(|r| r.parse().map_err(|_| bad())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_round_trip_and_garbage_is_a_protocol_error() {
        for list in [vec![], vec![0], vec![0, 2, 17]] {
            assert_eq!(decode(&encode(&list)).unwrap(), list);
        }
        for bad in [&b""[..], b"[1,", b"1,2", b"[a]", b"[1,,2]", b"\xff"] {
            assert!(matches!(decode(bad), Err(Error::Protocol { .. })), "{bad:?}");
        }
    }
}
