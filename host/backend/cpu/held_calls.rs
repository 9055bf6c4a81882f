//! Call messages held back: the header-only calls of a broadcast that a rank sends to peers
//! that do not wait for them (the root, which writes nothing, and the other receivers; all but
//! the chain's next rank: engine.rs, `begin_broadcast_call`). Those peers check them when they
//! come, so nothing needs them at once; sent one by one, they were most of a broadcast's system
//! calls over TCP, and of its messages on one host. Held, up to `hold_max` per peer go out
//! together, in the order they were made and before any later message to that peer, or sooner
//! where something may wait for them: an exchange that stalls, a shared-memory round (which
//! compares message counts), a mismatch's drain, the links' close or hand-over, and a rank
//! that has gone quiet (idle_senders.rs) (measured: docs/results/cpu.md, parts 18, 30 and 32).
//! Calls are held per peer, so that broadcasts from changing roots hold each root's.

use super::header::HEADER_BYTES;
use crate::net::links::{Gone, Link};

/// Held calls per peer that make them due on a shared-memory ring. Both limits stay below the
/// unread calls per peer after which a rank that does not wait for them waits for the oldest
/// (engine.rs, `LATER_MAX`), so that no rank waits for a call still held.
pub(crate) const HOLD_MAX_SHM: usize = 8;

/// Held calls per peer that make them due over TCP, where each write of them is a system call
/// that also runs the peer's receive path: at 8, those writes were a quarter of the writes of a
/// broadcast at 4 processes (1.15 of 4.15 per broadcast) and 13-15% of both cores' samples.
/// At 64, 8-512 B broadcasts over loopback took 10.3-15.6 us (median 12.3) against 13.0-17.1
/// (median 14.2) at 8 (five interleaved rounds, 4 processes on 2 cores), and between two
/// network namespaces 12.8-17.2 against 15.1-22.2 (three of four rounds; docs/results/cpu.md,
/// part 33). Part 32 had found 32 and 128 no faster than 8, while the root still looked at its
/// receivers' streams on every broadcast once 8 per peer were owed (engine.rs, `poll_due`). On
/// a ring, 64 was no faster.
pub(crate) const HOLD_MAX_TCP: usize = 64;

/// Held calls per peer that make them due on `link`.
pub(crate) fn hold_max(link: &Link) -> usize {
    match link {
        Link::Tcp(_) => HOLD_MAX_TCP,
        _ => HOLD_MAX_SHM,
    }
}

/// The calls rank `me`'s peers over `links` hold back at a time, all together: how many late
/// calls may gather before it looks at them (engine.rs, `poll_due`). At least 1.
pub(crate) fn hold_max_sum(links: &[Link], me: usize) -> usize {
    let sum = (links.iter().enumerate())
        .filter(|&(p, _)| p != me)
        .map(|(_, l)| hold_max(l))
        .sum();
    std::cmp::max(sum, 1)
}

/// Header-only call messages to one peer, not yet (all) written.
#[derive(Default)]
struct Held {
    /// The messages, back to back, and how much of them is written.
    bytes: Vec<u8>,
    written: usize,
    /// They must go out now (see the module's comment).
    due: bool,
}

/// Held calls, per peer.
#[derive(Default)]
pub(crate) struct HeldCalls {
    /// By rank; grown to the highest peer held for.
    peers: Vec<Held>,
    /// Peers with calls held (due or not), and with calls due: most exchanges look at no list.
    holding: usize,
    due: usize,
}

impl HeldCalls {
    /// Whether calls to `peer` are held.
    pub(crate) fn holds_for(&self, peer: usize) -> bool {
        self.peers.get(peer).is_some_and(|h| !h.bytes.is_empty())
    }

    /// Whether calls to any peer are held.
    pub(crate) fn any(&self) -> bool {
        self.holding > 0
    }

    /// The peers calls are held for, in rank order.
    pub(crate) fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (self.peers.iter().enumerate())
            .filter(|(_, h)| !h.bytes.is_empty())
            .map(|(p, _)| p)
    }

    /// Holds the call message `hdr` to `peer`, after any held before it; `max` held make them
    /// due (`hold_max`).
    pub(crate) fn hold(&mut self, peer: usize, hdr: &[u8; HEADER_BYTES], max: usize) {
        if self.peers.len() <= peer {
            self.peers.resize_with(peer + 1, Held::default);
        }
        let h = &mut self.peers[peer];
        self.holding += usize::from(h.bytes.is_empty());
        h.bytes.extend_from_slice(hdr);
        if !h.due && h.bytes.len() >= max * HEADER_BYTES {
            h.due = true;
            self.due += 1;
        }
    }

    /// The calls held for `peer` must go out now.
    pub(crate) fn make_due_for(&mut self, peer: usize) {
        if let Some(h) = self.peers.get_mut(peer).filter(|h| !h.bytes.is_empty() && !h.due) {
            h.due = true;
            self.due += 1;
        }
    }

    /// Every held call must go out now.
    pub(crate) fn make_due(&mut self) {
        if self.due == self.holding {
            return;
        }
        for p in 0..self.peers.len() {
            self.make_due_for(p);
        }
    }

    /// Whether any held calls must go out now (held calls that are not due wait for one of the
    /// events of the module's comment).
    pub(crate) fn any_due(&self) -> bool {
        self.due > 0
    }

    /// The peers whose held calls must go out now, in rank order.
    pub(crate) fn due_peers(&self) -> impl Iterator<Item = usize> + '_ {
        (self.peers.iter().enumerate()).filter(|(_, h)| h.due).map(|(p, _)| p)
    }

    /// Writes as much of the calls held for `peer` as `link` (to that peer) takes now; returns
    /// whether anything moved. Where all are out, none is held for it any more.
    pub(crate) fn pump(&mut self, peer: usize, link: &mut Link) -> Result<bool, Gone> {
        let Some(h) = self.peers.get_mut(peer).filter(|h| !h.bytes.is_empty()) else {
            return Ok(false);
        };
        let n = link.write_messages(&h.bytes, HEADER_BYTES, h.written)?;
        h.written += n;
        if h.written == h.bytes.len() {
            h.bytes.clear();
            self.holding -= 1;
            self.due -= usize::from(h.due);
            (h.written, h.due) = (0, false);
        }
        Ok(n > 0)
    }

    /// Drops the calls held for every peer not in `members` (a shrink that leaves them out:
    /// their links may no longer take a byte).
    pub(crate) fn keep_only(&mut self, members: &[usize]) {
        for (p, h) in self.peers.iter_mut().enumerate() {
            if !h.bytes.is_empty() && !members.contains(&p) {
                self.holding -= 1;
                self.due -= usize::from(h.due);
                *h = Held::default();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    fn written(link: Link) -> Vec<u8> {
        let Link::SelfLoop(q) = link else { unreachable!() };
        q.into_iter().collect()
    }

    #[test]
    fn calls_to_each_peer_are_held_in_order_until_due_and_go_out_whole() {
        let mut h = HeldCalls::default();
        let call = |i: u8| [i; HEADER_BYTES];
        h.hold(1, &call(1), HOLD_MAX_SHM);
        h.hold(2, &call(9), HOLD_MAX_SHM);
        assert!(!h.any_due());
        assert_eq!(h.peers().collect::<Vec<_>>(), [1, 2]);
        for i in 2..HOLD_MAX_SHM as u8 {
            h.hold(1, &call(i), HOLD_MAX_SHM);
        }
        assert!(!h.any_due(), "{} held", HOLD_MAX_SHM - 1);
        h.hold(1, &call(HOLD_MAX_SHM as u8), HOLD_MAX_SHM);
        assert_eq!(
            h.due_peers().collect::<Vec<_>>(),
            [1],
            "the {HOLD_MAX_SHM}th makes them due"
        );
        let mut link = Link::SelfLoop(VecDeque::new());
        assert!(h.pump(1, &mut link).unwrap());
        assert!(!h.holds_for(1) && h.holds_for(2));
        assert!(!h.any_due());
        let want: Vec<u8> = (1..=HOLD_MAX_SHM as u8).flat_map(call).collect();
        assert_eq!(written(link), want);
        h.make_due();
        assert_eq!(h.due_peers().collect::<Vec<_>>(), [2]);
        let mut link = Link::SelfLoop(VecDeque::new());
        assert!(h.pump(2, &mut link).unwrap());
        assert_eq!(written(link), call(9));
        assert!(!h.any() && !h.any_due());
    }

    #[test]
    fn a_hand_over_keeps_the_calls_of_members_only() {
        let mut h = HeldCalls::default();
        for p in [0, 2, 3] {
            h.hold(p, &[p as u8; HEADER_BYTES], HOLD_MAX_SHM);
        }
        h.make_due_for(3);
        h.keep_only(&[0, 1, 2]);
        assert_eq!(h.peers().collect::<Vec<_>>(), [0, 2]);
        assert!(!h.any_due());
        h.keep_only(&[]);
        assert!(!h.any());
    }
}
