//! Peers' calls that a rank checks as they come rather than before its own collective goes on:
//! the header-only call messages of collectives in which those peers' bytes do not land in this
//! rank's buffers (a broadcast's root hears from every receiver, a receiver from the receivers
//! besides the rank it reads from; engine.rs, `Lands`). They are kept per peer, in the order of
//! that peer's stream, so that a sweep steps only the oldest of each peer's: a root far ahead of
//! its receivers keeps up to `LATER_MAX` per peer unread, and a single list of all of them,
//! walked and copied on every exchange that looked at it, cost the root a pass over all of them
//! per broadcast.

use crate::contracts::error::Result;
use std::collections::VecDeque;

/// Late calls, per peer: `T` is the engine's receive of one (engine.rs, `Xfer`).
pub(crate) struct LateCalls<T> {
    /// By rank, oldest first; grown to the highest peer a call is owed by.
    queues: Vec<VecDeque<T>>,
    /// By rank: how many of the oldest the exchange being run waits for (`bound`, `need_all`).
    needed: Vec<usize>,
    /// Calls in all queues, and calls waited for: most exchanges look at no queue.
    len: usize,
    needed_len: usize,
}

impl<T> Default for LateCalls<T> {
    fn default() -> Self {
        LateCalls {
            queues: Vec::new(),
            needed: Vec::new(),
            len: 0,
            needed_len: 0,
        }
    }
}

impl<T> LateCalls<T> {
    /// Whether no call is owed.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Calls owed, all peers together.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Calls `peer` owes.
    pub(crate) fn owed_by(&self, peer: usize) -> usize {
        self.queues.get(peer).map_or(0, VecDeque::len)
    }

    /// Whether an exchange must wait for some of them.
    pub(crate) fn any_needed(&self) -> bool {
        self.needed_len > 0
    }

    /// Whether the exchange being run waits for a call `peer` owes.
    pub(crate) fn needs(&self, peer: usize) -> bool {
        self.needed.get(peer).is_some_and(|&n| n > 0)
    }

    /// The peers whose calls the exchange being run waits for, in rank order.
    pub(crate) fn needed_peers(&self) -> impl Iterator<Item = usize> + '_ {
        (self.needed.iter().enumerate()).filter(|(_, &n)| n > 0).map(|(p, _)| p)
    }

    /// Adds the receive of a call `peer` owes, after every call it owes already.
    pub(crate) fn push(&mut self, peer: usize, call: T) {
        if self.queues.len() <= peer {
            self.queues.resize_with(peer + 1, VecDeque::new);
            self.needed.resize(peer + 1, 0);
        }
        self.queues[peer].push_back(call);
        self.len += 1;
    }

    /// Past `max` owed by one peer, the exchange waits for the oldest of them: the queues stay
    /// bounded, and the peer's oldest was sent (a peer holds fewer than `max` calls back:
    /// held_calls.rs, `hold_max`).
    pub(crate) fn bound(&mut self, max: usize) {
        for (q, n) in self.queues.iter().zip(self.needed.iter_mut()) {
            let want = q.len().saturating_sub(max);
            if want > *n {
                self.needed_len += want - *n;
                *n = want;
            }
        }
    }

    /// The exchange waits for every call owed (before links close or change hands, and before a
    /// shared-memory round, which reads peers' state outside the streams).
    pub(crate) fn need_all(&mut self) {
        for (q, n) in self.queues.iter().zip(self.needed.iter_mut()) {
            *n = q.len();
        }
        self.needed_len = self.len;
    }

    /// Drops the calls owed by every peer not in `members` (a shrink that leaves them out).
    pub(crate) fn keep_only(&mut self, members: &[usize]) {
        for (p, (q, n)) in self.queues.iter_mut().zip(self.needed.iter_mut()).enumerate() {
            if !members.contains(&p) {
                self.len -= q.len();
                self.needed_len -= *n;
                q.clear();
                *n = 0;
            }
        }
    }

    /// Advances the calls `peer` owes, oldest first, with `step` (which reads and checks one as
    /// far as its link has it, and says whether anything moved and whether it is done); goes on
    /// to the next while they complete. Returns whether anything moved. A call whose step fails
    /// stays first, for the drain that follows a mismatch (`take_all`).
    pub(crate) fn pump(&mut self, peer: usize, mut step: impl FnMut(&mut T) -> Result<(bool, bool)>) -> Result<bool> {
        let Some(q) = self.queues.get_mut(peer) else {
            return Ok(false);
        };
        let mut moved = false;
        while let Some(call) = q.front_mut() {
            let (m, done) = step(call)?;
            moved |= m;
            if !done {
                break;
            }
            q.pop_front();
            self.len -= 1;
            let n = &mut self.needed[peer];
            if *n > 0 {
                *n -= 1;
                self.needed_len -= 1;
            }
        }
        Ok(moved)
    }

    /// Every call owed, each peer's in stream order, leaving none: for a drain after a mismatch
    /// or a refusal, which reads every call.
    pub(crate) fn take_all(&mut self) -> Vec<T> {
        let all = self.queues.iter_mut().flat_map(|q| q.drain(..)).collect();
        self.needed.iter_mut().for_each(|n| *n = 0);
        (self.len, self.needed_len) = (0, 0);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound is per peer: a peer far behind is waited for, one within it is not; a shrink
    /// drops what a left-out peer owed, and a drain gets each peer's calls in stream order.
    #[test]
    fn each_peer_is_bounded_on_its_own_and_a_drain_keeps_each_streams_order() {
        let mut late = LateCalls::default();
        for seq in 0..6u64 {
            late.push(1, (1, seq));
        }
        for seq in 0..2u64 {
            late.push(3, (3, seq));
        }
        late.bound(4);
        assert!(late.needs(1) && !late.needs(3) && late.any_needed());
        assert_eq!(late.needed_peers().collect::<Vec<_>>(), [1]);
        assert_eq!(
            (late.owed_by(1), late.owed_by(2), late.owed_by(3), late.len()),
            (6, 0, 2, 8)
        );
        late.keep_only(&[0, 3]);
        assert!(!late.any_needed() && late.len() == 2);
        late.push(2, (2, 0));
        late.need_all();
        assert_eq!(late.needed_peers().collect::<Vec<_>>(), [2, 3]);
        assert_eq!(late.take_all(), [(2, 0), (3, 0), (3, 1)]);
        assert!(late.is_empty() && !late.any_needed());
    }

    /// A pump reads on while the calls complete, stops at one that does not, and counts the
    /// ones read against what the exchange waits for; a failed step leaves its call first.
    #[test]
    fn a_pump_reads_on_while_calls_complete_and_leaves_a_failed_one_first() {
        let mut late = LateCalls::default();
        for seq in 0..4u64 {
            late.push(0, seq);
        }
        late.bound(1);
        let moved = late.pump(0, |&mut seq| Ok((true, seq < 2))).unwrap();
        assert!(
            moved && late.owed_by(0) == 2 && late.any_needed(),
            "one of the 3 waited for is left"
        );
        let failed = late.pump(0, |_| Err(crate::contracts::error::Error::invalid("broadcast", "bad")));
        assert!(failed.is_err() && late.owed_by(0) == 2);
        assert_eq!(late.take_all(), [2, 3]);
    }
}
