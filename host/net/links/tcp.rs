//! TCP links between ranks on different hosts: one non-blocking stream per peer pair, and on
//! plain links a second one for the dialler's large payloads.
//!
//! Why two: a TCP socket is one lock for both directions. Where two ranks send each other
//! large messages at once over one connection, each rank's send holds the socket while the
//! peer's data arrives, so the kernel queues that data to the socket's backlog and the sender
//! processes it in its own send call: the two directions take turns. Measured on loopback
//! (2-core guest, two processes exchanging through non-blocking sockets; docs/results/cpu.md,
//! "Two connections per TCP link"), 1 MiB took 260-280 us each way over one connection and
//! 135-150 us over one connection per direction. One connection per direction costs small
//! messages, though: their acknowledgements no longer ride on the other direction's data, and
//! 8 bytes took 8.5 us against 6.3. So the link keeps one connection for headers and small
//! payloads both ways, and the lower rank's large payloads, and the higher rank (the dialler)
//! sends the payloads of its large messages on the second: an exchange of large messages then
//! flows one way on each connection. A header says where its payload is (header.rs, `BULK`).

use super::nonblocking;
use super::sealed::Sealed;
use crate::bootstrap::gate::{read_exact_by, Gate, Judgement, Limits, Reply};
use crate::bootstrap::seal::{session_keys, SessionKeys};
use crate::bootstrap::{self, NONCE_BYTES, PROOF_BYTES};
use crate::contracts::error::{Error, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const LINK_MAGIC: &[u8; 4] = b"FCL2";

/// The most one write of a plain link takes. Smaller writes let the sender read between them:
/// in the exchange above, writes of at most 256 KiB took 4 MiB in 0.6 ms and 16 MiB in 4.0-4.4
/// ms, against 0.7-1.0 and 5.1-6.3 ms for writes of whole messages.
const WRITE_MAX: usize = 256 << 10;

/// Reads shorter than this go through the link's read buffer: a message's header and a small
/// payload then cost one system call, not one each (and the reads that find nothing, one per
/// look rather than one per part).
const READ_BUFFER: usize = 4096;

pub(crate) struct TcpLink {
    stream: TcpStream,
    closed: Option<String>,
    /// Present where the link's traffic is sealed (it leaves the host, or the user asked).
    sealed: Option<Box<Sealed>>,
    /// Bytes read ahead of the caller (plain links; made at the first short read): `buffered`
    /// is the unread range.
    read_ahead: Vec<u8>,
    buffered: std::ops::Range<usize>,
    /// The link's second connection, where it has one (see the module's comment).
    bulk: Option<Bulk>,
}

/// One end of a link's second connection.
enum Bulk {
    /// The dialler's end: the payloads of its messages of at least `from` bytes go here.
    Out { stream: TcpStream, from: usize },
    /// The listener's end: it reads those payloads here.
    In(TcpStream),
}

impl TcpLink {
    /// A link over `stream`, sealed with its handshake's keys where `seal`.
    pub(crate) fn new(h: Handshaken) -> Result<TcpLink> {
        Ok(TcpLink {
            stream: for_link(h.stream)?,
            closed: None,
            sealed: h.sealed.then(|| Box::new(Sealed::new(&h.keys))),
            read_ahead: Vec::new(),
            buffered: 0..0,
            bulk: None,
        })
    }

    /// Adds the link's second connection (`bulk`, made by the dialler): on the dialler,
    /// `Some(from)`, the size from which its payloads go there (`usize::MAX`: never); on the
    /// listener, `None`.
    pub(crate) fn with_bulk(mut self, bulk: Handshaken, from: Option<usize>) -> Result<TcpLink> {
        let stream = for_link(bulk.stream)?;
        self.bulk = Some(match from {
            Some(from) => Bulk::Out { stream, from },
            None => Bulk::In(stream),
        });
        Ok(self)
    }

    /// Whether the payload of a message of `len` bytes goes on the second connection.
    pub(crate) fn sends_in_bulk(&self, len: usize) -> bool {
        matches!(&self.bulk, Some(Bulk::Out { from, .. }) if len >= *from)
    }

    /// Writes as much of `src` (a payload whose header said `BULK`) to the second connection
    /// as it takes now, at most `WRITE_MAX`.
    pub(crate) fn write_bulk(&mut self, src: &[u8]) -> std::result::Result<usize, String> {
        let Some(Bulk::Out { stream, .. }) = &mut self.bulk else {
            return Err(self.close("this end of the link sends no payload on a second connection".into()));
        };
        let r = nonblocking::sent(stream.write(&src[..src.len().min(WRITE_MAX)]));
        r.map_err(|why| self.close(why))
    }

    /// Reads what has arrived of a payload the peer sent on the second connection.
    pub(crate) fn read_bulk(&mut self, dst: &mut [u8]) -> std::result::Result<usize, String> {
        if dst.is_empty() {
            return Ok(0);
        }
        let Some(Bulk::In(stream)) = &mut self.bulk else {
            // Only a peer that breaks the protocol sends one.
            return Err(self.close("the peer sent a payload on a second connection this link does not have".into()));
        };
        let r = nonblocking::received(stream.read(dst));
        r.map_err(|why| self.close(why))
    }

    /// Writes as much of `a` and then `b` as the stream takes now, in one system call on a
    /// plain link (a header and its payload leave in one segment); returns the bytes taken.
    pub(crate) fn write_pair(&mut self, a: &[u8], b: &[u8]) -> std::result::Result<usize, String> {
        if self.sealed.is_some() {
            let n = self.write(a)?;
            return if n < a.len() || b.is_empty() {
                Ok(n)
            } else {
                Ok(n + self.write(b)?)
            };
        }
        let parts = [
            std::io::IoSlice::new(a),
            std::io::IoSlice::new(&b[..b.len().min(WRITE_MAX)]),
        ];
        nonblocking::sent(self.stream.write_vectored(&parts)).map_err(|why| self.close(why))
    }

    /// Bytes written, or the reason the connection is gone.
    pub(crate) fn write(&mut self, src: &[u8]) -> std::result::Result<usize, String> {
        if let Some(s) = &mut self.sealed {
            let r = s.write(&self.stream, src);
            return r.map_err(|why| self.close(why));
        }
        let src = &src[..src.len().min(WRITE_MAX)];
        nonblocking::sent(self.stream.write(src)).map_err(|why| self.close(why))
    }

    pub(crate) fn read(&mut self, dst: &mut [u8]) -> std::result::Result<usize, String> {
        if dst.is_empty() {
            return Ok(0);
        }
        if let Some(s) = &mut self.sealed {
            let r = s.read(&self.stream, dst);
            return r.map_err(|why| self.close(why));
        }
        if self.buffered.is_empty() {
            // Long reads go straight into the caller's buffer; short ones fill the read-ahead.
            if dst.len() >= READ_BUFFER {
                return nonblocking::received(self.stream.read(dst)).map_err(|why| self.close(why));
            }
            if self.read_ahead.is_empty() {
                self.read_ahead = vec![0; READ_BUFFER];
            }
            let got = nonblocking::received(self.stream.read(&mut self.read_ahead));
            self.buffered = 0..got.map_err(|why| self.close(why))?;
        }
        let n = dst.len().min(self.buffered.len());
        let from = self.buffered.start;
        dst[..n].copy_from_slice(&self.read_ahead[from..from + n]);
        self.buffered.start += n;
        Ok(n)
    }

    /// See [`Link::take_progress`](super::Link::take_progress).
    pub(crate) fn take_progress(&mut self) -> bool {
        self.sealed.as_mut().is_some_and(|s| std::mem::take(&mut s.progressed))
    }

    fn close(&mut self, why: String) -> String {
        self.closed.get_or_insert(why).clone()
    }

    /// Handles on the link's connections (to shut them down while the link is in use).
    pub(crate) fn try_clone_streams(&self) -> Vec<TcpStream> {
        let bulk = match &self.bulk {
            Some(Bulk::Out { stream, .. } | Bulk::In(stream)) => Some(stream),
            None => None,
        };
        std::iter::once(&self.stream)
            .chain(bulk)
            .filter_map(|s| s.try_clone().ok())
            .collect()
    }
}

/// The dialler's answer to a listener's greeting: its rank, its proof, its own nonce.
const HELLO_BYTES: usize = 4 + PROOF_BYTES + NONCE_BYTES;

/// Each handshake, greeting to verdict, ends by this long after the connection was accepted
/// (on the listener) or made (on the dialler), even when the set-up's deadline is later.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// How many connections may be proving the secret to one listener at once (and from one
/// address). A listener expects at most one per peer rank; past the cap the oldest goes, and
/// a real peer dropped that way dials again.
const UNPROVEN: Limits = Limits {
    handshake: HANDSHAKE,
    pending: 256,
    per_source: 256,
};

mod verdict {
    pub const REFUSED: u8 = 0;
    pub const ADMITTED: u8 = 1;
    /// A rank the listener already has a link from, or expects none from.
    pub const UNEXPECTED: u8 = 2;
    /// The two sides disagree on sealing the link (FERROCOMM_ENCRYPT differs).
    pub const SEALING_DIFFERS: u8 = 3;
}

/// A connection that passed the handshake: the stream, the keys both sides derived from it,
/// and whether the two agreed to seal its traffic.
#[derive(Debug)]
pub(crate) struct Handshaken {
    pub stream: TcpStream,
    pub keys: SessionKeys,
    pub sealed: bool,
    pub lane: Lane,
}

/// The dialler's rank field carries this bit when it will seal the link.
const SEAL_BIT: u32 = 1 << 31;
/// The dialler's rank field carries this bit when the connection is a link's second one.
const BULK_BIT: u32 = 1 << 30;

/// Which of a link's connections a handshake makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    /// The link's connection (headers, small payloads, everything on a sealed link).
    Main,
    /// The second connection of a plain link: the dialler's large payloads.
    Bulk,
}

impl Lane {
    /// 0 for the first connection, 1 for the second: in a proof, and per rank on a listener.
    fn index(self) -> usize {
        (self == Lane::Bulk) as usize
    }
}

/// A handshaken stream set up for a link: no Nagle delay, non-blocking.
fn for_link(stream: TcpStream) -> Result<TcpStream> {
    stream.set_nodelay(true).map_err(|e| Error::io("set TCP_NODELAY", e))?;
    stream
        .set_nonblocking(true)
        .map_err(|e| Error::io("set O_NONBLOCK", e))?;
    Ok(stream)
}

/// What each side's proof covers besides the nonce: its role, its rank, whether it seals and
/// which connection it makes, so a proof made as one rank, by the other side, for the other
/// mode or for the other connection is worth nothing.
fn role(who: &[u8], rank: usize, seal: bool, lane: Lane) -> Vec<u8> {
    let mut r = who.to_vec();
    r.extend_from_slice(&(rank as u32).to_le_bytes());
    r.push(seal as u8);
    r.push(lane.index() as u8);
    r
}

/// Connects to `peer`'s listener at `addr` and proves, as `rank`, that we know `secret`; the
/// listener proves it in turn (so we never send data to an impostor). A listener that drops us
/// during the handshake (it sheds floods of unauthenticated connections) is dialled again until
/// `deadline`, then `Error::Timeout` names `peer`. `seal` says whether we will seal the link's
/// traffic; the listener must want the same. `lane`: which of the link's connections this is.
pub(crate) fn dial(
    (rank, peer): (usize, usize),
    addr: SocketAddr,
    secret: &[u8],
    (seal, lane): (bool, Lane),
    deadline: Instant,
) -> Result<Handshaken> {
    const OP: &str = "link handshake";
    let started = Instant::now();
    loop {
        // Made before connecting: a failing generator ends the attempts at once.
        let nonce = bootstrap::nonce()?;
        let attempt = match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(s) => {
                let by = deadline.min(Instant::now() + HANDSHAKE);
                dial_handshake(&s, (rank, peer), addr, secret, (seal, lane), &nonce, by).map(|keys| Handshaken {
                    stream: s,
                    keys,
                    sealed: seal,
                    lane,
                })
            }
            Err(e) => Err(Error::io(format!("link to rank {peer} at {addr}"), e)),
        };
        match attempt {
            Ok(s) => return Ok(s),
            Err(e @ (Error::Auth(_) | Error::Protocol { .. } | Error::Config(_))) => return Err(e),
            Err(e) if Instant::now() >= deadline => {
                tracing::debug!("{OP} with rank {peer}: {e}");
                return Err(Error::Timeout {
                    op: OP,
                    peer: Some(peer),
                    after: started.elapsed(),
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn dial_handshake(
    s: &TcpStream,
    (rank, peer): (usize, usize),
    addr: SocketAddr,
    secret: &[u8],
    (seal, lane): (bool, Lane),
    nonce: &[u8; NONCE_BYTES],
    by: Instant,
) -> Result<SessionKeys> {
    let ctx = || format!("link to rank {peer} at {addr}");
    let mut challenge = [0u8; 4 + NONCE_BYTES];
    read_exact_by(s, &mut challenge, by).map_err(|e| Error::io(ctx(), e))?;
    if &challenge[..4] != LINK_MAGIC {
        return Err(Error::protocol(
            "link handshake",
            format!("rank {peer} at {addr} is not a ferrocomm link"),
        ));
    }
    let field = rank as u32 | if seal { SEAL_BIT } else { 0 } | if lane == Lane::Bulk { BULK_BIT } else { 0 };
    let mut hello = field.to_le_bytes().to_vec();
    hello.extend_from_slice(&bootstrap::proof(
        secret,
        &challenge[4..],
        &role(b"dial", rank, seal, lane),
    ));
    hello.extend_from_slice(nonce);
    (&*s).write_all(&hello).map_err(|e| Error::io(ctx(), e))?;
    let mut answer = [0u8; 1];
    read_exact_by(s, &mut answer, by).map_err(|e| Error::io(ctx(), e))?;
    match answer[0] {
        verdict::ADMITTED => {}
        verdict::REFUSED => {
            return Err(Error::Auth(format!(
                "rank {peer} at {addr} refused our proof of the communicator secret"
            )))
        }
        verdict::UNEXPECTED => {
            return Err(Error::protocol(
                "link handshake",
                format!("rank {peer} at {addr} expects no such link from rank {rank} ({lane:?}), or has one already"),
            ))
        }
        verdict::SEALING_DIFFERS => {
            return Err(Error::Config(format!(
            "rank {rank} {} its link to rank {peer} and rank {peer} {}: set FERROCOMM_ENCRYPT the same on every rank",
            if seal { "seals" } else { "does not seal" },
            if seal { "does not" } else { "does" },
        )))
        }
        v => {
            return Err(Error::protocol(
                "link handshake",
                format!("unknown verdict {v} from rank {peer}"),
            ))
        }
    }
    let mut proof = [0u8; PROOF_BYTES];
    read_exact_by(s, &mut proof, by).map_err(|e| Error::io(ctx(), e))?;
    if !bootstrap::verify(secret, nonce, &role(b"listen", peer, seal, lane), &proof) {
        return Err(Error::Auth(format!(
            "the listener at {addr} could not prove the communicator secret as rank {peer}"
        )));
    }
    Ok(session_keys(secret, &challenge[4..], nonce, true))
}

/// Who a listener takes links from, and whether it seals each.
pub(crate) struct Expect<'a> {
    /// Per rank: a link from it is expected.
    pub from: &'a [bool],
    /// Per rank: its link is sealed (the dialler must say the same).
    pub seal: &'a dyn Fn(usize) -> bool,
    /// Per rank: its link has a second connection too (`Lane::Bulk`).
    pub bulk: &'a dyn Fn(usize) -> bool,
}

/// Accepts one authenticated link from each rank that `expect.from` marks, as rank `rank`, and
/// its second connection where `expect.bulk` says so; returns (peer rank, connection) pairs,
/// one per connection. Handshakes run at once, each with its
/// own deadline, so a silent connection delays no one; a rank not marked, or marked but
/// already linked, is refused, and so is one that disagrees on sealing.
pub(crate) fn accept_authenticated(
    l: TcpListener,
    rank: usize,
    expect: &Expect<'_>,
    secret: &[u8],
    deadline: Instant,
) -> Result<Vec<(usize, Handshaken)>> {
    accept_authenticated_or_stop(l, rank, expect, secret, deadline, &AtomicBool::new(false))
}

/// As [`accept_authenticated`], giving up (`Error::Closed`) once `stop` is set: the caller's
/// other half of the set-up failed. `Error::Timeout` at `deadline` names the first rank that
/// has not connected.
pub(crate) fn accept_authenticated_or_stop(
    l: TcpListener,
    rank: usize,
    expect: &Expect<'_>,
    secret: &[u8],
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Vec<(usize, Handshaken)>> {
    let from = expect.from;
    const OP: &str = "transport setup (accept links)";
    let started = Instant::now();
    let mut gate = Gate::new(l, *LINK_MAGIC, HELLO_BYTES, UNPROVEN)?;
    // Per rank, its connections so far: [main, bulk].
    let mut linked = vec![[false; 2]; from.len()];
    let wanted = |p: usize| [from[p], from[p] && (expect.bulk)(p)];
    let mut got = Vec::new();
    let expected: usize = (0..from.len()).map(|p| wanted(p).iter().filter(|&&w| w).count()).sum();
    let stopped = || stop.load(Ordering::Acquire);
    while got.len() < expected {
        let mut judge = |r: &Reply<'_>| {
            let field = u32::from_le_bytes([r.bytes[0], r.bytes[1], r.bytes[2], r.bytes[3]]);
            let peer = (field & !(SEAL_BIT | BULK_BIT)) as usize;
            let seal = field & SEAL_BIT != 0;
            let lane = if field & BULK_BIT != 0 { Lane::Bulk } else { Lane::Main };
            let (proof, their_nonce) = r.bytes[4..].split_at(PROOF_BYTES);
            if peer >= from.len() || !bootstrap::verify(secret, r.nonce, &role(b"dial", peer, seal, lane), proof) {
                return Judgement::Refuse(vec![verdict::REFUSED]);
            }
            let which = lane.index();
            if !wanted(peer)[which] || linked[peer][which] {
                tracing::warn!("link listener of rank {rank}: refused an unexpected link from rank {peer} ({lane:?})");
                return Judgement::Refuse(vec![verdict::UNEXPECTED]);
            }
            if seal != (expect.seal)(peer) {
                return Judgement::Refuse(vec![verdict::SEALING_DIFFERS]);
            }
            linked[peer][which] = true;
            let mut answer = vec![verdict::ADMITTED];
            answer.extend_from_slice(&bootstrap::proof(
                secret,
                their_nonce,
                &role(b"listen", rank, seal, lane),
            ));
            let keys = session_keys(secret, r.nonce, their_nonce, false);
            Judgement::Admit((peer, answer, keys, seal, lane))
        };
        match gate.next(deadline, &stopped, &mut judge)? {
            Some((stream, (peer, answer, keys, sealed, lane))) => {
                // The dialler waits for this answer; where it cannot be sent, the dialler
                // reports the failure and dials again.
                if (&stream).write_all(&answer).is_ok() {
                    got.push((
                        peer,
                        Handshaken {
                            stream,
                            keys,
                            sealed,
                            lane,
                        },
                    ));
                } else {
                    linked[peer][lane.index()] = false;
                }
            }
            None if stopped() => {
                return Err(Error::Closed {
                    op: OP,
                    state: "abandoned: the rest of the set-up failed",
                })
            }
            None => {
                return Err(Error::Timeout {
                    op: OP,
                    peer: (0..from.len()).find(|&p| wanted(p) != linked[p]),
                    after: started.elapsed(),
                })
            }
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A plain link pair over loopback.
    fn plain_pair() -> (TcpLink, TcpLink) {
        let (a, b) = nonblocking::loopback_pair();
        let link = |stream: TcpStream| TcpLink {
            stream,
            closed: None,
            sealed: None,
            read_ahead: Vec::new(),
            buffered: 0..0,
            bulk: None,
        };
        (link(a), link(b))
    }

    /// Pairs written in one call arrive whole and in order, read in pieces of every kind:
    /// shorter than the read-ahead (served from it, across pairs), and longer (what is left in
    /// it first, then straight from the stream).
    #[test]
    fn pairs_written_together_arrive_in_order_through_reads_of_any_size() {
        let (mut tx, mut rx) = plain_pair();
        let mut sent = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        let pieces = [1usize, 7, 48, 3000, READ_BUFFER - 1, READ_BUFFER, 9000, 100_000];
        let mut got = Vec::new();
        for (i, &len) in pieces.iter().cycle().take(40).enumerate() {
            let head: Vec<u8> = (0..48).map(|k| (i * 31 + k) as u8).collect();
            let body: Vec<u8> = (0..len).map(|k| (i * 7 + k * 13) as u8).collect();
            let (mut h, mut b) = (0, 0);
            while h < head.len() || b < body.len() {
                let n = tx.write_pair(&head[h..], &body[b..]).unwrap();
                let of_head = n.min(head.len() - h);
                h += of_head;
                b += n - of_head;
                // Keep the socket buffers from filling: read some as we go.
                let mut buf = vec![0u8; pieces[(i + 3) % pieces.len()]];
                let r = rx.read(&mut buf).unwrap();
                got.extend_from_slice(&buf[..r]);
                assert!(Instant::now() < deadline, "stuck writing pair {i}");
            }
            sent.extend_from_slice(&head);
            sent.extend_from_slice(&body);
        }
        let mut k = 0;
        while got.len() < sent.len() {
            let mut buf = vec![0u8; pieces[k % pieces.len()]];
            k += 1;
            let r = rx.read(&mut buf).unwrap();
            got.extend_from_slice(&buf[..r]);
            assert!(
                Instant::now() < deadline,
                "stuck reading: {} of {}",
                got.len(),
                sent.len()
            );
        }
        assert!(got == sent, "the bytes differ from what was sent");
        drop(tx);
        assert_closed_by_peer(|b| rx.read(b), deadline);
    }

    /// Reads (`read`, one byte at a time) until the stream ends, by `deadline`; the end must be
    /// the peer's closing.
    fn assert_closed_by_peer(mut read: impl FnMut(&mut [u8]) -> std::result::Result<usize, String>, deadline: Instant) {
        let mut one = [0u8; 1];
        let closed = loop {
            match read(&mut one) {
                Ok(0) => assert!(Instant::now() < deadline, "no end of stream"),
                other => break other,
            }
        };
        assert!(
            closed.as_ref().is_err_and(|why| why.contains("closed by peer")),
            "{closed:?}"
        );
    }

    /// A plain link pair whose first end dialled: with a second connection, on which it sends
    /// payloads of at least `from` bytes.
    fn pair_with_bulk(from: usize) -> (TcpLink, TcpLink) {
        let (mut dialler, mut listener) = plain_pair();
        let (out, into) = nonblocking::loopback_pair();
        dialler.bulk = Some(Bulk::Out { stream: out, from });
        listener.bulk = Some(Bulk::In(into));
        (dialler, listener)
    }

    /// Messages as the engine sends them on a link with a second connection: each header on
    /// the link's stream, a large payload on the second connection, a small one after its
    /// header. Both ends write and read in small steps, interleaved; the receiver, reading in
    /// message order, gets every byte where it belongs. A dialler gone shows on the second
    /// connection as on the first; only the dialler's end sends there.
    #[test]
    fn large_payloads_on_the_second_connection_arrive_in_message_order() {
        let (mut tx, mut rx) = pair_with_bulk(4096);
        let lens = [10usize, 4096, 4095, 300_000, 0, 70_000, 1, 1 << 20, 5000];
        let deadline = Instant::now() + Duration::from_secs(20);
        let body = |i: usize, len: usize| -> Vec<u8> { (0..len).map(|k| (i * 7 + k * 13) as u8).collect() };
        let head = |i: usize| -> Vec<u8> { (0..48).map(|k| (i * 31 + k) as u8).collect() };
        let sender = std::thread::spawn(move || {
            for (i, &len) in lens.iter().enumerate() {
                let (h, b) = (head(i), body(i, len));
                let bulk = tx.sends_in_bulk(len);
                assert_eq!(bulk, len >= 4096);
                let (mut hp, mut bp) = (0, 0);
                while hp < h.len() || bp < b.len() {
                    assert!(Instant::now() < deadline, "stuck writing message {i}");
                    if bulk {
                        hp += tx.write(&h[hp..]).unwrap();
                        bp += tx.write_bulk(&b[bp..]).unwrap();
                    } else {
                        let n = tx.write_pair(&h[hp..], &b[bp..]).unwrap();
                        let of_head = n.min(h.len() - hp);
                        hp += of_head;
                        bp += n - of_head;
                    }
                }
            }
            tx
        });
        for (i, &len) in lens.iter().enumerate() {
            let (mut h, mut b) = (vec![0u8; 48], vec![0u8; len]);
            let (mut hp, mut bp) = (0, 0);
            while hp < 48 {
                assert!(Instant::now() < deadline, "stuck reading header {i}");
                hp += rx.read(&mut h[hp..]).unwrap();
            }
            while bp < len {
                assert!(Instant::now() < deadline, "stuck reading payload {i}");
                // Reads of at most 3000 bytes: payloads arrive in many pieces.
                let to = len.min(bp + 3000);
                bp += if len >= 4096 {
                    rx.read_bulk(&mut b[bp..to]).unwrap()
                } else {
                    rx.read(&mut b[bp..to]).unwrap()
                };
            }
            assert_eq!(h, head(i), "header {i}");
            assert!(b == body(i, len), "payload {i} ({len} bytes) differs");
        }
        let mut tx = sender.join().unwrap();
        assert!(
            !rx.sends_in_bulk(1 << 30) && tx.sends_in_bulk(1 << 30),
            "only the dialler sends large payloads there"
        );
        assert!(
            tx.read_bulk(&mut [0u8; 4]).is_err(),
            "the dialler's end reads nothing there"
        );
        drop(tx);
        assert_closed_by_peer(|b| rx.read_bulk(b), deadline);
        assert!(rx.write_bulk(b"x").is_err(), "the listener's end sends nothing there");
    }

    /// Where `from` is `usize::MAX` (`FERROCOMM_TCP_BULK_BYTES=0`), nothing goes there; a link
    /// without a second connection reports a payload announced on one as a broken protocol.
    #[test]
    fn no_payload_goes_on_a_second_connection_that_is_off_or_missing() {
        let (tx, _rx) = pair_with_bulk(usize::MAX);
        assert!(!tx.sends_in_bulk(usize::MAX - 1));
        let (mut a, _b) = plain_pair();
        assert!(!a.sends_in_bulk(1 << 30));
        let e = a.read_bulk(&mut [0u8; 8]).unwrap_err();
        assert!(e.contains("second connection"), "{e}");
    }

    const SECRET: &[u8] = b"the communicator's secret";

    fn listener() -> (TcpListener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        (l, a)
    }

    /// Rank 0 accepts ranks 1 and 2 on a thread; returns what it got.
    fn accept_on_thread(
        l: TcpListener,
        secret: &'static [u8],
        within: Duration,
    ) -> std::thread::JoinHandle<Result<Vec<(usize, Handshaken)>>> {
        std::thread::spawn(move || accept(l, 0, &[false, true, true], secret, Instant::now() + within))
    }

    /// Accepts unsealed links from the ranks `from` marks.
    fn accept(
        l: TcpListener,
        rank: usize,
        from: &[bool],
        secret: &[u8],
        deadline: Instant,
    ) -> Result<Vec<(usize, Handshaken)>> {
        let expect = Expect {
            from,
            seal: &|_| false,
            bulk: &|_| false,
        };
        accept_authenticated(l, rank, &expect, secret, deadline)
    }

    fn dial_plain(rank: usize, peer: usize, addr: SocketAddr, secret: &[u8], deadline: Instant) -> Result<TcpStream> {
        dial((rank, peer), addr, secret, (false, Lane::Main), deadline).map(|h| h.stream)
    }

    /// What an attacker without the secret sends after the greeting: a rank, a proof made with
    /// a guessed secret, a nonce.
    fn forged_hello(addr: SocketAddr, rank: u32, secret: &[u8]) -> u8 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut challenge = [0u8; 4 + NONCE_BYTES];
        s.read_exact(&mut challenge).unwrap();
        let mut hello = rank.to_le_bytes().to_vec();
        hello.extend_from_slice(&bootstrap::proof(
            secret,
            &challenge[4..],
            &role(b"dial", rank as usize, false, Lane::Main),
        ));
        hello.extend_from_slice(&[9; NONCE_BYTES]);
        s.write_all(&hello).unwrap();
        let mut verdict = [9u8; 1];
        let _ = s.read_exact(&mut verdict);
        verdict[0]
    }

    /// Silent connections, garbage and forged hellos before the real peers: each is refused or
    /// waits on its own, and the real peers are linked at once.
    #[test]
    fn silent_garbage_and_forged_connections_delay_no_real_peer() {
        let (l, addr) = listener();
        let acceptor = accept_on_thread(l, SECRET, Duration::from_secs(20));
        let silent: Vec<TcpStream> = (0..50).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(&[0xAB; 200]).unwrap();
        assert_eq!(forged_hello(addr, 1, b"a guess"), verdict::REFUSED);
        assert_eq!(forged_hello(addr, 77, SECRET), verdict::REFUSED, "a rank out of range");
        let t = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(20);
        let a = dial_plain(1, 0, addr, SECRET, deadline).unwrap();
        let b = dial_plain(2, 0, addr, SECRET, deadline).unwrap();
        let mut got = acceptor.join().unwrap().unwrap();
        assert!(t.elapsed() < Duration::from_secs(2), "linked after {:?}", t.elapsed());
        got.sort_by_key(|(p, _)| *p);
        assert_eq!(got.iter().map(|(p, _)| *p).collect::<Vec<_>>(), [1, 2]);
        // The links carry data both ways.
        (&a).write_all(b"one").unwrap();
        let mut buf = [0u8; 3];
        (&got[0].1.stream).read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"one");
        drop((silent, garbage, b));
    }

    /// A hello recorded from one handshake is worth nothing in another (the nonce is fresh),
    /// and a rank that is already linked, or that the listener expects nothing from, is
    /// refused even with the secret.
    #[test]
    fn a_replayed_hello_and_a_duplicate_rank_are_refused() {
        let (l, addr) = listener();
        let acceptor = accept_on_thread(l, SECRET, Duration::from_secs(20));
        // Record a real hello against a listener of our own, then replay it.
        let (spy, spy_addr) = listener();
        let recorder = std::thread::spawn(move || {
            let (mut s, _) = spy.accept().unwrap();
            let mut challenge = LINK_MAGIC.to_vec();
            challenge.extend_from_slice(&[3; NONCE_BYTES]);
            s.write_all(&challenge).unwrap();
            let mut hello = [0u8; HELLO_BYTES];
            s.read_exact(&mut hello).unwrap();
            hello
        });
        let e = dial_plain(1, 0, spy_addr, SECRET, Instant::now() + Duration::from_millis(500)).unwrap_err();
        assert!(matches!(e, Error::Timeout { peer: Some(0), .. }), "{e}");
        let recorded = recorder.join().unwrap();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut challenge = [0u8; 4 + NONCE_BYTES];
        s.read_exact(&mut challenge).unwrap();
        s.write_all(&recorded).unwrap();
        let mut v = [9u8; 1];
        s.read_exact(&mut v).unwrap();
        assert_eq!(v[0], verdict::REFUSED, "a replayed hello");

        let deadline = Instant::now() + Duration::from_secs(20);
        let _one = dial_plain(1, 0, addr, SECRET, deadline).unwrap();
        let again = dial_plain(1, 0, addr, SECRET, deadline).unwrap_err();
        assert!(
            matches!(again, Error::Protocol { .. }) && again.to_string().contains("has one already"),
            "{again}"
        );
        let _two = dial_plain(2, 0, addr, SECRET, deadline).unwrap();
        let got = acceptor.join().unwrap().unwrap();
        assert_eq!(got.len(), 2);
    }

    /// Rank 0 accepts links from ranks 1 and 2 on a thread, sealed and with second
    /// connections as `seal` and `bulk` say; returns what it got.
    fn accept_ranks_1_and_2(
        l: TcpListener,
        seal: fn(usize) -> bool,
        bulk: fn(usize) -> bool,
    ) -> std::thread::JoinHandle<Result<Vec<(usize, Handshaken)>>> {
        std::thread::spawn(move || {
            let expect = Expect {
                from: &[false, true, true],
                seal: &seal,
                bulk: &bulk,
            };
            accept_authenticated(l, 0, &expect, SECRET, Instant::now() + Duration::from_secs(20))
        })
    }

    /// A listener takes a second connection only from a rank whose link has one, once, and in
    /// either order with the first; a proof made for one connection is not one for the other.
    #[test]
    fn a_link_takes_one_second_connection_and_only_where_expected() {
        let (l, addr) = listener();
        let acceptor = accept_ranks_1_and_2(l, |p| p == 2, |p| p == 1);
        let deadline = Instant::now() + Duration::from_secs(20);
        let _bulk = dial((1, 0), addr, SECRET, (false, Lane::Bulk), deadline).unwrap();
        let again = dial((1, 0), addr, SECRET, (false, Lane::Bulk), deadline).unwrap_err();
        assert!(matches!(again, Error::Protocol { .. }), "{again}");
        let sealed = dial((2, 0), addr, SECRET, (true, Lane::Bulk), deadline).unwrap_err();
        assert!(
            matches!(sealed, Error::Protocol { .. }) && sealed.to_string().contains("Bulk"),
            "{sealed}"
        );
        // A bulk connection's proof presented as a first connection's.
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut challenge = [0u8; 4 + NONCE_BYTES];
        s.read_exact(&mut challenge).unwrap();
        let mut hello = 1u32.to_le_bytes().to_vec();
        hello.extend_from_slice(&bootstrap::proof(
            SECRET,
            &challenge[4..],
            &role(b"dial", 1, false, Lane::Bulk),
        ));
        hello.extend_from_slice(&[9; NONCE_BYTES]);
        s.write_all(&hello).unwrap();
        let mut v = [9u8; 1];
        s.read_exact(&mut v).unwrap();
        assert_eq!(v[0], verdict::REFUSED);
        let _one = dial((1, 0), addr, SECRET, (false, Lane::Main), deadline).unwrap();
        let _two = dial((2, 0), addr, SECRET, (true, Lane::Main), deadline).unwrap();
        let mut got: Vec<(usize, Lane)> = acceptor
            .join()
            .unwrap()
            .unwrap()
            .iter()
            .map(|(p, h)| (*p, h.lane))
            .collect();
        got.sort_by_key(|&(p, lane)| (p, lane.index()));
        assert_eq!(got, [(1, Lane::Main), (1, Lane::Bulk), (2, Lane::Main)]);
    }

    /// The listener proves the secret too: a dialler never links to an impostor. A listener
    /// that never answers is a timeout naming its rank; so is a peer that never dials.
    #[test]
    fn an_impostor_listener_is_refused_and_silence_is_a_timeout_naming_the_peer() {
        let (l, addr) = listener();
        std::thread::spawn(move || {
            let _ = accept(
                l,
                0,
                &[false, true],
                b"another secret",
                Instant::now() + Duration::from_secs(5),
            );
        });
        let e = dial_plain(1, 0, addr, SECRET, Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Auth(_)), "{e}");

        let (mute, addr) = listener(); // accepts in the backlog, never greets
        let t = Instant::now();
        let e = dial_plain(1, 4, addr, SECRET, Instant::now() + Duration::from_millis(600)).unwrap_err();
        assert!(matches!(e, Error::Timeout { peer: Some(4), .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3));
        drop(mute);

        let (l, _) = listener();
        let e = accept(
            l,
            0,
            &[false, false, true],
            SECRET,
            Instant::now() + Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Timeout { peer: Some(2), .. }), "{e}");
    }

    /// The impostor test's other half: an impostor that knows the secret of another
    /// communicator, or answers as another rank, is refused by the dialler.
    #[test]
    fn a_listener_proving_another_rank_is_refused() {
        let (l, addr) = listener();
        std::thread::spawn(move || {
            let _ = accept(
                l,
                3,
                &[false, true, false, false],
                SECRET,
                Instant::now() + Duration::from_secs(5),
            );
        });
        let e = dial_plain(1, 0, addr, SECRET, Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(e, Error::Auth(_)) && e.to_string().contains("as rank 0"),
            "{e}"
        );
    }

    /// A sealed link carries data both ways with nothing in the clear; ends that disagree on
    /// sealing fail at set-up with a configuration error.
    #[test]
    fn a_sealed_link_carries_data_and_a_sealing_mismatch_is_a_config_error() {
        let (l, addr) = listener();
        let acceptor = accept_ranks_1_and_2(l, |p| p == 1, |_| false);
        let deadline = Instant::now() + Duration::from_secs(10);
        let e = dial((2, 0), addr, SECRET, (true, Lane::Main), deadline).expect_err("rank 2 must not seal");
        assert!(
            matches!(e, Error::Config(_)) && e.to_string().contains("FERROCOMM_ENCRYPT"),
            "{e}"
        );
        let mut mine = TcpLink::new(dial((1, 0), addr, SECRET, (true, Lane::Main), deadline).unwrap()).unwrap();
        let _plain = dial((2, 0), addr, SECRET, (false, Lane::Main), deadline).unwrap();
        let mut got = acceptor.join().unwrap().unwrap();
        got.sort_by_key(|(p, _)| *p);
        let (_, h) = got.remove(0);
        assert!(h.sealed);
        let spy = h.stream.try_clone().unwrap();
        let mut theirs = TcpLink::new(h).unwrap();
        let msg: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let (mut w, mut r) = (0, 0);
        let mut out = vec![0u8; msg.len()];
        let t = Instant::now();
        while r < msg.len() {
            assert!(t.elapsed() < Duration::from_secs(10));
            w += mine.write(&msg[w..]).unwrap();
            r += theirs.read(&mut out[r..]).unwrap();
        }
        assert_eq!(out, msg);
        drop(spy);
    }
}
