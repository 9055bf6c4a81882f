//! Admission of TCP connections that must prove a secret before anything else is read from
//! them: the store server's clients and the link and window listeners' peers.
//!
//! One thread runs every handshake at once, non-blocking: it greets each new connection with a
//! fresh nonce, collects its fixed-length reply and hands it to a judge. So a silent or
//! trickling connection delays no other, and it holds a file descriptor (nothing more: no
//! thread, no buffer beyond its reply) until its own handshake deadline. Connections still
//! proving themselves have their own caps, overall and per source address; past a cap the
//! oldest is dropped, so a flood of idle connections cannot lock out a client that answers at
//! once (and one that is dropped retries). Accept errors such as EMFILE back off instead of
//! spinning, and each drops the oldest unproven connection to free a descriptor.

use super::auth::{self, NONCE_BYTES};
use crate::contracts::error::Result;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Bounds on connections that have not yet proven the secret.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Time from accept to a complete reply; a connection that takes longer is dropped.
    pub handshake: Duration,
    /// Unproven connections held at once; past this the oldest is dropped.
    pub pending: usize,
    /// Unproven connections held at once from one source address.
    pub per_source: usize,
}

/// What a connection answered to its greeting.
pub(crate) struct Reply<'a> {
    /// The nonce we greeted it with (what its proof must cover).
    pub nonce: &'a [u8; NONCE_BYTES],
    /// Its reply, exactly `reply_len` bytes.
    pub bytes: &'a [u8],
}

/// A judge's verdict on a reply.
pub(crate) enum Judgement<T> {
    /// Hand the connection to the caller with `T` (which says what to answer it).
    Admit(T),
    /// Send these bytes (the refusal's reason, as the protocol encodes it) and close.
    Refuse(Vec<u8>),
}

struct Pending {
    stream: TcpStream,
    from: IpAddr,
    nonce: [u8; NONCE_BYTES],
    got: Vec<u8>,
    deadline: Instant,
}

/// A listener whose connections are admitted only through a handshake.
pub(crate) struct Gate {
    listener: TcpListener,
    magic: [u8; 4],
    reply_len: usize,
    limits: Limits,
    pending: VecDeque<Pending>,
    /// After an accept error, no accept before this.
    resume_accept: Instant,
    backoff: Duration,
}

/// The longest sleep after an accept error: short enough to take a connection soon after
/// descriptors free up, long enough that a full descriptor table costs almost no CPU.
const MAX_BACKOFF: Duration = Duration::from_millis(100);
/// Connections taken from the listener between two reads of the replies: a flood that never
/// stops arriving cannot keep a prompt client's reply from being read (and that client from
/// being dropped as the oldest while it waits).
const ACCEPT_BATCH: usize = 64;
/// How often `next` looks at its stop condition when nothing happens.
const STOP_POLL: Duration = Duration::from_millis(20);

impl Gate {
    /// Greets connections with `magic` and a nonce and expects `reply_len` bytes back.
    pub fn new(listener: TcpListener, magic: [u8; 4], reply_len: usize, limits: Limits) -> Result<Gate> {
        listener
            .set_nonblocking(true)
            .map_err(|e| crate::contracts::error::Error::io("listener", e))?;
        Ok(Gate {
            listener,
            magic,
            reply_len,
            limits,
            pending: VecDeque::new(),
            resume_accept: Instant::now(),
            backoff: Duration::ZERO,
        })
    }

    /// Unproven connections held now.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Accepts and runs handshakes until `judge` admits one, which is returned (as a blocking
    /// stream) with the judge's value; `None` once `until` passes or `stop()` says so (looked
    /// at every 20 ms). `Err` only when the OS generator fails: no connection is greeted with
    /// a nonce that is not fresh.
    pub fn next<T>(
        &mut self,
        until: Instant,
        stop: &dyn Fn() -> bool,
        judge: &mut dyn FnMut(&Reply<'_>) -> Judgement<T>,
    ) -> Result<Option<(TcpStream, T)>> {
        loop {
            if stop() {
                return Ok(None);
            }
            let now = Instant::now();
            self.pending.retain(|p| p.deadline > now);
            if now >= until {
                return Ok(None);
            }
            if now >= self.resume_accept {
                self.accept_all(now)?;
            }
            if let Some(admitted) = self.read_replies(judge) {
                return Ok(Some(admitted));
            }
            self.wait(until);
        }
    }

    /// Takes the connections waiting on the listener, at most [`ACCEPT_BATCH`], and greets them.
    fn accept_all(&mut self, now: Instant) -> Result<()> {
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok((stream, addr)) => {
                    self.backoff = Duration::ZERO;
                    self.greet(stream, addr.ip(), now)?;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::ConnectionAborted) => {}
                Err(e) => {
                    // Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) or
                    // worse: the connection stays in the backlog, so retrying at once would
                    // spin. Free a descriptor held by an unproven connection and wait.
                    self.pending.pop_front();
                    self.backoff = (self.backoff * 2).clamp(Duration::from_millis(1), MAX_BACKOFF);
                    self.resume_accept = now + self.backoff;
                    if self.backoff == MAX_BACKOFF {
                        tracing::warn!("listener: accept failed ({e}); retrying every {MAX_BACKOFF:?}");
                    }
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    fn greet(&mut self, stream: TcpStream, from: IpAddr, now: Instant) -> Result<()> {
        let nonce = auth::nonce()?;
        if stream.set_nonblocking(true).is_err() {
            return Ok(());
        }
        let mut hello = self.magic.to_vec();
        hello.extend_from_slice(&nonce);
        // A new socket's send buffer takes 36 bytes whole; one that does not is dropped.
        if !matches!((&stream).write(&hello), Ok(n) if n == hello.len()) {
            return Ok(());
        }
        if self.pending.iter().filter(|p| p.from == from).count() >= self.limits.per_source {
            if let Some(i) = self.pending.iter().position(|p| p.from == from) {
                self.pending.remove(i);
            }
        }
        if self.pending.len() >= self.limits.pending {
            self.pending.pop_front();
        }
        self.pending.push_back(Pending {
            stream,
            from,
            nonce,
            got: Vec::with_capacity(self.reply_len),
            deadline: now + self.limits.handshake,
        });
        Ok(())
    }

    /// Reads what each connection has sent; judges complete replies. Returns the first one
    /// admitted (the rest wait for the next call).
    fn read_replies<T>(&mut self, judge: &mut dyn FnMut(&Reply<'_>) -> Judgement<T>) -> Option<(TcpStream, T)> {
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let want = self.reply_len - p.got.len();
            let mut buf = [0u8; 256];
            let read = (&p.stream).read(&mut buf[..want.min(256)]);
            match read {
                Ok(0) => {
                    self.pending.remove(i);
                    continue;
                }
                Ok(n) => p.got.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(_) => {
                    self.pending.remove(i);
                    continue;
                }
            }
            if p.got.len() < self.reply_len {
                i += 1;
                continue;
            }
            let Some(p) = self.pending.remove(i) else { break };
            let reply = Reply {
                nonce: &p.nonce,
                bytes: &p.got,
            };
            match judge(&reply) {
                Judgement::Admit(t) => {
                    if p.stream.set_nonblocking(false).is_ok() {
                        return Some((p.stream, t));
                    }
                }
                Judgement::Refuse(why) => {
                    tracing::warn!(
                        "listener: refused a connection from {} that did not prove the secret",
                        p.from
                    );
                    let _ = (&p.stream).write(&why);
                }
            }
        }
        None
    }

    /// Sleeps until the listener or an unproven connection is readable, the next deadline,
    /// the end of a back-off, `until`, or 20 ms (to look at the stop condition).
    fn wait(&self, until: Instant) {
        let now = Instant::now();
        let mut wake = until.min(now + STOP_POLL);
        if let Some(d) = self.pending.iter().map(|p| p.deadline).min() {
            wake = wake.min(d);
        }
        let accepting = now >= self.resume_accept;
        if !accepting {
            wake = wake.min(self.resume_accept);
        }
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(self.pending.len() + 1);
        if accepting {
            fds.push(PollFd::new(&self.listener, PollFlags::IN));
        }
        fds.extend(self.pending.iter().map(|p| PollFd::new(&p.stream, PollFlags::IN)));
        let left = wake.saturating_duration_since(now);
        let ts = Timespec {
            tv_sec: left.as_secs() as _,
            tv_nsec: left.subsec_nanos() as _,
        };
        let _ = poll(&mut fds, Some(&ts));
    }
}

/// Reads `buf` whole by `deadline` (an absolute one: a peer trickling a byte at a time cannot
/// stretch it). `ErrorKind::TimedOut` once it passes.
pub(crate) fn read_exact_by(s: &TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "handshake deadline passed"));
        }
        s.set_read_timeout(Some(left))?;
        match (&*s).read(&mut buf[at..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    s.set_read_timeout(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAGIC: [u8; 4] = *b"TST1";

    fn gate(limits: Limits) -> (Gate, std::net::SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        (Gate::new(l, MAGIC, 8, limits).unwrap(), addr)
    }

    const LIMITS: Limits = Limits {
        handshake: Duration::from_millis(500),
        pending: 16,
        per_source: 16,
    };

    fn answer(addr: std::net::SocketAddr, reply: &[u8]) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut hello = [0u8; 4 + NONCE_BYTES];
        s.read_exact(&mut hello).unwrap();
        assert_eq!(hello[..4], MAGIC);
        s.write_all(reply).unwrap();
        s
    }

    /// Runs the gate for at most `within`, admitting replies that start with "ok".
    fn run(g: &mut Gate, within: Duration) -> Option<(TcpStream, Vec<u8>)> {
        g.next(Instant::now() + within, &|| false, &mut admit_all).unwrap()
    }

    fn admit_all(r: &Reply<'_>) -> Judgement<Vec<u8>> {
        if r.bytes.starts_with(b"ok") {
            Judgement::Admit(r.bytes.to_vec())
        } else {
            Judgement::Refuse(vec![0])
        }
    }

    /// Silent connections wait beside a prompt one, which is admitted at once; they are
    /// dropped at their deadline.
    #[test]
    fn a_silent_connection_delays_no_other_and_ends_at_its_deadline() {
        let (mut g, addr) = gate(LIMITS);
        let silent: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let t = Instant::now();
        let client = std::thread::spawn(move || answer(addr, b"ok123456"));
        let (_, got) = run(&mut g, Duration::from_secs(5)).expect("admitted");
        assert_eq!(got, b"ok123456");
        assert!(t.elapsed() < Duration::from_millis(400), "{:?}", t.elapsed());
        assert_eq!(g.pending(), 5);
        drop(client.join().unwrap());
        assert!(run(&mut g, Duration::from_millis(700)).is_none());
        assert_eq!(g.pending(), 0, "silent connections are dropped at their deadline");
        for mut s in silent {
            s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf).unwrap();
            assert_eq!(n, 4 + NONCE_BYTES, "greeting, then closed");
            assert_eq!(s.read(&mut buf).unwrap(), 0);
        }
    }

    /// Past the cap the oldest unproven connection goes, so a flood cannot keep out a client
    /// that answers; a wrong reply is refused with the judge's bytes.
    #[test]
    fn a_flood_past_the_cap_drops_the_oldest_and_a_wrong_reply_is_refused() {
        let (mut g, addr) = gate(Limits { pending: 4, ..LIMITS });
        let flood: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
        assert!(run(&mut g, Duration::from_millis(100)).is_none());
        assert_eq!(g.pending(), 4);
        let bad = std::thread::spawn(move || {
            let mut s = answer(addr, b"no123456");
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut v = Vec::new();
            s.read_to_end(&mut v).unwrap();
            v
        });
        let refused = run(&mut g, Duration::from_millis(300));
        assert!(refused.is_none());
        assert_eq!(bad.join().unwrap(), [0]);
        let good = std::thread::spawn(move || answer(addr, b"ok654321"));
        let (_, got) = run(&mut g, Duration::from_secs(5)).expect("admitted despite the flood");
        assert_eq!(got, b"ok654321");
        drop((good.join(), flood));
    }

    /// A byte every 100 ms cannot stretch an absolute deadline.
    #[test]
    fn reading_by_a_deadline_is_not_stretched_by_trickling() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let writer = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            for _ in 0..20 {
                if s.write_all(&[1]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let (s, _) = l.accept().unwrap();
        let t = Instant::now();
        let mut buf = [0u8; 64];
        let e = read_exact_by(&s, &mut buf, Instant::now() + Duration::from_millis(350)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut);
        assert!(t.elapsed() < Duration::from_millis(600), "{:?}", t.elapsed());
        drop(s);
        writer.join().unwrap();
    }
}
