//! A single-producer single-consumer byte ring in memory shared by two ranks (two threads of
//! one process or two processes). `head` and `tail` only grow; their difference is the fill.
//!
//! Ordering: the producer copies bytes, then publishes `tail` with Release; the consumer loads
//! `tail` with Acquire before reading those bytes, so it never sees a byte before it is written.
//! The same pair in the other direction (`head`) tells the producer a region may be reused.
//!
//! A message of up to a line is followed by a line start. Each write carries the rest of one
//! message (a header and its payload), so a write that takes all it was given ends a message;
//! where the message was at most 64 bytes, the producer skips to the next line start before it publishes
//! `tail`, and the consumer does the same once it has read the message's last byte
//! (`end_message`). A stream of such messages then has each in one line instead of straddling
//! two: the consumer takes two lines from the producer's core (`tail`'s and the message's), not
//! three. Longer messages are not followed by a skip: it made 80-byte ones slower (measured:
//! docs/results/cpu.md, part 17).

use std::sync::atomic::{AtomicU64, Ordering};

/// Messages start on a line of this many bytes.
const LINE: u64 = 64;

fn line_up(pos: u64) -> u64 {
    (pos + LINE - 1) & !(LINE - 1)
}

/// The control block at the start of every ring. `tail` and `head` sit on separate cache lines
/// so producer and consumer do not bounce one line between them. For messages by reference
/// (pull.rs): `withdrawn`, on the producer's line, counts the references it took back;
/// `pulls`, on the consumer's, is 1 once the consumer can copy straight out of the producer's
/// memory.
#[repr(C, align(64))]
pub(crate) struct RingCtl {
    tail: AtomicU64,
    withdrawn: AtomicU64,
    _pad0: [u8; 48],
    head: AtomicU64,
    pulls: AtomicU64,
    _pad1: [u8; 48],
}

pub(crate) const CTL_BYTES: usize = std::mem::size_of::<RingCtl>();
const _: () = assert!(CTL_BYTES == 128);

/// One end of a ring. Which end is decided by which methods the owner calls; the transport
/// gives each end to exactly one rank.
pub(crate) struct RingEnd {
    ctl: *const RingCtl,
    data: *mut u8,
    cap: u64,
    /// Our own counter (tail for a producer, head for a consumer): only we write it.
    pos: u64,
    /// Where the message being written or read started (the skip after it depends on its
    /// length).
    start: u64,
    /// The peer's counter as we last loaded it (head for a producer, tail for a consumer).
    /// It only lags the real one, so it understates the room or the bytes there are; we load
    /// the real one only when it says too little. Loading it on every call would pull the
    /// peer's cache line across cores each time, though it changed nothing we need.
    seen: u64,
}

// SAFETY: the ring memory is shared on purpose; all cross-rank access goes through the atomic
// counters with Release/Acquire as described above, and each end is used by one thread at a time
// (it is owned by a backend behind a lock).
unsafe impl Send for RingEnd {}

impl RingEnd {
    /// # Safety
    /// `base` must point to `CTL_BYTES + cap` bytes of zero-initialised (or previously
    /// ring-formatted) shared memory, aligned to 64, that outlives the `RingEnd`; `cap` must be a
    /// power of two.
    pub(crate) unsafe fn new(base: *mut u8, cap: usize, producer: bool) -> RingEnd {
        let ctl = base as *const RingCtl;
        // SAFETY: the caller's contract: `base` points to live, 64-aligned, initialised ring
        // memory, which starts with the control block; its counters are atomics.
        let (pos, seen) = unsafe {
            if producer {
                ((*ctl).tail.load(Ordering::Relaxed), (*ctl).head.load(Ordering::Acquire))
            } else {
                let head = (*ctl).head.load(Ordering::Relaxed);
                (head, head)
            }
        };
        RingEnd {
            ctl,
            // SAFETY: the caller's contract: the memory is CTL_BYTES + cap long.
            data: unsafe { base.add(CTL_BYTES) },
            cap: cap as u64,
            pos,
            start: pos,
            seen,
        }
    }

    fn ctl(&self) -> &RingCtl {
        // SAFETY: `new`'s contract keeps the control block alive and aligned.
        unsafe { &*self.ctl }
    }

    /// Copies as much of `src` as fits; returns the number of bytes written.
    pub(crate) fn write(&mut self, src: &[u8]) -> usize {
        self.write_pair(src, &[])
    }

    /// Copies as much of `a` and then of `b` as fits (a header and its payload), published
    /// together: the consumer never wakes for a header whose payload is still being copied.
    /// Returns the bytes taken from both; where that is all of them, the message has ended (and
    /// where it was at most a line, the next one starts on a line).
    pub(crate) fn write_pair(&mut self, a: &[u8], b: &[u8]) -> usize {
        let want = (a.len() + b.len()) as u64;
        // After the skip to a line start, `pos` may be up to a line past `seen + cap`: no room
        // (the skipped bytes are never written, so none the consumer has not read is touched).
        let room = |seen: u64| self.cap.saturating_sub(self.pos - seen);
        if room(self.seen) < want {
            self.seen = self.ctl().head.load(Ordering::Acquire);
        }
        let free = room(self.seen) as usize;
        let na = a.len().min(free);
        let nb = if na == a.len() { b.len().min(free - na) } else { 0 };
        if na + nb == 0 {
            return 0;
        }
        self.copy_to(self.pos, &a[..na]);
        self.copy_to(self.pos + na as u64, &b[..nb]);
        self.pos += (na + nb) as u64;
        if na + nb == want as usize {
            self.pos = self.after_message();
        }
        self.ctl().tail.store(self.pos, Ordering::Release);
        na + nb
    }

    /// Producer: copies `src` to stream position `at`, within the room `seen` allows.
    fn copy_to(&self, at: u64, src: &[u8]) {
        let start = (at & (self.cap - 1)) as usize;
        let first = src.len().min(self.cap as usize - start);
        // SAFETY: [start, start+first) and [0, len-first) are inside the data region; the
        // caller keeps `at + len` within `seen + cap`, so the consumer has read these bytes
        // already (head acquired), and it does not read the new ones until `tail` is
        // published.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(start), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data, src.len() - first);
        }
    }

    /// Consumer: tells the producer that messages may come by reference (pull.rs). Release:
    /// a producer that sees it sees a consumer ready for them.
    pub(crate) fn offer_pulls(&self) {
        self.ctl().pulls.store(1, Ordering::Release);
    }

    /// Producer: whether the consumer takes messages by reference.
    pub(crate) fn peer_pulls(&self) -> bool {
        self.ctl().pulls.load(Ordering::Acquire) == 1
    }

    /// Producer: how many references it has taken back so far; a reference carries the count
    /// of when it was written.
    pub(crate) fn withdrawals(&self) -> u64 {
        self.ctl().withdrawn.load(Ordering::Relaxed)
    }

    /// Producer: takes back every reference in the ring not copied yet; its buffer is about to
    /// be freed. SeqCst, then a fence: a consumer whose copy overlapped the freeing sees the new
    /// count after its copy (the pattern of `withdrawn_since`).
    pub(crate) fn withdraw(&self) {
        let w = &self.ctl().withdrawn;
        w.store(w.load(Ordering::Relaxed) + 1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Consumer, after copying out of a reference written at withdrawal count `count`: whether
    /// the producer has taken it back since (then the bytes may be garbage).
    pub(crate) fn withdrawn_since(&self, count: u64) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.ctl().withdrawn.load(Ordering::SeqCst) != count
    }

    /// Producer: the stream position after the last byte written.
    pub(crate) fn written(&self) -> u64 {
        self.pos
    }

    /// Producer: the stream position up to which the consumer has read. Acquire: whatever the
    /// consumer did before it got there (a copy out of our memory) is done.
    pub(crate) fn taken(&self) -> u64 {
        self.ctl().head.load(Ordering::Acquire)
    }

    /// Consumer: copies the next `dst.len()` bytes without consuming them, if all are there.
    pub(crate) fn peek_exact(&self, dst: &mut [u8]) -> bool {
        let tail = self.ctl().tail.load(Ordering::Acquire);
        if tail - self.pos < dst.len() as u64 {
            return false;
        }
        for (i, d) in dst.iter_mut().enumerate() {
            let at = ((self.pos + i as u64) & (self.cap - 1)) as usize;
            // SAFETY: published bytes (tail acquired above) that the producer leaves alone
            // until we move `head` past them.
            *d = unsafe { *self.data.add(at) };
        }
        true
    }

    /// Consumer: consumes `n` bytes already looked at with `peek_exact` (where they end a
    /// message, `end_message` follows). Release: the producer that sees the new `head` sees
    /// everything we did before (pull.rs: the copy is done).
    pub(crate) fn skip(&mut self, n: usize) {
        self.pos += n as u64;
        self.ctl().head.store(self.pos, Ordering::Release);
    }

    /// Consumer: the message read has ended; where it was at most a line, the next starts on a
    /// line, as the producer's (whose write of this message's last byte published the skip too,
    /// so `pos` stays within `tail`). Call once per message, after its last byte. Release, as
    /// `read`.
    pub(crate) fn end_message(&mut self) {
        self.pos = self.after_message();
        self.ctl().head.store(self.pos, Ordering::Release);
    }

    /// Where the next message starts, `pos` being the end of one (either end): after a skip
    /// to a line start where the message was at most a line.
    fn after_message(&mut self) -> u64 {
        let next = if self.pos - self.start <= LINE {
            line_up(self.pos)
        } else {
            self.pos
        };
        self.start = next;
        next
    }

    /// Bytes the producer has published that we have not read yet.
    pub(crate) fn unread(&self) -> u64 {
        self.ctl().tail.load(Ordering::Acquire) - self.pos
    }

    /// Copies up to `dst.len()` available bytes of the message being read (`dst` no longer
    /// than the rest of it: past its end lies the skip to the next line); returns the number
    /// of bytes read.
    pub(crate) fn read(&mut self, dst: &mut [u8]) -> usize {
        // `seen` may trail `pos` after a `skip` past bytes `peek_exact` saw.
        if self.seen.saturating_sub(self.pos) < dst.len() as u64 {
            self.seen = self.ctl().tail.load(Ordering::Acquire);
        }
        let n = (dst.len() as u64).min(self.seen.saturating_sub(self.pos)) as usize;
        if n == 0 {
            return 0;
        }
        let start = (self.pos & (self.cap - 1)) as usize;
        let first = n.min(self.cap as usize - start);
        // SAFETY: the producer published these bytes with `tail` (acquired into `seen`) and
        // will not overwrite them until we publish `head`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(start), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data, dst.as_mut_ptr().add(first), n - first);
        }
        self.pos += n as u64;
        self.ctl().head.store(self.pos, Ordering::Release);
        n
    }
}

/// Bytes published in the ring at `base` and not yet read, for a consumer that has not made
/// its end (it has read nothing, so its counter is the one in the control block).
///
/// # Safety
/// `base` must point to a ring's live control block, 64-aligned (as for [`RingEnd::new`]).
pub(crate) unsafe fn unread_at(base: *const u8) -> u64 {
    // SAFETY: the caller's contract; the counters are atomics.
    let ctl = unsafe { &*(base as *const RingCtl) };
    ctl.tail.load(Ordering::Acquire) - ctl.head.load(Ordering::Acquire)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C, align(64))]
    struct Mem([u8; CTL_BYTES + 256]);
    const CAP: usize = 256;

    /// A zeroed ring of `CAP` bytes at `mem` and its two ends.
    fn ring(mem: &mut Mem) -> (RingEnd, RingEnd) {
        let base = mem.0.as_mut_ptr();
        // SAFETY: `mem` is zeroed, 64-aligned, holds the control block plus `CAP` bytes, and
        // outlives both ends (the callers drop them first).
        unsafe { (RingEnd::new(base, CAP, true), RingEnd::new(base, CAP, false)) }
    }

    #[test]
    fn messages_come_out_whole_and_in_order_across_wraparound() {
        let mut mem = Box::new(Mem([0; CTL_BYTES + CAP]));
        let (mut tx, mut rx) = ring(&mut mem);
        // Messages of 1-150 bytes, written in pieces where the ring is full and read in
        // pieces of 1-61 bytes.
        let msgs: Vec<Vec<u8>> = (0..300u32)
            .map(|m| (0..1 + m * 37 % 150).map(|i| (m * 13 + i * 7) as u8).collect())
            .collect();
        let (mut w, mut wpos) = (0, 0);
        let (mut r, mut rpos) = (0, 0);
        let mut got = [0u8; 150];
        let mut step = 0;
        while r < msgs.len() {
            step += 1;
            if w < msgs.len() {
                wpos += tx.write(&msgs[w][wpos..]);
                if wpos == msgs[w].len() {
                    if msgs[w].len() <= LINE as usize {
                        assert_eq!(tx.written() % LINE, 0, "a line start follows message {w}");
                    }
                    (w, wpos) = (w + 1, 0);
                }
            }
            let want = msgs[r].len().min(rpos + 1 + step * 23 % 61);
            rpos += rx.read(&mut got[rpos..want]);
            if rpos == msgs[r].len() {
                rx.end_message();
                assert_eq!(&got[..rpos], &msgs[r][..], "message {r}");
                (r, rpos) = (r + 1, 0);
            }
        }
        assert_eq!(rx.unread(), 0);
    }

    #[test]
    fn a_header_and_payload_of_64_bytes_take_one_line() {
        let mut mem = Box::new(Mem([0; CTL_BYTES + CAP]));
        let (mut tx, mut rx) = ring(&mut mem);
        assert_eq!(tx.write_pair(&[1; 48], &[2; 16]), 64);
        assert_eq!(tx.written(), 64);
        assert_eq!(tx.write_pair(&[3; 48], &[4; 8]), 56);
        assert_eq!(tx.written(), 128, "the next message starts on a line");
        let mut got = [0u8; 64];
        assert_eq!(rx.read(&mut got[..48]), 48);
        assert_eq!(rx.read(&mut got[48..]), 16);
        rx.end_message();
        assert_eq!((&got[..48], &got[48..]), (&[1; 48][..], &[2; 16][..]));
        assert_eq!(rx.read(&mut got[..56]), 56);
        assert_eq!(
            rx.unread(),
            8,
            "the skip to the next line is published with the message"
        );
        rx.end_message();
        assert_eq!((&got[..48], &got[48..56]), (&[3; 48][..], &[4; 8][..]));
        assert_eq!(rx.unread(), 0);
        assert_eq!(tx.taken(), 128);
    }

    #[test]
    fn a_pair_takes_its_second_part_only_after_the_first_and_never_more_than_the_room() {
        let mut mem = Box::new(Mem([0; CTL_BYTES + CAP]));
        let (mut tx, mut rx) = ring(&mut mem);
        let mut got = [0u8; 256];
        // A message of a line or less is followed by a skip to a line start, a longer one not.
        assert_eq!(tx.write(&[1; 40]), 40);
        assert_eq!(tx.written(), 64);
        assert_eq!(tx.write(&[2; 150]), 150);
        assert_eq!(tx.written(), 214);
        // 42 bytes of room: the pair goes in part, and no skip follows.
        assert_eq!(tx.write_pair(&[3; 30], &[4; 30]), 42);
        assert_eq!(tx.written(), 256);
        assert_eq!(rx.read(&mut got[..40]), 40);
        rx.end_message();
        assert_eq!(rx.read(&mut got[..150]), 150);
        rx.end_message();
        assert!(got[..150].iter().all(|&b| b == 2));
        // The rest of the pair ends it: 60 bytes in all, so a skip follows.
        assert_eq!(tx.write_pair(&[], &[4; 18]), 18);
        assert_eq!(tx.written(), 320);
        // Up to the end of the room (`head` is 214), then a short message whose skip runs past
        // it: no room is left, and the skipped bytes, which the reader has not read yet (the
        // pair's, a lap earlier), are not touched.
        assert_eq!(tx.write(&[5; 140]), 140);
        assert_eq!(tx.write(&[6; 10]), 10);
        assert_eq!(tx.written(), 512);
        assert_eq!(tx.write(&[7; 1]), 0);
        for (len, want) in [(60, None), (140, Some(5)), (10, Some(6))] {
            assert_eq!(rx.read(&mut got[..len]), len);
            rx.end_message();
            match want {
                Some(b) => assert!(got[..len].iter().all(|&x| x == b), "{len} bytes"),
                None => assert!(got[..30].iter().all(|&x| x == 3) && got[30..60].iter().all(|&x| x == 4)),
            }
        }
        assert_eq!(rx.unread(), 0);
        assert_eq!(tx.write(&[7; 1]), 1);
        assert_eq!(tx.written(), 576);
    }
}
