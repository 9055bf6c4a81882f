//! One rank's ordered byte streams with one peer (a shared-memory ring pair, a TCP
//! connection, or a loop to itself), and how a peer is found gone.

use super::liveness::ProcessWatch;
use super::pull::{self, REF_BYTES};
use super::ring::RingEnd;
use super::shm::{OwnerState, Segment};
use super::tcp::TcpLink;
use std::collections::VecDeque;
use std::sync::Arc;

/// One rank's view of its stream pair with one peer.
pub(crate) enum Link {
    /// A peer on this host whose rings have not been used yet: made on first use
    /// (`Transport::link`). A communicator of n ranks on one host has n² rings, of which its
    /// algorithms may use a few per rank; until then they cost neither memory nor set-up time.
    Pending,
    /// Boxed: the other variants are small.
    Shm(Box<ShmLink>),
    Tcp(TcpLink),
    SelfLoop(VecDeque<u8>),
}

pub(crate) struct ShmLink {
    pub(crate) tx: RingEnd,
    pub(crate) rx: RingEnd,
    /// The peer's process, when we may copy straight out of its memory (pull.rs).
    pub(crate) pull_from: Option<u32>,
    /// The peer's segment among `segments`.
    pub(crate) peer_slot: usize,
    /// Messages of at least this many bytes go by reference when the peer takes them.
    pub(crate) pull_bytes: usize,
    /// The segments the rings lie in (ours holds `rx`, the peer's `tx`), kept mapped while the
    /// ends live. (A stalled wait checks the peer's liveness through the transport,
    /// `Transport::check_peer`; `pull` looks at the peer's segment itself.)
    pub(crate) segments: Arc<PeerSegments>,
}

/// The shared-memory segments of a communicator's ranks on this host (`None` for the others),
/// mapped once per process and shared by its ranks, with a watch on every rank of another
/// process, opened at set-up while the peer is known to be alive.
pub(crate) struct PeerSegments {
    pub(crate) segs: Vec<Option<Arc<Segment>>>,
    pub(crate) watches: Vec<Option<ProcessWatch>>,
    /// The owner's process, where we may read its memory (pull.rs).
    pub(crate) readable: Vec<Option<u32>>,
}

impl PeerSegments {
    /// Whether the owner of segment `slot` (a rank on this host), which is rank `peer` of the
    /// communicator asking, is still there, as its segment and process say.
    pub(crate) fn check(&self, slot: usize, peer: usize) -> Result<(), PeerGone> {
        match &self.segs[slot] {
            Some(seg) => check_owner(peer, seg, self.watches[slot].as_ref()),
            None => Ok(()),
        }
    }
}

/// Why a link cannot make progress any more.
pub(crate) type Gone = String;

/// A pending link used directly instead of through its transport (a bug, reported as a lost link).
const NOT_MADE: &str = "the shared-memory link was never made";

/// A peer that can no longer take part: `rank` is the rank at the root of the failure (the
/// peer itself, or a rank the peer reports it lost).
pub(crate) struct PeerGone {
    pub rank: usize,
    pub reason: String,
}

impl Link {
    /// Writes as much of `src` as the stream takes now. `src` is the rest of one message (on
    /// shared memory a write that takes all of it ends the message: ring.rs), as for
    /// `write_pair`.
    pub(crate) fn write(&mut self, src: &[u8]) -> Result<usize, Gone> {
        match self {
            Link::Pending => Err(NOT_MADE.into()),
            Link::Shm(l) => Ok(l.tx.write(src)),
            Link::Tcp(l) => l.write(src),
            Link::SelfLoop(q) => {
                q.extend(src);
                Ok(src.len())
            }
        }
    }

    /// Writes as much of `a` and then of `b` as the stream takes now (a header and its
    /// payload: one system call on a plain TCP link, one publication in a ring); returns the
    /// bytes taken from both. `a` and `b` are the rest of one message: on shared memory a write
    /// that takes them all ends it (ring.rs).
    pub(crate) fn write_pair(&mut self, a: &[u8], b: &[u8]) -> Result<usize, Gone> {
        match self {
            Link::Tcp(l) => return l.write_pair(a, b),
            Link::Shm(l) => return Ok(l.tx.write_pair(a, b)),
            _ => {}
        }
        let n = self.write(a)?;
        if n < a.len() || b.is_empty() {
            return Ok(n);
        }
        Ok(n + self.write(b)?)
    }

    /// Writes as much of `msgs[pos..]` as the stream takes now, where `msgs` is whole messages
    /// of `each` bytes back to back (header-only messages): on TCP in one write, a stream having
    /// no message boundaries; on shared memory a message at a time, as a write that completes a
    /// message ends it there (ring.rs). Returns the bytes written.
    pub(crate) fn write_messages(&mut self, msgs: &[u8], each: usize, pos: usize) -> Result<usize, Gone> {
        if !matches!(self, Link::Shm(_)) {
            return self.write(&msgs[pos..]);
        }
        let mut at = pos;
        while at < msgs.len() {
            let end = (at / each + 1) * each;
            let n = self.write(&msgs[at..end])?;
            at += n;
            if at < end {
                break;
            }
        }
        Ok(at - pos)
    }

    /// Whether the link moved bytes of its own since last asked, though the caller's last
    /// calls moved none: a sealed link sends and receives records in parts, and a waiter that
    /// saw no progress would back off while a record is still on its way.
    pub(crate) fn take_progress(&mut self) -> bool {
        match self {
            Link::Tcp(l) => l.take_progress(),
            _ => false,
        }
    }

    /// Reads what is available now, up to `dst.len()`: no more than the rest of the message
    /// being read (on shared memory the skip to the next line follows it; `end_message`).
    pub(crate) fn read(&mut self, dst: &mut [u8]) -> Result<usize, Gone> {
        match self {
            Link::Pending => Err(NOT_MADE.into()),
            Link::Shm(l) => Ok(l.rx.read(dst)),
            Link::Tcp(l) => l.read(dst),
            Link::SelfLoop(q) => {
                // Two slice copies, not a byte at a time: a byte loop over the queue was a
                // seventh of a send/recv to oneself. Not std's `Read` for the queue: it stops
                // at the end of the front slice, a short read where more is there.
                let n = dst.len().min(q.len());
                let (front, back) = q.as_slices();
                let from_front = n.min(front.len());
                dst[..from_front].copy_from_slice(&front[..from_front]);
                dst[from_front..n].copy_from_slice(&back[..n - from_front]);
                q.drain(..n);
                Ok(n)
            }
        }
    }

    /// Whether a message of `len` bytes goes by reference: a shared-memory link whose peer
    /// takes references, for a message at least the link's threshold (pull.rs).
    pub(crate) fn sends_by_reference(&self, len: usize) -> bool {
        matches!(self, Link::Shm(l) if len >= l.pull_bytes && l.tx.peer_pulls())
    }

    /// Whether the payload of a message of `len` bytes goes on the link's second connection
    /// (a plain TCP link's dialler, for a message at least the link's threshold: tcp.rs).
    pub(crate) fn sends_in_bulk(&self, len: usize) -> bool {
        matches!(self, Link::Tcp(l) if l.sends_in_bulk(len))
    }

    /// Writes as much of a payload as the link's second connection takes now (`sends_in_bulk`
    /// said yes).
    pub(crate) fn write_bulk(&mut self, src: &[u8]) -> Result<usize, Gone> {
        match self {
            Link::Tcp(l) => l.write_bulk(src),
            _ => Err("this link has no second connection".into()),
        }
    }

    /// Reads what has arrived of a payload the peer sent on the link's second connection.
    pub(crate) fn read_bulk(&mut self, dst: &mut [u8]) -> Result<usize, Gone> {
        match self {
            Link::Tcp(l) => l.read_bulk(dst),
            _ => Err("a payload on a second connection arrived on a link that has none".into()),
        }
    }

    /// The stream position after everything written so far (shared memory only; 0 elsewhere).
    pub(crate) fn written(&self) -> u64 {
        match self {
            Link::Shm(l) => l.tx.written(),
            _ => 0,
        }
    }

    /// Whether the peer has read everything up to `position` of what we wrote (shared memory;
    /// elsewhere always). A reference read that far has been copied in.
    pub(crate) fn taken(&self, position: u64) -> bool {
        match self {
            Link::Shm(l) => l.tx.taken() >= position,
            _ => true,
        }
    }

    /// The reference to `data` for this link's stream (shared memory only: `sends_by_reference`
    /// said yes).
    pub(crate) fn reference_to(&self, data: &[u8]) -> [u8; REF_BYTES] {
        let withdrawals = match self {
            Link::Shm(l) => l.tx.withdrawals(),
            _ => 0,
        };
        pull::Reference::to(data, withdrawals).encode()
    }

    /// Takes back every reference we wrote that the peer has not copied yet: their buffers
    /// are about to be freed (pull.rs).
    pub(crate) fn withdraw(&self) {
        if let Link::Shm(l) = self {
            l.tx.withdraw();
        }
    }

    /// Takes in a message sent by reference: its reference from the stream, then its bytes
    /// from the sender's memory into `dst`, and only then consumes the reference, which frees
    /// the sender's buffer. `Ok(false)`: the reference has not fully arrived yet.
    pub(crate) fn pull(&mut self, dst: &mut [u8]) -> Result<bool, Gone> {
        let Link::Shm(l) = self else {
            return Err("a message by reference arrived on a link that cannot take one".into());
        };
        let Some(pid) = l.pull_from else {
            return Err("a message by reference arrived, but this rank cannot read the peer's memory".into());
        };
        let mut raw = [0u8; REF_BYTES];
        if !l.rx.peek_exact(&mut raw) {
            return Ok(false);
        }
        let r = pull::Reference::decode(&raw);
        pull::copy_in(pid, &r, dst)?;
        // The bytes count only if the sender still waited for them (pull.rs).
        if l.rx.withdrawn_since(r.withdrawals) {
            return Err("it withdrew its message (its operation failed) while this rank copied it".into());
        }
        if let Some(w) = &l.segments.watches[l.peer_slot] {
            if !w.is_alive() {
                return Err(format!("process {} exited while this rank copied its message", w.pid()));
            }
        }
        l.rx.skip(REF_BYTES);
        Ok(true)
    }

    /// The message being read has ended (its last byte read): on shared memory the next one
    /// starts on a cache line (ring.rs). Call once per message, right after its last byte.
    pub(crate) fn end_message(&mut self) {
        if let Link::Shm(l) = self {
            l.rx.end_message();
        }
    }

    /// Has the peer sent bytes we have not read? Only shared-memory links can tell without
    /// reading; the others say no.
    pub(crate) fn has_unread(&self) -> bool {
        matches!(self, Link::Shm(l) if l.rx.unread() > 0)
    }
}

/// The state of a peer's segment and process, as an error naming the root rank.
pub(crate) fn check_owner(peer: usize, seg: &Segment, watch: Option<&ProcessWatch>) -> Result<(), PeerGone> {
    let gone = |rank, reason: String| Err(PeerGone { rank, reason });
    match seg.state() {
        OwnerState::Aborted => return gone(peer, "peer aborted".into()),
        OwnerState::Closed => return gone(peer, "peer closed its communicator or window".into()),
        OwnerState::Lost(r) => return gone(r, format!("rank {peer} failed after losing rank {r}")),
        OwnerState::Live => {}
    }
    match watch {
        Some(w) if !w.is_alive() => gone(peer, format!("process {} exited", w.pid())),
        _ => Ok(()),
    }
}

/// How a host thread waits for a peer: spin `spin` rounds, then yield, then sleep, because
/// ranks often outnumber cores (tests, one GPU shared). The collectives' waits spin none where
/// they do (crowding.rs); others pass `SPIN_ROUNDS`. `idle` counts the rounds waited so far.
pub(crate) fn back_off(idle: u32, spin: u32) {
    if idle < spin {
        std::hint::spin_loop();
    } else if idle < 2048 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes written to oneself come back in order and whole, also where the queue has wrapped
    /// and holds them in two pieces.
    #[test]
    fn a_loop_to_oneself_gives_back_its_bytes_in_order_across_the_queues_wrap() {
        let mut link = Link::SelfLoop(VecDeque::with_capacity(16));
        let (mut next_in, mut next_out) = (0u8, 0u8);
        let mut wrapped = false;
        for round in 0..200usize {
            let batch: Vec<u8> = (0..1 + round % 13).map(|i| next_in.wrapping_add(i as u8)).collect();
            next_in = next_in.wrapping_add(batch.len() as u8);
            assert_eq!(
                link.write_pair(&batch[..batch.len() / 2], &batch[batch.len() / 2..]),
                Ok(batch.len())
            );
            if let Link::SelfLoop(q) = &link {
                wrapped |= !q.as_slices().1.is_empty();
            }
            // Read a little less than was written, so the queue's start moves round it.
            let mut got = vec![0u8; 1 + round % 11];
            let n = link.read(&mut got).unwrap();
            for &b in &got[..n] {
                assert_eq!(b, next_out, "round {round}");
                next_out = next_out.wrapping_add(1);
            }
        }
        let mut rest = vec![0u8; 4096];
        let n = link.read(&mut rest).unwrap();
        for &b in &rest[..n] {
            assert_eq!(b, next_out);
            next_out = next_out.wrapping_add(1);
        }
        assert_eq!(next_out, next_in, "every byte came back");
        assert!(wrapped, "the test must reach a queue held in two pieces");
    }
}
