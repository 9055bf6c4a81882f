//! Call messages held back: the header-only call a rank sends a peer that writes nothing in a
//! collective (a broadcast's root). That peer does not wait for it but checks it when it comes
//! (engine.rs, `begin_call`), so nothing needs it at once; sent one per broadcast, it was a
//! system call of the receiver's per broadcast on TCP. Held, up to `HOLD_MAX` go out together,
//! in the order they were made and before any later message to that peer, or sooner where
//! something may wait for them: an exchange that stalls, a shared-memory round (which compares
//! message counts), a mismatch's drain, the links' close or hand-over (measured:
//! docs/results/cpu.md, part 18).

use super::header::HEADER_BYTES;
use crate::net::links::{Gone, Link};

/// Held calls that make them due: half the unread calls per peer after which a root waits
/// for the oldest (engine.rs, `LATER_MAX`, a bound on all peers' together), so that between
/// two ranks no root waits for a call still held. With more ranks a root far ahead of one
/// receiver may wait for another's held call: a delay, until that receiver holds its 8th, sends
/// to the root, stalls or settles, not a hang.
pub(crate) const HOLD_MAX: usize = 8;

/// Header-only call messages to one peer, not yet (all) written.
#[derive(Default)]
pub(crate) struct HeldCalls {
    to: usize,
    /// The messages, back to back, and how much of them is written.
    bytes: Vec<u8>,
    written: usize,
    /// They must go out now (see the module's comment).
    due: bool,
}

impl HeldCalls {
    /// The peer the held calls go to, if any are held.
    pub(crate) fn to(&self) -> Option<usize> {
        (!self.bytes.is_empty()).then_some(self.to)
    }

    /// Holds the call message `hdr` to `peer`; false where calls to another peer are held
    /// (the caller then sends it itself: the order of messages is per peer).
    pub(crate) fn hold(&mut self, peer: usize, hdr: &[u8; HEADER_BYTES]) -> bool {
        if self.to().is_some_and(|to| to != peer) {
            return false;
        }
        self.to = peer;
        self.bytes.extend_from_slice(hdr);
        self.due |= self.bytes.len() >= HOLD_MAX * HEADER_BYTES;
        true
    }

    /// The held calls must go out now.
    pub(crate) fn make_due(&mut self) {
        self.due = !self.bytes.is_empty();
    }

    /// Whether they must go out now (held calls that are not due wait for one of the events
    /// of the module's comment).
    pub(crate) fn due(&self) -> bool {
        self.due
    }

    /// Writes as much as `link` (to `self.to()`) takes now; returns whether anything moved.
    pub(crate) fn pump(&mut self, link: &mut Link) -> Result<bool, Gone> {
        let n = link.write_messages(&self.bytes, HEADER_BYTES, self.written)?;
        self.written += n;
        if self.written == self.bytes.len() {
            self.bytes.clear();
            (self.written, self.due) = (0, false);
        }
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    #[test]
    fn calls_to_one_peer_are_held_in_order_until_due_and_go_out_whole() {
        let mut h = HeldCalls::default();
        let call = |i: u8| [i; HEADER_BYTES];
        assert!(h.hold(1, &call(1)));
        assert!(!h.hold(2, &call(9)), "calls to another peer are not held beside them");
        assert!(!h.due());
        for i in 2..HOLD_MAX as u8 {
            assert!(h.hold(1, &call(i)));
        }
        assert!(!h.due(), "{} held", HOLD_MAX - 1);
        assert!(h.hold(1, &call(HOLD_MAX as u8)));
        assert!(h.due(), "the {HOLD_MAX}th makes them due");
        let mut link = Link::SelfLoop(VecDeque::new());
        assert!(h.pump(&mut link).unwrap());
        assert_eq!(h.to(), None);
        assert!(!h.due());
        let Link::SelfLoop(q) = link else { unreachable!() };
        let want: Vec<u8> = (1..=HOLD_MAX as u8).flat_map(call).collect();
        assert_eq!(q.into_iter().collect::<Vec<u8>>(), want);
        assert!(h.hold(2, &call(9)), "none held: any peer");
    }
}
