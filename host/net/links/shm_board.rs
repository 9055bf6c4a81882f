//! The board: a place in every rank's shared-memory segment where the rank publishes one small
//! contribution per collective round, and where every peer of the same host reads it in place.
//! A round costs one copy in (the owner's) and reads from peers' mappings, where the rings cost
//! a copy into the ring, a copy out, and a framed header each way.
//!
//! Layout (after the rings): two slots, each a control line (`epoch`, the round's label and
//! length), an index with two words per rank (the number of framed messages the owner had sent
//! to that rank before the round, so readers can tell a message they never received, that is, a
//! mismatched call, from a late one; and where part `r` of the contribution lies, for rounds
//! that carry one part per rank), and `SLOT_BYTES` of data. Round `e` (epochs start at 1 and only
//! grow) uses slot `e % 2`. On a board laid out for at most 2 ranks (a shrink to 2 keeps the
//! layout it had) the index sits in the control line's spare room: a reader then takes one line
//! from the owner's core before the data instead of two (measured, 2 processes: up to 12% off small
//! rounds; docs/results/cpu.md). There the only reader of a slot is the other rank, so only its
//! index is kept, in one word (`INLINE_INDEX`), a round with a part per rank publishes only the
//! other rank's part, and what a round publishes lies in the control line's last words instead
//! of the data where it is at most `INLINE_BYTES`: a small round is then the one line the
//! reader waited on (docs/results/cpu.md, part 17).
//!
//! Ordering: the owner writes the slot's index, label and data (the index and label as atomic
//! words, in the control line or after it; a small contribution as bytes of the control line; a
//! round with a count and no data, `publish_count`, writes no data and no part places), then
//! stores `epoch = e` with Release; a reader
//! Acquire-loads `epoch == e` before it reads them. Every round is all-to-all: a rank completes
//! round `e` only after reading every peer's round `e`. So when the owner rewrites slot `e % 2`
//! for round `e + 2`, it has completed round `e + 1`, has seen every peer publish `e + 1`, and
//! every peer published `e + 1` only after it finished reading round `e`: a slot is never
//! rewritten while it is read, and a reader waiting for `e` never sees `e + 2`.
//! No extra "done" flag is needed; a round kind that is not all-to-all would need one.

use super::link::PeerSegments;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Data bytes of one slot: the largest contribution a round can carry.
pub(crate) const SLOT_BYTES: usize = 64 << 10;
const LINE: usize = 64;

/// Words of the control line after `epoch`, `label` and `nbytes`.
const SPARE_WORDS: usize = LINE / 8 - 3;

/// Whether a slot's index fits the control line's spare words, so that a reader finds the
/// whole call, and where its part lies, in the one line it waited on instead of taking a
/// second line from the owner's core afterwards: layouts of 1 or 2 ranks, where the index is
/// the other rank's entry alone, in one word (`INLINE_INDEX`).
fn index_inline(size: usize) -> bool {
    size <= 2
}

/// The spare word that holds an inline index: above, the messages sent to the other rank,
/// modulo 2^32 (a reader's own count is never 2^31 messages away from it: the messages one
/// rank has sent and the other not yet read lie in a ring of far fewer, each at least a
/// header's 48 bytes, and a sender waits for room; the receives a rank has counted ahead of
/// their messages are one per call, each with its own call message in that ring); below, its
/// part's length and `PART_INLINE` (at 2 ranks a round publishes one part, so it starts at 0).
const INLINE_INDEX: usize = 0;
/// Bytes of a contribution that lies in the control line's spare words after an inline index.
const INLINE_BYTES: usize = (SPARE_WORDS - 1) * 8;
/// Where those bytes start in the control line: after `epoch`, `label`, `nbytes` and the index.
const INLINE_AT: usize = LINE - INLINE_BYTES;
/// In a part's placement: the part lies in the control line (else in the slot's data). Parts
/// are shorter than 2^31 bytes.
const PART_INLINE: u64 = 1 << 31;

/// Bytes of one slot's index (two words per rank) after the control line, whole cache lines.
fn index_bytes(size: usize) -> usize {
    if index_inline(size) {
        return 0;
    }
    (size * 16).div_ceil(LINE) * LINE
}

fn slot_stride(size: usize) -> usize {
    LINE + index_bytes(size) + SLOT_BYTES
}

/// Bytes the area adds to the segment of each rank of a communicator of `size`.
pub(crate) fn area_bytes(size: usize) -> usize {
    2 * slot_stride(size)
}

#[repr(C, align(64))]
struct SlotCtl {
    epoch: AtomicU64,
    /// What the round is (the caller's encoding, so readers can tell mismatched calls apart)
    /// and how many bytes it carries (a round published with `publish_count` carries none: its
    /// count is a number for the peers, and `data` and `part` have nothing to read there);
    /// written before `epoch` is published, as `spare` is.
    label: AtomicU64,
    nbytes: AtomicU64,
    /// The index, where it fits (`index_inline`), and after it a small contribution
    /// (`INLINE_BYTES`, as bytes).
    spare: [AtomicU64; SPARE_WORDS],
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
        }
    }

    fn slot(&self, r: usize, epoch: u64) -> *mut u8 {
        // SAFETY: slot (epoch % 2) lies inside rank r's area.
        unsafe { self.areas[r].add((epoch % 2) as usize * slot_stride(self.layout)) }
    }

    fn slot_ctl(&self, r: usize, epoch: u64) -> &SlotCtl {
        // SAFETY: every slot starts with its control line.
        unsafe { &*(self.slot(r, epoch) as *const SlotCtl) }
    }

    /// Index word `which` (0: messages sent, 1: part placement) for rank `to` in r's slot,
    /// where the index follows the control line (not `index_inline`).
    fn index(&self, r: usize, epoch: u64, to: usize, which: usize) -> &AtomicU64 {
        debug_assert!(!index_inline(self.layout));
        // SAFETY: the index follows the control line, two aligned words per rank.
        unsafe { &*(self.slot(r, epoch).add(LINE + (2 * to + which) * 8) as *const AtomicU64) }
    }

    /// The inline index of r's slot (`INLINE_INDEX`).
    fn inline_index(&self, r: usize, epoch: u64) -> &AtomicU64 {
        &self.slot_ctl(r, epoch).spare[INLINE_INDEX]
    }

    /// Whether a round that publishes `bytes` keeps them in the control line.
    fn data_inline(&self, bytes: u64) -> bool {
        index_inline(self.layout) && bytes <= INLINE_BYTES as u64
    }

    /// Where r's bytes for round `epoch` lie, in the control line (`inline`, see
    /// `data_inline`) or in the slot's data, and how many fit there.
    fn slot_data(&self, r: usize, epoch: u64, inline: bool) -> (*mut u8, usize) {
        if inline {
            // SAFETY: the last INLINE_BYTES of the slot's control line, which nothing else uses
            // on this layout (the index takes the spare word before them).
            return (unsafe { self.slot(r, epoch).add(INLINE_AT) }, INLINE_BYTES);
        }
        // SAFETY: the data follows the index (which is empty where it sits in the control
        // line), inside the slot.
        (
            unsafe { self.slot(r, epoch).add(LINE + index_bytes(self.layout)) },
            SLOT_BYTES,
        )
    }

    /// The round `publish` will start next.
    pub(crate) fn next_round(&self) -> u64 {
        self.next
    }

    /// Publishes `parts`, back to back, as this rank's contribution to the next round and
    /// returns the round; at most one part per rank, `SLOT_BYTES` in all. `sent[p]`: the framed
    /// messages this rank has sent to p so far. Call only after completing the previous round
    /// (see the ordering above).
    pub(crate) fn publish(&mut self, label: u64, parts: &[&[u8]], sent: &[u64]) -> u64 {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        assert!(
            total <= SLOT_BYTES && parts.len() <= self.areas.len(),
            "caller checks the slot size"
        );
        self.publish_counted(label, parts, total as u64, sent)
    }

    /// As `publish` with no data, but `nbytes` as the round's byte count: for a rank whose
    /// contribution is only a number (a broadcast's receiver, its buffer's length), which its
    /// peers then find in the control line they waited on, not in a second line.
    pub(crate) fn publish_count(&mut self, label: u64, nbytes: u64, sent: &[u64]) -> u64 {
        self.publish_counted(label, &[], nbytes, sent)
    }

    /// As `publish` of one part, `data`, but with `nbytes` as the round's byte count: the
    /// first piece of a contribution larger than a slot, whose readers check the whole
    /// contribution's length before they take any of it. `data` fills the slot's data (it is
    /// not kept in the control line), and `nbytes` is at least its length.
    pub(crate) fn publish_first_piece(&mut self, label: u64, data: &[u8], nbytes: u64, sent: &[u64]) -> u64 {
        assert!(
            data.len() <= SLOT_BYTES && data.len() as u64 <= nbytes && !self.data_inline(data.len() as u64),
            "caller publishes a whole slot first"
        );
        self.publish_counted(label, &[data], nbytes, sent)
    }

    fn publish_counted(&mut self, label: u64, parts: &[&[u8]], nbytes: u64, sent: &[u64]) -> u64 {
        debug_assert!(sent.len() <= self.layout, "one count per rank of the layout at most");
        let (e, me) = (self.next, self.rank);
        // With the index inline, no one reads our own part of a round with a part per rank.
        let published = |i: usize| !index_inline(self.layout) || parts.len() == 1 || i != me;
        let bytes: usize = (parts.iter().enumerate())
            .filter(|&(i, _)| published(i))
            .map(|(_, p)| p.len())
            .sum();
        let (data, _) = self.slot_data(me, e, self.data_inline(bytes as u64));
        let mut at = 0;
        for (i, part) in parts.iter().enumerate().filter(|&(i, _)| published(i)) {
            // SAFETY: our own slot, in bounds (`publish` checked the total, and inline bytes
            // fit the control line; `publish_count` has no parts); no peer reads it until
            // `epoch` says round e, and every peer is done with round e - 2, which used it last
            // (see the ordering above).
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), data.add(at), part.len()) };
            if !index_inline(self.layout) {
                self.index(me, e, i, 1)
                    .store((at as u64) << 32 | part.len() as u64, Ordering::Relaxed);
            }
            at += part.len();
        }
        if index_inline(self.layout) {
            // The other rank's entry, if there is one; its part (if published) starts at 0.
            if let Some(o) = (0..self.areas.len()).find(|&o| o != me) {
                let inline = if self.data_inline(bytes as u64) { PART_INLINE } else { 0 };
                let place = (parts.get(o).filter(|_| published(o))).map_or(0, |p| inline | p.len() as u64);
                let sent = sent.get(o).map_or(0, |&n| n as u32 as u64);
                self.inline_index(me, e).store(sent << 32 | place, Ordering::Relaxed);
            }
        } else {
            for (p, &n) in sent.iter().enumerate() {
                self.index(me, e, p, 0).store(n, Ordering::Relaxed);
            }
        }
        let s = self.slot_ctl(me, e);
        s.label.store(label, Ordering::Relaxed);
        s.nbytes.store(nbytes, Ordering::Relaxed);
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

    /// How many framed messages `peer` had sent to us before its round `e`; `near`, the number
    /// we have received from it, places a count kept modulo 2^32 (an inline index). Call only
    /// after `peer_round` showed round `e`.
    pub(crate) fn peer_sent_to_us(&self, peer: usize, e: u64, near: u64) -> u64 {
        if !index_inline(self.layout) {
            return self.index(peer, e, self.rank, 0).load(Ordering::Relaxed);
        }
        let low = (self.inline_index(peer, e).load(Ordering::Relaxed) >> 32) as u32;
        near.wrapping_add(low.wrapping_sub(near as u32) as i32 as i64 as u64)
    }

    /// Part `i` of `peer`'s round `e`; `None` if the index points outside the round's data
    /// (or is not kept: `peer`'s own part, where the index is inline). Call only after
    /// `peer_round` showed round `e`, for a round with a part per rank.
    pub(crate) fn part(&self, peer: usize, e: u64, i: usize) -> Option<&[u8]> {
        let w = if !index_inline(self.layout) {
            self.index(peer, e, i, 1).load(Ordering::Relaxed)
        } else if i != peer {
            self.inline_index(peer, e).load(Ordering::Relaxed) & 0xffff_ffff
        } else {
            return None;
        };
        let (at, len) = ((w >> 32) as usize, (w & 0xffff_ffff & !PART_INLINE) as usize);
        let (data, room) = self.slot_data(peer, e, w & PART_INLINE != 0);
        if at + len > room {
            return None;
        }
        // SAFETY: inside the round's data; not rewritten while borrowed (see `data`).
        Some(unsafe { std::slice::from_raw_parts(data.add(at), len) })
    }

    /// The first `len` bytes `rank` published for round `e`. Call only after `peer_round` (or
    /// our own `publish`) showed round `e`; not for a round published with `publish_count`, nor
    /// for one with a part per rank where the index is inline (only the other rank's part is
    /// published there); and with `len` the round's byte count, or less where both are more
    /// than `INLINE_BYTES`: `len` says where the bytes lie. The caller knows the count already;
    /// where `rank` is our own, loading it again from our control line would take that line
    /// back from the peer that just read it (measured: 1.08-1.13 of the time for all_reduce at
    /// 2 processes, 32-256 B; docs/results/cpu.md, part 17).
    pub(crate) fn data(&self, rank: usize, e: u64, len: usize) -> &[u8] {
        debug_assert!({
            let nbytes = self.slot_ctl(rank, e).nbytes.load(Ordering::Relaxed);
            len as u64 <= nbytes && self.data_inline(len as u64) == self.data_inline(nbytes)
        });
        let (data, room) = self.slot_data(rank, e, self.data_inline(len as u64));
        assert!(len <= room, "no more than the round's bytes");
        // SAFETY: inside the round's data; the owner does not rewrite it before we publish
        // round e + 1, which needs `&mut self`, so not while this borrow lives.
        unsafe { std::slice::from_raw_parts(data, len) }
    }

    /// The newest round `peer` has published (0: none yet).
    pub(crate) fn peer_latest(&self, peer: usize) -> u64 {
        let a = self.slot_ctl(peer, 0).epoch.load(Ordering::Acquire);
        let b = self.slot_ctl(peer, 1).epoch.load(Ordering::Acquire);
        a.max(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Boards of `size` ranks over zeroed, 64-aligned memory of this process; `mem` keeps it.
    fn boards(size: usize, mem: &mut Vec<u64>) -> Vec<Board> {
        let area = area_bytes(size);
        *mem = vec![0u64; (size * area + LINE) / 8];
        let start = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: at most LINE - 8 bytes in, inside `mem` (one LINE more than the areas need).
        let base = unsafe { start.add(start.align_offset(LINE)) };
        // SAFETY: each area lies inside `mem`, past the alignment padding.
        let areas: Vec<*mut u8> = (0..size).map(|r| unsafe { base.add(r * area) }).collect();
        let segs = Arc::new(PeerSegments {
            segs: vec![],
            watches: vec![],
            readable: vec![],
        });
        // SAFETY: each area is zeroed, 64-aligned, `area_bytes(size)` long inside `mem`, which
        // the caller keeps alive while the boards live; rank r writes only its own area.
        (0..size)
            .map(|r| unsafe { Board::new(r, areas.clone(), segs.clone()) })
            .collect()
    }

    /// One round on `b` (one board per rank, in rank order): every rank publishes one part per
    /// rank and a sent count per rank, all values distinct, then every rank reads every peer's
    /// label, count for it and parts.
    fn round_on(b: &mut [Board], label: u64) {
        let n = b.len();
        let value = |p: usize, r: usize| (label as usize * 31 + 7 * p + r) as u8;
        let parts = |p: usize| -> Vec<Vec<u8>> { (0..n).map(|r| vec![value(p, r); 1 + r + p]).collect() };
        let sent = |p: usize| -> Vec<u64> { (0..n).map(|r| 1000 * (p as u64 + 1) + 10 * r as u64 + label).collect() };
        let mut round = 0;
        for (p, board) in b.iter_mut().enumerate() {
            let mine = parts(p);
            let refs: Vec<&[u8]> = mine.iter().map(|v| &v[..]).collect();
            round = board.publish(label + p as u64, &refs, &sent(p));
        }
        for (q, reader) in b.iter().enumerate() {
            for p in (0..n).filter(|&p| p != q) {
                let theirs = parts(p);
                let total: usize = theirs.iter().map(Vec::len).sum();
                let at = format!("{n} ranks, round {round}, rank {q} reading rank {p}");
                assert_eq!(
                    reader.peer_round(p, round),
                    Some((label + p as u64, total as u64)),
                    "{at}"
                );
                // Placed by the count the reader has received, here a little off.
                let near = sent(p)[q] + 5;
                assert_eq!(reader.peer_sent_to_us(p, round, near), sent(p)[q], "{at}");
                for (i, part) in theirs.iter().enumerate() {
                    // An inline index keeps no one's words for the owner's own part.
                    let kept = !index_inline(reader.layout) || i != p;
                    let want = kept.then_some(&part[..]);
                    assert_eq!(reader.part(p, round, i), want, "{at}, part {i}");
                }
                assert_eq!(reader.peer_round(p, round + 1), None, "{at}");
            }
        }
    }

    #[test]
    fn every_reader_finds_the_label_its_count_and_its_part_whether_the_index_is_inline_or_not() {
        for size in [2, 3, 4] {
            let mut mem = Vec::new();
            let mut b = boards(size, &mut mem);
            assert_eq!(index_inline(size), size <= 2, "size {size}");
            for label in 1..=3 {
                round_on(&mut b, label);
            }
        }
    }

    #[test]
    fn at_two_ranks_what_a_round_publishes_lies_in_the_control_line_up_to_32_bytes() {
        let mut mem = Vec::new();
        let mut b = boards(2, &mut mem);
        for (len, inline) in [(0, true), (32, true), (33, false), (200, false), (7, true)] {
            let data: Vec<u8> = (0..len).map(|i| (i * 3 + len) as u8).collect();
            let in_ctl = |b: &Board, round, bytes: &[u8]| (bytes.as_ptr() as usize) < b.slot(0, round) as usize + LINE;
            // One part: the whole contribution, which every rank reads (its own too).
            let round = b[0].publish(5, &[&data], &[0, 40 + len as u64]);
            assert_eq!(b[1].publish(5, &[], &[0, 0]), round);
            assert_eq!(b[1].peer_round(0, round), Some((5, len as u64)));
            assert_eq!(b[1].peer_sent_to_us(0, round, 40 + len as u64), 40 + len as u64);
            assert_eq!(b[1].data(0, round, len), &data[..], "{len} bytes");
            assert_eq!(in_ctl(&b[1], round, b[1].data(0, round, len)), inline, "{len} bytes");
            assert_eq!(b[0].data(0, round, len), &data[..]);
            // A part per rank: only the other rank's is published, in the line where it fits.
            let own = [9u8; 100];
            let round = b[0].publish(6, &[&own, &data], &[0, 0]);
            assert_eq!(b[1].publish(6, &[], &[0, 0]), round);
            assert_eq!(b[1].peer_round(0, round), Some((6, 100 + len as u64)));
            let theirs = b[1].part(0, round, 1).expect("rank 1's part");
            assert_eq!(theirs, &data[..], "{len} bytes");
            assert_eq!(in_ctl(&b[1], round, theirs), inline, "{len} bytes");
        }
    }

    #[test]
    fn at_two_ranks_a_count_of_messages_kept_modulo_2_to_the_32_reads_back_whole() {
        let mut mem = Vec::new();
        let mut b = boards(2, &mut mem);
        let big = 5u64 << 32;
        for (sent, near) in [
            (big + 7, big + 3),
            (big + 3, big + 7),
            (big + 1, big - 2),
            (big - 2, big + 1),
            (9, 9),
        ] {
            let round = b[0].publish(1, &[&[1u8; 4]], &[0, sent]);
            assert_eq!(b[1].publish(1, &[], &[0, 0]), round);
            assert_eq!(
                b[1].peer_sent_to_us(0, round, near),
                sent,
                "sent {sent}, received {near}"
            );
        }
    }

    #[test]
    fn a_board_kept_by_fewer_ranks_keeps_its_layout() {
        let mut mem = Vec::new();
        let mut b = boards(3, &mut mem);
        round_on(&mut b, 1);
        // Ranks 0 and 2 go on as ranks 0 and 1 of a communicator of 2, on the areas laid out
        // for 3 (index after the control line), rounds numbered on.
        let mut it = b.into_iter();
        let (zero, _one, two) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let mut kept = vec![zero.keep(&[0, 2], 0), two.keep(&[0, 2], 1)];
        assert!(kept.iter().all(|k| k.layout == 3 && k.next_round() == 2));
        for label in 2..=4 {
            round_on(&mut kept, label);
        }
    }
}
