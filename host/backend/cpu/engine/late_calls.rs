//! Peers' calls that a rank checks as they come rather than before its own collective goes on:
//! the header-only call messages of collectives in which those peers' bytes do not land in this
//! rank's buffers (a broadcast's root hears from every receiver, a receiver from the receivers
//! besides the rank it reads from; engine.rs, `Lands`). They are kept per peer, in the order of
//! that peer's stream, so that a sweep steps only the oldest of each peer's: a root far ahead of
//! its receivers keeps up to `LATER_MAX` per peer unread, and a single list of all of them,
//! walked and copied on every exchange that looked at it, cost the root a pass over all of them
//! per broadcast.

use super::{Engine, Xfer};
use crate::contracts::error::Result;
use crate::net::links::Link;
use std::collections::VecDeque;

/// Late calls, per peer.
#[derive(Default)]
pub(super) struct LateCalls {
    /// By rank, oldest first; grown to the highest peer a call is owed by.
    queues: Vec<VecDeque<Xfer<'static>>>,
    /// By rank: how many of the oldest the exchange being run waits for (`bound`, `need_all`).
    needed: Vec<usize>,
    /// Calls in all queues, and calls waited for: most exchanges look at no queue.
    len: usize,
    needed_len: usize,
}

impl LateCalls {
    /// Whether no call is owed.
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Calls owed, all peers together.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Calls `peer` owes.
    pub(super) fn owed_by(&self, peer: usize) -> usize {
        self.queues.get(peer).map_or(0, VecDeque::len)
    }

    /// Whether an exchange must wait for some of them.
    pub(super) fn any_needed(&self) -> bool {
        self.needed_len > 0
    }

    /// Whether the exchange being run waits for a call `peer` owes.
    pub(super) fn needs(&self, peer: usize) -> bool {
        self.needed.get(peer).is_some_and(|&n| n > 0)
    }

    /// The peers whose calls the exchange being run waits for, in rank order.
    pub(super) fn needed_peers(&self) -> impl Iterator<Item = usize> + '_ {
        (self.needed.iter().enumerate()).filter(|(_, &n)| n > 0).map(|(p, _)| p)
    }

    /// Adds `x`, a header-only call receive (`Xfer::Recv` with `later` set), after every call
    /// its peer owes already.
    pub(super) fn push(&mut self, x: Xfer<'static>) {
        let peer = x.peer();
        if self.queues.len() <= peer {
            self.queues.resize_with(peer + 1, VecDeque::new);
            self.needed.resize(peer + 1, 0);
        }
        self.queues[peer].push_back(x);
        self.len += 1;
    }

    /// Past `max` owed by one peer, the exchange waits for the oldest of them: the queues stay
    /// short, and the peer's oldest was sent (a peer holds fewer than `max` calls back:
    /// held_calls.rs, `HOLD_MAX`).
    pub(super) fn bound(&mut self, max: usize) {
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
    pub(super) fn need_all(&mut self) {
        for (q, n) in self.queues.iter().zip(self.needed.iter_mut()) {
            *n = q.len();
        }
        self.needed_len = self.len;
    }

    /// Drops the calls owed by every peer not in `members` (a shrink that leaves them out).
    pub(super) fn keep_only(&mut self, members: &[usize]) {
        for (p, (q, n)) in self.queues.iter_mut().zip(self.needed.iter_mut()).enumerate() {
            if !members.contains(&p) {
                self.len -= q.len();
                self.needed_len -= *n;
                q.clear();
                *n = 0;
            }
        }
    }

    /// Reads and checks the calls `peer` owes, oldest first, as far as `link` (from that peer)
    /// has them; returns whether anything moved. A call that fails its check stays first, read,
    /// for the drain that follows a mismatch (`take_all`).
    pub(super) fn pump(&mut self, peer: usize, link: &mut Link, op: &'static str) -> Result<bool> {
        let Some(q) = self.queues.get_mut(peer) else {
            return Ok(false);
        };
        let mut moved = false;
        while let Some(x) = q.front_mut() {
            // Later calls count against no gate (`Xfer::call_pending`).
            moved |= Engine::step(link, x, op, &mut 0)?;
            if !x.done() {
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
    pub(super) fn take_all(&mut self) -> Vec<Xfer<'static>> {
        let all = self.queues.iter_mut().flat_map(|q| q.drain(..)).collect();
        self.needed.iter_mut().for_each(|n| *n = 0);
        (self.len, self.needed_len) = (0, 0);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Header, Tag, HEADER_BYTES};
    use super::*;

    fn call_from(peer: usize, seq: u64) -> Xfer<'static> {
        Xfer::Recv {
            peer,
            expect: Header {
                tag: Tag {
                    op: 3,
                    dtype: 0,
                    redop: 0,
                    nbytes: 0,
                },
                seq,
                call: None,
                refused: false,
            },
            hdr: [0; HEADER_BYTES],
            hpos: 0,
            data: &mut [],
            pos: 0,
            call: true,
            gated: true,
            later: true,
            earlier: true,
        }
    }

    /// The bound is per peer: a peer far behind is waited for, one within it is not; a shrink
    /// drops what a left-out peer owed, and a drain gets each peer's calls in stream order.
    #[test]
    fn each_peer_is_bounded_on_its_own_and_a_drain_keeps_each_streams_order() {
        let mut late = LateCalls::default();
        for seq in 0..6 {
            late.push(call_from(1, seq));
        }
        for seq in 0..2 {
            late.push(call_from(3, seq));
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
        late.push(call_from(2, 0));
        late.need_all();
        assert_eq!(late.needed_peers().collect::<Vec<_>>(), [2, 3]);
        let order: Vec<(usize, u64)> = (late.take_all().iter())
            .map(|x| match x {
                Xfer::Recv { peer, expect, .. } => (*peer, expect.seq),
                Xfer::Send { .. } => unreachable!("only receives are late"),
            })
            .collect();
        assert_eq!(order, [(2, 0), (3, 0), (3, 1)]);
        assert!(late.is_empty() && !late.any_needed());
    }
}
