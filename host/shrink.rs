//! Going on after a rank is lost: [`Comm::shrink`] builds a communicator of the ranks still
//! alive (NCCL's `ncclCommShrink`, torchcomms' shrink), agreed by all of them. It takes over
//! the old communicator's links where they are whole and in step (a shrink of a healthy
//! communicator); after a failure, which closes them on purpose, it builds new ones.
//!
//! The agreement runs through the job store, which outlives any rank but the one hosting it
//! (under `ferrocomm-run` the launcher hosts it; in a `new_group` it is in memory). Each
//! attempt `a` of shrink number `g` has keys under `<comm prefix>/shrink<g>/<a>/`:
//!
//! 1. every survivor sets `alive/<rank>` (with the ledger of its links: see shrink_links.rs),
//!    then waits (at most the timeout, and no longer than until a proposal is in) for the
//!    `alive` key of every rank it has no reason to think lost;
//! 2. every survivor proposes the ranks whose `alive` key it sees, and the store's
//!    compare-and-set keeps the first proposal as `members`: one list for everyone, whatever
//!    each one saw (a rank the list leaves out gets an error saying so);
//! 3. the members create the new communicator: over the links of this one where every
//!    member's ledger allows it (shrink_links.rs), else fresh under `<attempt>/comm`; then
//!    each sets `ok/<rank>` (`1` created, `0` failed); each waits for the members' `ok` keys
//!    and proposes `done` (all created), `failed` (all reported, some could not create:
//!    everyone gets the error) or a retry without the members whose key never came, and
//!    compare-and-set again keeps the first `outcome`. On a retry every member drops what it
//!    created and starts attempt `a + 1` without waiting for anyone left out so far, so a rank
//!    that dies during the shrink is left out as well.

use crate::comm::{Comm, Parent};
use crate::contracts::backend::LinkLedger;
use crate::contracts::error::{Error, Result};
use crate::contracts::store::Store;
use crate::shrink_links::{decide, decode_alive, encode_alive, Handover};
use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a probe of a key that should already be there may take.
const PROBE: Duration = Duration::from_millis(1);
/// The pause between two looks at the store while waiting for the survivors.
const POLL: Duration = Duration::from_millis(5);

impl Comm {
    /// A communicator of this one's ranks that are still alive, agreed by every one of them
    /// (collective over the survivors; the lost ranks do not call it), with the ranks of this
    /// communicator it has, in order (new rank `i` is old rank `members[i]`). `lost` lists
    /// ranks known to be gone, such as the `peer` of an `Error::PeerLost`: this rank does not
    /// wait for them (a listed rank that comes before the agreement is kept all the same).
    /// Any other rank that has not called `shrink` within the timeout is left out, and so is
    /// a rank that dies during it.
    ///
    /// The new communicator has the same backend, device, name and options. This one is
    /// closed for good whatever the outcome: its calls, its windows' and a second `shrink`
    /// return `Error::Closed`. Works after this communicator failed (a `PeerLost`, an abort):
    /// only the job store is needed, so the store must not have been hosted by a lost rank
    /// (`ferrocomm-run` and `new_group` host it themselves).
    ///
    /// Errors: `InvalidRank` / `InvalidArgument` when `lost` names a rank out of range or this
    /// one (nothing happens then); `Error::LeftOut` when the survivors agreed without this
    /// rank; `Error::Closed` on a finalized or already shrunk communicator; store errors as
    /// the store reports them.
    ///
    /// ```
    /// use ferrocomm::prelude::*;
    ///
    /// let comms = Comm::new_group("cpu", &[Device::Cpu; 3], "elastic-doc", CommOptions::from_env()?)?;
    /// std::thread::scope(|s| {
    ///     for c in &comms {
    ///         s.spawn(move || {
    ///             if c.rank() == 1 {
    ///                 c.abort(); // rank 1 leaves, as a process that exits would
    ///                 return;
    ///             }
    ///             let (small, members) = c.shrink(&[1]).unwrap();
    ///             assert_eq!(members, [0, 2]);
    ///             let mut x = [c.rank() as u32];
    ///             small.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    ///             assert_eq!(x, [2]); // ranks 0 and 2 of the old communicator
    ///         });
    ///     }
    /// });
    /// # Ok::<(), ferrocomm::Error>(())
    /// ```
    pub fn shrink(&self, lost: &[usize]) -> Result<(Comm, Vec<usize>)> {
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
        self.check_shrinkable()?;
        // From here on every rank counts this shrink: whatever happens, this communicator
        // cannot start another one (its generation would no longer match the others'). And
        // no operation starts on it any more, so the ledger of its links stays true.
        self.mark_shrunk();
        self.agree_and_create(me, size, known_lost)
    }

    fn agree_and_create(&self, me: usize, size: usize, mut known_lost: BTreeSet<usize>) -> Result<(Comm, Vec<usize>)> {
        let (store, prefix, options, generation) = self.shrink_parts();
        let timeout = options.timeout;
        let base = format!("{prefix}/shrink{generation}");
        // Every retry has at least one member fewer than the attempt before (a member whose
        // `ok` never came), so `size` attempts suffice.
        for attempt in 0..size {
            let keys = format!("{base}/{attempt}");
            // A communicator that failed, was aborted, lent its links to an earlier attempt or
            // is busy (an operation still queued or running, perhaps stuck on a lost peer: the
            // shrink must not wait for it) has no ledger.
            let ledger = self.on_idle_backend(|b| b.link_ledger()).flatten();
            let alive = encode_alive(ledger.as_ref());
            let (members, ledgers) = agree_members(&*store, &keys, me, size, &known_lost, timeout, &alive)?;
            let Some(new_rank) = members.iter().position(|&r| r == me) else {
                return Err(Error::LeftOut {
                    op: "shrink",
                    rank: me,
                    members,
                });
            };
            let handover = decide(&members, &ledgers, size);
            let create = |parent: Parent<'_>| {
                Comm::create(
                    self.backend_name(),
                    self.device(),
                    self.name(),
                    new_rank,
                    members.len(),
                    store.clone(),
                    format!("{keys}/comm"),
                    options.clone(),
                    None,
                    parent,
                )
            };
            let created = match handover {
                Handover::Fresh => create(Parent::None),
                Handover::Links { keep_board } => self
                    .backend()
                    .lend_links(&members, keep_board, timeout)
                    .and_then(|lent| create(Parent::Shrink(&Mutex::new(Some(lent))))),
            };
            tracing::debug!(
                rank = me,
                attempt,
                ?handover,
                "shrink: how the smaller communicator gets its links"
            );
            if let Err(e) = &created {
                tracing::warn!(rank = me, attempt, error = %e, "shrink: creating the smaller communicator failed");
            }
            let ok_key = format!("{keys}/ok/{me}");
            let deadline = Instant::now() + timeout;
            patient(deadline, || {
                store.set(&ok_key, if created.is_ok() { b"1" } else { b"0" })
            })?;
            match agree_outcome(&*store, &keys, &members, timeout)? {
                Outcome::Done => {
                    // `done` needs this rank's `1`, so `created` is a communicator.
                    let comm = created?;
                    tracing::info!(rank = me, new_rank, ?members, "communicator shrunk");
                    return Ok((comm, members));
                }
                Outcome::Failed(ranks) => {
                    return Err(Error::invalid(
                        "shrink",
                        format!(
                            "every member of {members:?} reported, but ranks {ranks:?} could not create \
                             the smaller communicator (their logs say why)"
                        ),
                    ))
                }
                Outcome::Retry(gone) => {
                    tracing::warn!(
                        rank = me,
                        attempt,
                        ?gone,
                        "shrink: members lost while creating; retrying without them"
                    );
                    // Nobody waits again for a rank this attempt left out or lost.
                    known_lost.extend((0..size).filter(|r| !members.contains(r)));
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
/// proposal of who is alive. The wait ends early once someone's proposal is in: then the
/// answer is fixed, and waiting on would only make this rank late for the new communicator.
fn agree_members(
    store: &dyn Store,
    keys: &str,
    me: usize,
    size: usize,
    known_lost: &BTreeSet<usize>,
    timeout: Duration,
    mine: &[u8],
) -> Result<(Vec<usize>, Vec<Option<LinkLedger>>)> {
    let alive = |r: usize| format!("{keys}/alive/{r}");
    let members_key = format!("{keys}/members");
    let deadline = Instant::now() + timeout;
    patient(deadline, || store.set(&alive(me), mine))?;
    let mut awaited: Vec<usize> = (0..size).filter(|r| *r != me && !known_lost.contains(r)).collect();
    while !awaited.is_empty() && Instant::now() < deadline && !present(store, &members_key)? {
        let mut still = Vec::new();
        for r in awaited {
            if !present(store, &alive(r))? {
                still.push(r);
            }
        }
        awaited = still;
        if !awaited.is_empty() {
            std::thread::sleep(POLL);
        }
    }
    let mut seen = Vec::new();
    for r in 0..size {
        if r == me || present(store, &alive(r))? {
            seen.push(r);
        }
    }
    let agreed = decode(&patient(deadline + timeout, || {
        store.compare_set(&members_key, b"", &encode(&seen))
    })?)?;
    if agreed.is_empty() || agreed.windows(2).any(|w| w[0] >= w[1]) || agreed.iter().any(|&r| r >= size) {
        return Err(Error::Protocol {
            context: "shrink agreement",
            reason: format!("the store holds members {agreed:?}, not ascending ranks below {size}"),
        });
    }
    // Every member's key was set before the members were proposed.
    let mut ledgers = Vec::with_capacity(agreed.len());
    for &r in &agreed {
        let left = (deadline + timeout).saturating_duration_since(Instant::now());
        let raw = patient(deadline + timeout, || store.get(&alive(r), left.max(PROBE)))?;
        ledgers.push(decode_alive(&raw, size)?);
    }
    Ok((agreed, ledgers))
}

enum Outcome {
    Done,
    /// Every member reported, and these could not create the communicator.
    Failed(Vec<usize>),
    /// The members whose `ok` key never came.
    Retry(Vec<usize>),
}

/// Step 3: wait for the members' `ok` keys and take the store's first verdict. Creating a
/// communicator may itself take up to the timeout, so members wait twice that for each other.
fn agree_outcome(store: &dyn Store, keys: &str, members: &[usize], timeout: Duration) -> Result<Outcome> {
    let ok = |r: usize| format!("{keys}/ok/{r}");
    let deadline = Instant::now() + 2 * timeout;
    let (mut gone, mut failed) = (Vec::new(), Vec::new());
    for &r in members {
        let left = deadline.saturating_duration_since(Instant::now());
        match patient(deadline, || store.get(&ok(r), left.max(PROBE))) {
            Ok(v) if v == b"1" => {}
            Ok(_) => failed.push(r),
            Err(Error::StoreTimeout { .. }) => gone.push(r),
            Err(e) => return Err(e),
        }
    }
    let verdict = match (gone.is_empty(), failed.is_empty()) {
        (true, true) => b"done".to_vec(),
        (true, false) => [b"failed".to_vec(), encode(&failed)].concat(),
        (false, _) => [b"retry".to_vec(), encode(&gone)].concat(),
    };
    // A member that saw every `ok` must not be left without the verdict the others act on:
    // a store hiccup here is retried until well past everyone's deadline.
    let agreed = patient(deadline + timeout, || {
        store.compare_set(&format!("{keys}/outcome"), b"", &verdict)
    })?;
    if agreed == b"done" {
        return Ok(Outcome::Done);
    }
    if let Some(rest) = agreed.strip_prefix(b"failed") {
        return Ok(Outcome::Failed(decode(rest)?));
    }
    match agreed.strip_prefix(b"retry") {
        Some(rest) => Ok(Outcome::Retry(decode(rest)?)),
        None => Err(Error::Protocol {
            context: "shrink agreement",
            reason: format!(
                "the store holds an unknown shrink outcome {:?}",
                String::from_utf8_lossy(&agreed)
            ),
        }),
    }
}

/// `f` again after an I/O error of the store (a dropped connection that the client redials)
/// until `deadline`; other errors, and the last I/O error, are returned.
fn patient<T>(deadline: Instant, mut f: impl FnMut() -> Result<T>) -> Result<T> {
    loop {
        match f() {
            Err(Error::Io { .. }) if Instant::now() < deadline => std::thread::sleep(POLL),
            r => return r,
        }
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
