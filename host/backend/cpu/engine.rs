//! The progress engine: framed messages over the links, all pending transfers of one step
//! advanced together so that no order of sends and receives can deadlock.
//!
//! Every message starts with a 32-byte header: magic, operation, dtype, reduce op, a sequence
//! number per ordered rank pair, and the payload length. The receiver knows what it expects;
//! any difference means the ranks called different operations (or the same one with different
//! arguments) and becomes `Error::Mismatch` instead of corrupted data.

use crate::error::{Error, Result};
use crate::transport::{back_off, Link, Transport};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0xFE44_0C01;
pub(crate) const HEADER_BYTES: usize = 32;
/// How often a stalled engine looks at deadlines, abort flags and peer liveness.
const CHECK_EVERY: Duration = Duration::from_millis(5);

/// What a message claims to be. Equal tags on both sides mean matching calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tag {
    pub op: u8,
    pub dtype: u8,
    pub redop: u8,
    pub nbytes: u64,
}

fn op_name(code: u8) -> &'static str {
    match code {
        1 => "all_reduce",
        2 => "reduce",
        3 => "broadcast",
        4 => "all_gather",
        5 => "reduce_scatter",
        6 => "all_to_all",
        7 => "scatter",
        8 => "gather",
        9 => "barrier",
        10 => "send/recv",
        _ => "unknown",
    }
}

impl Tag {
    /// The tag in one word, as a shared-memory round records it (the length travels apart).
    pub(crate) fn label(&self) -> u64 {
        self.op as u64 | (self.dtype as u64) << 8 | (self.redop as u64) << 16
    }

    pub(crate) fn from_label(label: u64, nbytes: u64) -> Tag {
        Tag {
            op: label as u8,
            dtype: (label >> 8) as u8,
            redop: (label >> 16) as u8,
            nbytes,
        }
    }

    pub(crate) fn describe(&self) -> String {
        let dtype = crate::dtype::DType::from_code(self.dtype).map_or("-", |d| d.name());
        format!(
            "{} ({} bytes, dtype {dtype}, reduce code {})",
            op_name(self.op),
            self.nbytes,
            self.redop
        )
    }
}

fn encode(tag: Tag, seq: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = tag.op;
    h[5] = tag.dtype;
    h[6] = tag.redop;
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h[16..24].copy_from_slice(&tag.nbytes.to_le_bytes());
    h
}

fn decode(h: &[u8; HEADER_BYTES]) -> Option<(Tag, u64)> {
    let word = |r: std::ops::Range<usize>| h[r].iter().rev().fold(0u64, |a, &b| (a << 8) | b as u64);
    if word(0..4) as u32 != MAGIC {
        return None;
    }
    Some((
        Tag {
            op: h[4],
            dtype: h[5],
            redop: h[6],
            nbytes: word(16..24),
        },
        word(8..16),
    ))
}

/// One pending message.
pub(crate) enum Xfer<'b> {
    Send {
        peer: usize,
        hdr: [u8; HEADER_BYTES],
        hpos: usize,
        data: &'b [u8],
        pos: usize,
    },
    Recv {
        peer: usize,
        expect: Tag,
        seq: u64,
        hdr: [u8; HEADER_BYTES],
        hpos: usize,
        data: &'b mut [u8],
        pos: usize,
    },
}

impl Xfer<'_> {
    fn peer(&self) -> usize {
        match self {
            Xfer::Send { peer, .. } | Xfer::Recv { peer, .. } => *peer,
        }
    }

    fn done(&self) -> bool {
        match self {
            Xfer::Send { hpos, data, pos, .. } => *hpos == HEADER_BYTES && *pos == data.len(),
            Xfer::Recv { hpos, data, pos, .. } => *hpos == HEADER_BYTES && *pos == data.len(),
        }
    }
}

/// Paces a host wait: backs off while nothing happens, and says when a stalled wait should
/// look at deadlines, abort flags and peers.
pub(crate) struct Pacer {
    idle: u32,
    next_check: Instant,
}

impl Pacer {
    pub(crate) fn new() -> Pacer {
        Pacer {
            idle: 0,
            next_check: Instant::now() + CHECK_EVERY,
        }
    }

    pub(crate) fn progressed(&mut self) {
        self.idle = 0;
    }

    /// Backs off once; returns the time when a stall check is due.
    pub(crate) fn stalled(&mut self) -> Option<Instant> {
        self.idle = self.idle.saturating_add(1);
        back_off(self.idle);
        if self.idle < 64 {
            return None;
        }
        let now = Instant::now();
        if now < self.next_check {
            return None;
        }
        self.next_check = now + CHECK_EVERY;
        Some(now)
    }
}

/// The deadline and abort flag of the operation being run.
pub(crate) struct OpCtx<'a> {
    pub op: &'static str,
    pub deadline: Instant,
    pub timeout: Duration,
    pub abort: &'a AtomicBool,
}

impl OpCtx<'_> {
    /// Fails if the operation was aborted or ran out of time; `peer` is the one still awaited.
    pub(crate) fn check(&self, now: Instant, peer: impl FnOnce() -> Option<usize>) -> Result<()> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::Closed {
                op: self.op,
                state: "aborted",
            });
        }
        if now >= self.deadline {
            return Err(Error::Timeout {
                op: self.op,
                peer: peer(),
                after: self.timeout,
            });
        }
        Ok(())
    }
}

pub(crate) struct Engine {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) transport: Transport,
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    /// Per-peer "already advanced a message this sweep" stamps: messages to one peer must go
    /// out (and come in) in the order they were queued.
    tx_stamp: Vec<u64>,
    rx_stamp: Vec<u64>,
    sweep: u64,
}

impl Engine {
    pub(crate) fn new(rank: usize, size: usize, transport: Transport) -> Engine {
        Engine {
            rank,
            size,
            transport,
            send_seq: vec![0; size],
            recv_seq: vec![0; size],
            tx_stamp: vec![0; size],
            rx_stamp: vec![0; size],
            sweep: 0,
        }
    }

    /// Publishes our contribution to the next shared-memory round (see transport/board.rs),
    /// with the count of framed messages sent to each peer so far (all complete between
    /// operations). The caller has waited for the slot to be free.
    pub(crate) fn publish_round(&mut self, label: u64, parts: &[&[u8]]) -> u64 {
        let board = self.transport.board.as_mut().expect("callers check for a board");
        board.publish(label, parts, &self.send_seq)
    }

    /// Framed messages received from `peer` so far.
    pub(crate) fn received_from(&self, peer: usize) -> u64 {
        self.recv_seq[peer]
    }

    /// Queues a message to `peer`. Messages to one peer arrive in the order they are created.
    pub(crate) fn send<'b>(&mut self, peer: usize, tag: Tag, data: &'b [u8]) -> Xfer<'b> {
        let seq = self.send_seq[peer];
        self.send_seq[peer] += 1;
        Xfer::Send {
            peer,
            hdr: encode(
                Tag {
                    nbytes: data.len() as u64,
                    ..tag
                },
                seq,
            ),
            hpos: 0,
            data,
            pos: 0,
        }
    }

    /// Expects a message from `peer` of exactly `data.len()` bytes.
    pub(crate) fn recv<'b>(&mut self, peer: usize, tag: Tag, data: &'b mut [u8]) -> Xfer<'b> {
        let seq = self.recv_seq[peer];
        self.recv_seq[peer] += 1;
        let expect = Tag {
            nbytes: data.len() as u64,
            ..tag
        };
        Xfer::Recv {
            peer,
            expect,
            seq,
            hdr: [0; HEADER_BYTES],
            hpos: 0,
            data,
            pos: 0,
        }
    }

    /// Advances one message as far as its link allows; returns whether anything moved.
    fn step(link: &mut Link, x: &mut Xfer<'_>, op: &'static str) -> Result<bool> {
        let lost = |peer: usize, reason: String| Error::PeerLost { op, peer, reason };
        match x {
            Xfer::Send {
                peer,
                hdr,
                hpos,
                data,
                pos,
            } => {
                let mut moved = false;
                if *hpos < HEADER_BYTES {
                    let n = link.write(&hdr[*hpos..]).map_err(|r| lost(*peer, r))?;
                    *hpos += n;
                    moved |= n > 0;
                    if *hpos < HEADER_BYTES {
                        return Ok(moved);
                    }
                }
                if *pos < data.len() {
                    let n = link.write(&data[*pos..]).map_err(|r| lost(*peer, r))?;
                    *pos += n;
                    moved |= n > 0;
                }
                Ok(moved)
            }
            Xfer::Recv {
                peer,
                expect,
                seq,
                hdr,
                hpos,
                data,
                pos,
            } => {
                let mut moved = false;
                if *hpos < HEADER_BYTES {
                    let n = link.read(&mut hdr[*hpos..]).map_err(|r| lost(*peer, r))?;
                    *hpos += n;
                    moved |= n > 0;
                    if *hpos < HEADER_BYTES {
                        return Ok(moved);
                    }
                    check_header(op, *peer, hdr, *expect, *seq)?;
                }
                if *pos < data.len() {
                    let n = link.read(&mut data[*pos..]).map_err(|r| lost(*peer, r))?;
                    *pos += n;
                    moved |= n > 0;
                }
                Ok(moved)
            }
        }
    }

    /// One pass over the pending messages; returns (all done, anything moved).
    fn sweep(&mut self, ctx: &OpCtx<'_>, xfers: &mut [Xfer<'_>]) -> Result<(bool, bool)> {
        self.sweep += 1;
        let (mut all_done, mut moved) = (true, false);
        for x in xfers.iter_mut() {
            if x.done() {
                continue;
            }
            all_done = false;
            let peer = x.peer();
            let stamp = match x {
                Xfer::Send { .. } => &mut self.tx_stamp[peer],
                Xfer::Recv { .. } => &mut self.rx_stamp[peer],
            };
            if *stamp == self.sweep {
                continue; // an earlier message to/from this peer is still in flight
            }
            *stamp = self.sweep;
            moved |= Self::step(&mut self.transport.links[peer], x, ctx.op)?;
            if !x.done() {
                continue;
            }
            // A finished message frees its peer for the next one in this same sweep.
            match x {
                Xfer::Send { .. } => self.tx_stamp[peer] = 0,
                Xfer::Recv { .. } => self.rx_stamp[peer] = 0,
            }
        }
        Ok((all_done, moved))
    }

    /// Runs every message to completion, or fails with the reason and the peer.
    pub(crate) fn exchange(&mut self, ctx: &OpCtx<'_>, xfers: &mut [Xfer<'_>]) -> Result<()> {
        let mut pace = Pacer::new();
        loop {
            let (done, moved) = self.sweep(ctx, xfers)?;
            if done {
                return Ok(());
            }
            if moved {
                pace.progressed();
            } else if let Some(now) = pace.stalled() {
                self.check_stalled(ctx, xfers, now)?;
            }
        }
    }

    fn check_stalled(&mut self, ctx: &OpCtx<'_>, xfers: &mut [Xfer<'_>], now: Instant) -> Result<()> {
        ctx.check(now, || xfers.iter().find(|x| !x.done()).map(|x| x.peer()))?;
        let gone = xfers.iter().filter(|x| !x.done()).find_map(|x| {
            let p = x.peer();
            self.transport.links[p].check_peer(p).err().map(|g| (p, g))
        });
        if let Some((peer, g)) = gone {
            // The peer may have written its last bytes just before leaving: its state store is a
            // Release, our read an Acquire, so one more sweep sees everything it sent.
            self.sweep(ctx, xfers)?;
            if xfers.iter().any(|x| !x.done() && x.peer() == peer) {
                return Err(Error::PeerLost {
                    op: ctx.op,
                    peer: g.rank,
                    reason: g.reason,
                });
            }
        }
        // A peer that has started a shared-memory round we have not reached is running another
        // operation. It published the round after its last message to us, so one more sweep
        // first takes in anything it sent for this one.
        let Some(x) = &self.transport.board else { return Ok(()) };
        let ahead = xfers
            .iter()
            .filter(|t| !t.done())
            .map(|t| t.peer())
            .find(|&p| x.peer_latest(p) >= x.next_round());
        if let Some(peer) = ahead {
            self.sweep(ctx, xfers)?;
            if xfers.iter().any(|t| !t.done() && t.peer() == peer) {
                return Err(Error::Mismatch {
                    op: ctx.op,
                    peer,
                    detail: "it entered a shared-memory collective (all_reduce, all_gather, all_to_all \
                             or barrier of a small size) while this rank waits for its message"
                        .into(),
                });
            }
        }
        Ok(())
    }
}

fn check_header(op: &'static str, peer: usize, hdr: &[u8; HEADER_BYTES], expect: Tag, seq: u64) -> Result<()> {
    let mismatch = |detail: String| Error::Mismatch { op, peer, detail };
    let Some((got, got_seq)) = decode(hdr) else {
        return Err(mismatch(
            "received bytes that are not a ferrocomm message header".into(),
        ));
    };
    if got != expect {
        return Err(mismatch(format!(
            "it sent {}, this rank expected {}",
            got.describe(),
            expect.describe()
        )));
    }
    if got_seq != seq {
        return Err(mismatch(format!(
            "message {got_seq} arrived where message {seq} was expected"
        )));
    }
    Ok(())
}
