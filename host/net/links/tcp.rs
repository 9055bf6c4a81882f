//! TCP links between ranks on different hosts: one non-blocking stream per peer pair.

use crate::bootstrap::{self, NONCE_BYTES, PROOF_BYTES};
use crate::contracts::error::{Error, Result};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const LINK_MAGIC: &[u8; 4] = b"FCL1";

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

pub(crate) struct TcpLink {
    stream: TcpStream,
    closed: Option<String>,
}

impl TcpLink {
    pub(crate) fn new(stream: TcpStream) -> Result<TcpLink> {
        stream.set_nodelay(true).map_err(|e| Error::io("set TCP_NODELAY", e))?;
        stream
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        Ok(TcpLink { stream, closed: None })
    }

    /// Bytes written, or the reason the connection is gone.
    pub(crate) fn write(&mut self, src: &[u8]) -> std::result::Result<usize, String> {
        match self.stream.write(src) {
            Ok(n) => Ok(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(0),
            Err(e) => Err(self.close(format!("connection lost while sending: {e}"))),
        }
    }

    pub(crate) fn read(&mut self, dst: &mut [u8]) -> std::result::Result<usize, String> {
        if dst.is_empty() {
            return Ok(0);
        }
        match self.stream.read(dst) {
            Ok(0) => Err(self.close("connection closed by peer".into())),
            Ok(n) => Ok(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(0),
            Err(e) => Err(self.close(format!("connection lost while receiving: {e}"))),
        }
    }

    fn close(&mut self, why: String) -> String {
        self.closed.get_or_insert(why).clone()
    }

    pub(crate) fn try_clone_stream(&self) -> Option<TcpStream> {
        self.stream.try_clone().ok()
    }
}

/// Connects to `peer`'s listener at `addr` and proves, as `rank`, that we know `secret`.
pub(crate) fn dial(rank: usize, peer: usize, addr: SocketAddr, secret: &[u8], deadline: Instant) -> Result<TcpStream> {
    let ctx = || format!("link to rank {peer} at {addr}");
    let mut s = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => return Err(Error::io(ctx(), e)),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    s.set_read_timeout(Some(left(deadline).max(Duration::from_millis(1))))
        .map_err(|e| Error::io(ctx(), e))?;
    let mut challenge = [0u8; 4 + NONCE_BYTES];
    s.read_exact(&mut challenge).map_err(|e| Error::io(ctx(), e))?;
    if &challenge[..4] != LINK_MAGIC {
        return Err(Error::protocol(
            "link handshake",
            format!("rank {peer} is not a ferrocomm link"),
        ));
    }
    let mut hello = (rank as u32).to_le_bytes().to_vec();
    hello.extend_from_slice(&bootstrap::proof(secret, &challenge[4..], &(rank as u32).to_le_bytes()));
    s.write_all(&hello).map_err(|e| Error::io(ctx(), e))?;
    s.set_read_timeout(None).map_err(|e| Error::io(ctx(), e))?;
    Ok(s)
}

/// Accepts `expected` authenticated links; returns (peer rank, stream) pairs.
pub(crate) fn accept_authenticated(
    l: &TcpListener,
    expected: usize,
    secret: &[u8],
    size: usize,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    accept_authenticated_or_stop(l, expected, secret, size, deadline, &AtomicBool::new(false))
}

/// As [`accept_authenticated`], giving up (`Error::Closed`) once `stop` is set: the caller's
/// other half of the set-up failed. Waits in `poll` on the listener, so a connection is taken
/// as soon as it arrives.
pub(crate) fn accept_authenticated_or_stop(
    l: &TcpListener,
    expected: usize,
    secret: &[u8],
    size: usize,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Vec<(usize, TcpStream)>> {
    const OP: &str = "transport setup (accept links)";
    l.set_nonblocking(true).map_err(|e| Error::io("link listener", e))?;
    let started = Instant::now();
    let mut got = Vec::new();
    while got.len() < expected {
        let mut s = match l.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if stop.load(Ordering::Acquire) {
                    return Err(Error::Closed {
                        op: OP,
                        state: "abandoned: the rest of the set-up failed",
                    });
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(Error::Timeout {
                        op: OP,
                        peer: None,
                        after: started.elapsed(),
                    });
                }
                // Woken by a connection; at least every 20 ms to look at `stop`.
                let wait = (deadline - now).min(Duration::from_millis(20));
                let ts = Timespec {
                    tv_sec: 0,
                    tv_nsec: wait.as_nanos() as _,
                };
                let mut fds = [PollFd::new(l, PollFlags::IN)];
                let _ = poll(&mut fds, Some(&ts));
                continue;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io("accept link", e)),
        };
        s.set_nonblocking(false).map_err(|e| Error::io("link socket", e))?;
        s.set_read_timeout(Some(left(deadline).max(Duration::from_millis(1))))
            .map_err(|e| Error::io("link socket", e))?;
        let nonce = bootstrap::nonce()?;
        let mut challenge = LINK_MAGIC.to_vec();
        challenge.extend_from_slice(&nonce);
        if s.write_all(&challenge).is_err() {
            continue;
        }
        let mut hello = [0u8; 4 + PROOF_BYTES];
        if s.read_exact(&mut hello).is_err() {
            continue;
        }
        let peer = u32::from_le_bytes([hello[0], hello[1], hello[2], hello[3]]) as usize;
        if peer >= size || !bootstrap::verify(secret, &nonce, &hello[..4], &hello[4..]) {
            tracing::warn!("link listener: refused a connection that did not prove the communicator secret");
            continue;
        }
        s.set_read_timeout(None).map_err(|e| Error::io("link socket", e))?;
        got.push((peer, s));
    }
    Ok(got)
}
