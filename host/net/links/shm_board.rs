//! The board: a place in every rank's shared-memory segment where the rank publishes one small
//! contribution per collective round, and where every peer of the same host reads it in place.
//! A round costs one copy in (the owner's) and reads from peers' mappings, where the rings cost
//! a copy into the ring, a copy out, and a framed header each way.
//!
//! Layout (after the rings): a line with the owner's `done` round, then `SLOTS` slots, each a
//! control line (`epoch`, the round's label and length), an index with two words per rank (the
//! number of framed messages the owner had sent to that rank before the round, so readers can
//! tell a message they never received, that is, a mismatched call, from a late one; and where
//! part `r` of the contribution lies, for rounds that carry one part per rank), and
//! `SLOT_BYTES` of data. Round `e` (epochs start at 1 and only grow) uses slot `e % SLOTS`.
//!
//! Ordering: the owner writes the slot's index, label and data, then stores `epoch = e` with
//! Release; a reader Acquire-loads `epoch == e` before it reads them. A rank says `done = d`
//! once it has read all it will ever read of every peer's rounds up to `d`: in the control line
//! of each round it publishes (written before its `epoch`), and, where it learns more between
//! rounds, in its area's `done` line (Release). The owner rewrites the slot of round `e` (for
//! round `e + SLOTS`) only after it has Acquire-loaded `done >= e` from every peer, in either
//! place: a slot is never rewritten while it is read, and a reader waiting for `e` never sees
//! `e + SLOTS`. Most rounds are all-to-all, so `done`
//! trails the owner's own rounds by one and never holds anyone up; the slots matter where a
//! rank reads nothing in a round (a broadcast's root, which checks its peers' calls later) and
//! so runs up to `SLOTS - 1` rounds ahead of the others.

use super::link::PeerSegments;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Data bytes of one slot: the largest contribution a round can carry.
pub(crate) const SLOT_BYTES: usize = 64 << 10;
const LINE: usize = 64;

/// Bytes of one slot's index (two words per rank), whole cache lines.
fn index_bytes(size: usize) -> usize {
    (size * 16).div_ceil(LINE) * LINE
}

fn slot_stride(size: usize) -> usize {
    LINE + index_bytes(size) + SLOT_BYTES
}

/// Slots per rank: how many rounds a rank may publish beyond the last one every peer is done
/// with. A broadcast's root runs that far ahead of its slowest receiver.
pub(crate) const SLOTS: u64 = 8;

/// Bytes the area adds to the segment of each rank of a communicator of `size`.
pub(crate) fn area_bytes(size: usize) -> usize {
    LINE + SLOTS as usize * slot_stride(size)
}

#[repr(C, align(64))]
struct SlotCtl {
    epoch: AtomicU64,
    /// What the round is (the caller's encoding, so readers can tell mismatched calls apart)
    /// and how many bytes it carries; written before `epoch` is published.
    label: AtomicU64,
    nbytes: AtomicU64,
    /// The owner's `done` as it published the round: where peers read it for free, since
    /// they read this line anyway (the area's own `done` line changes only between rounds).
    done: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<SlotCtl>() == LINE);

/// One rank's view of the boards of its communicator (all ranks on this host).
pub(crate) struct Board {
    rank: usize,
    /// Area start in every rank's segment (ours included), indexed by rank.
    areas: Vec<*mut u8>,
    /// The number of ranks the areas were laid out for (more than `areas` after a shrink).
    layout: usize,
    /// Keeps those mappings alive.
    _segments: Arc<PeerSegments>,
    /// The round the next `publish` starts.
    next: u64,
    /// Each peer's `done` as last loaded (only reloaded when a publish needs more).
    peer_done: Vec<u64>,
}

// SAFETY: the areas are shared memory accessed through the atomics above with the documented
// orderings; one Board is used by one thread at a time (it sits in the backend's lock).
unsafe impl Send for Board {}

impl Board {
    /// # Safety
    /// `areas[r]` must point to `area_bytes(areas.len())` of zero-initialised, 64-aligned shared memory in
    /// `segments`' mappings, the area of rank `r`; ours (`areas[rank]`) is written by us alone.
    pub(crate) unsafe fn new(rank: usize, areas: Vec<*mut u8>, segments: Arc<PeerSegments>) -> Board {
        Board {
            rank,
            layout: areas.len(),
            areas,
            _segments: segments,
            next: 1,
            peer_done: Vec::new(),
        }
    }

    /// The board of a smaller communicator of `members` (our ranks, in its order), in which we
    /// are rank `rank`: the same areas and layout, rounds numbered on. The caller knows every
    /// rank left out is done with the board for good, and every member's next round is ours.
    pub(crate) fn keep(self, members: &[usize], rank: usize) -> Board {
        Board {
            rank,
            areas: members.iter().map(|&m| self.areas[m]).collect(),
            layout: self.layout,
            _segments: self._segments,
            next: self.next,
            peer_done: Vec::new(),
        }
    }

    fn slot(&self, r: usize, epoch: u64) -> *mut u8 {
        // SAFETY: slot (epoch % SLOTS) lies inside rank r's area, after its `done` line.
        unsafe { self.areas[r].add(LINE + (epoch % SLOTS) as usize * slot_stride(self.layout)) }
    }

    fn done_word(&self, r: usize) -> &AtomicU64 {
        // SAFETY: every area starts with its `done` line.
        unsafe { &*(self.areas[r] as *const AtomicU64) }
    }

    /// Says that this rank has read all it will read of every peer's rounds up to `round`, where
    /// that changes between rounds (a root's later checks); `publish` says it for each round.
    pub(crate) fn set_done(&self, round: u64) {
        let w = self.done_word(self.rank);
        if w.load(Ordering::Relaxed) < round {
            w.store(round, Ordering::Release);
        }
    }

    /// The newest `done` of `peer` that we can see, and at least `need` if it is there: the
    /// one it published with round `need + 1` (or a later round in that slot), else its
    /// area's own line.
    fn peer_done(&self, peer: usize, need: u64) -> u64 {
        let s = self.slot_ctl(peer, need + 1);
        let in_round = if s.epoch.load(Ordering::Acquire) > need {
            s.done.load(Ordering::Relaxed)
        } else {
            0
        };
        if in_round >= need {
            return in_round;
        }
        in_round.max(self.done_word(peer).load(Ordering::Acquire))
    }

    /// The first peer that is not yet done with the round whose slot the next `publish`
    /// rewrites (`None`: the slot is free).
    pub(crate) fn slot_held_by(&mut self) -> Option<usize> {
        let need = self.next.saturating_sub(SLOTS);
        if self.peer_done.len() != self.areas.len() {
            self.peer_done = vec![0; self.areas.len()];
        }
        for p in (0..self.areas.len()).filter(|&p| p != self.rank) {
            if self.peer_done[p] < need {
                self.peer_done[p] = self.peer_done(p, need);
                if self.peer_done[p] < need {
                    return Some(p);
                }
            }
        }
        None
    }

    /// Whether `peer` is done with the round whose slot the next `publish` rewrites.
    pub(crate) fn peer_done_for_next(&self, peer: usize) -> bool {
        let need = self.next.saturating_sub(SLOTS);
        self.peer_done(peer, need) >= need
    }

    fn slot_ctl(&self, r: usize, epoch: u64) -> &SlotCtl {
        // SAFETY: every slot starts with its control line.
        unsafe { &*(self.slot(r, epoch) as *const SlotCtl) }
    }

    /// Index word `which` (0: messages sent, 1: part placement) for rank `to` in r's slot.
    fn index(&self, r: usize, epoch: u64, to: usize, which: usize) -> &AtomicU64 {
        // SAFETY: the index follows the control line, two aligned words per rank.
        unsafe { &*(self.slot(r, epoch).add(LINE + (2 * to + which) * 8) as *const AtomicU64) }
    }

    fn slot_data(&self, r: usize, epoch: u64) -> *mut u8 {
        // SAFETY: the data follows the index.
        unsafe { self.slot(r, epoch).add(LINE + index_bytes(self.layout)) }
    }

    /// The round `publish` will start next.
    pub(crate) fn next_round(&self) -> u64 {
        self.next
    }

    /// Publishes `parts`, back to back, as this rank's contribution to the next round and
    /// returns the round; at most one part per rank, `SLOT_BYTES` in all. `sent[p]`: the framed
    /// messages this rank has sent to p so far; `done`: as `set_done` says it. Call only after
    /// completing the previous round and once `slot_held_by` says the slot is free (see the
    /// ordering above).
    pub(crate) fn publish(&mut self, label: u64, parts: &[&[u8]], sent: &[u64], done: u64) -> u64 {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        assert!(
            total <= SLOT_BYTES && parts.len() <= self.areas.len(),
            "caller checks the slot size"
        );
        let (e, me) = (self.next, self.rank);
        let mut at = 0;
        for (i, part) in parts.iter().enumerate() {
            // SAFETY: our own slot, in bounds (total checked above); no peer reads it until
            // `epoch` says round e, and every peer is done with round e - SLOTS, which used it
            // last (see the ordering above).
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), self.slot_data(me, e).add(at), part.len()) };
            self.index(me, e, i, 1)
                .store((at as u64) << 32 | part.len() as u64, Ordering::Relaxed);
            at += part.len();
        }
        for (p, &n) in sent.iter().enumerate() {
            self.index(me, e, p, 0).store(n, Ordering::Relaxed);
        }
        let s = self.slot_ctl(me, e);
        s.label.store(label, Ordering::Relaxed);
        s.nbytes.store(total as u64, Ordering::Relaxed);
        s.done.store(done, Ordering::Relaxed);
        s.epoch.store(e, Ordering::Release);
        self.next += 1;
        e
    }

    /// `peer`'s label and byte count for round `e`, once it has published it.
    pub(crate) fn peer_round(&self, peer: usize, e: u64) -> Option<(u64, u64)> {
        let s = self.slot_ctl(peer, e);
        if s.epoch.load(Ordering::Acquire) != e {
            return None;
        }
        Some((s.label.load(Ordering::Relaxed), s.nbytes.load(Ordering::Relaxed)))
    }

    /// How many framed messages `peer` had sent to us before its round `e`. Call only after
    /// `peer_round` showed round `e`.
    pub(crate) fn peer_sent_to_us(&self, peer: usize, e: u64) -> u64 {
        self.index(peer, e, self.rank, 0).load(Ordering::Relaxed)
    }

    /// Part `i` of `peer`'s round `e`; `None` if the index points outside the slot. Call only
    /// after `peer_round` showed round `e`.
    pub(crate) fn part(&self, peer: usize, e: u64, i: usize) -> Option<&[u8]> {
        let w = self.index(peer, e, i, 1).load(Ordering::Relaxed);
        let (at, len) = ((w >> 32) as usize, (w & 0xffff_ffff) as usize);
        if at + len > SLOT_BYTES {
            return None;
        }
        // SAFETY: inside the slot; not rewritten while borrowed (see `data`).
        Some(unsafe { std::slice::from_raw_parts(self.slot_data(peer, e).add(at), len) })
    }

    /// The first `len` bytes `rank` published for round `e`. Call only after `peer_round` (or our
    /// own `publish`) showed round `e`, with `len` no larger than that round's bytes.
    pub(crate) fn data(&self, rank: usize, e: u64, len: usize) -> &[u8] {
        assert!(len <= SLOT_BYTES);
        // SAFETY: inside the slot; the owner does not rewrite it before we say we are done
        // with round e, which needs our next `publish` or `set_done`, so not while this borrow
        // lives (our callers mark no round done before they are through with it).
        unsafe { std::slice::from_raw_parts(self.slot_data(rank, e), len) }
    }

    /// The newest round `peer` has published (0: none yet).
    pub(crate) fn peer_latest(&self, peer: usize) -> u64 {
        (0..SLOTS)
            .map(|s| self.slot_ctl(peer, s).epoch.load(Ordering::Acquire))
            .max()
            .unwrap_or(0)
    }
}
