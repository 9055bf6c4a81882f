//! The TCP transport: a rank serves puts, gets, signals and atomics from peers that cannot map
//! its memory (other hosts, or any peer of a registered user buffer). One TCP connection per
//! (origin, target) pair carries the origin's requests in order (a `TcpLink`); a server thread
//! on the target applies them to its memory with the same orderings as a direct access, so a
//! put followed by a signal on one connection is visible before the signal
//! (docs/memory-model.md).
//!
//! Request: 32-byte header `op u8, 7 pad, a u64, b u64, c u64`, then `b` bytes for a put.
//! Replies (get: the bytes; atomics and flush: a u64) have no header: the origin knows what it
//! asked for. A request the target cannot accept closes the connection.

use super::link::Link;
use crate::bootstrap::seal::SealedStream;
use crate::contracts::error::{Error, Result};
use crate::contracts::window::SignalOp;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const PUT: u8 = 1;
const GET: u8 = 2;
const SIGNAL: u8 = 3;
const FETCH_ADD: u8 = 4;
const COMPARE_SWAP: u8 = 5;
const FLUSH: u8 = 6;
const HEADER: usize = 32;

fn header(op: u8, a: u64, b: u64, c: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = op;
    h[8..16].copy_from_slice(&a.to_le_bytes());
    h[16..24].copy_from_slice(&b.to_le_bytes());
    h[24..32].copy_from_slice(&c.to_le_bytes());
    h
}

fn word(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))
}

/// The target's memory as its server threads see it.
#[derive(Clone, Copy)]
pub(crate) struct Memory {
    pub data: *mut u8,
    pub bytes: usize,
    pub pad: *mut u8,
    pub signals: usize,
    pub size: usize,
}

// SAFETY: the pointers are the target's own window memory, which outlives every server thread
// (the window joins them before it frees anything); concurrent access is by raw copies and
// atomics as the memory model allows.
unsafe impl Send for Memory {}

impl Memory {
    /// The pad slot `[id][src]`.
    pub(crate) fn slot(&self, id: usize, src: usize) -> &AtomicU64 {
        // SAFETY: callers pass id < signals and src < size; the pad is 8-aligned and
        // signals * size words long.
        unsafe { &*(self.pad.add((id * self.size + src) * 8) as *const AtomicU64) }
    }

    /// The u64 at `offset` of the data (8-aligned, in bounds: checked by callers).
    pub(crate) fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: as stated; the data base is 8-aligned (a segment page, or a user buffer that
        // `CpuWindow::create` checked).
        unsafe { &*(self.data.add(offset) as *const AtomicU64) }
    }

    pub(crate) fn apply_signal(&self, id: usize, src: usize, op: SignalOp, value: u64) {
        let slot = self.slot(id, src);
        match op {
            SignalOp::Set => slot.store(value, Ordering::Release),
            SignalOp::Add => {
                slot.fetch_add(value, Ordering::Release);
            }
        }
    }
}

/// A target's window memory as its server threads apply requests to it: host memory
/// ([`Memory`]) or GPU memory (the device backend's windows). Offsets and ids are checked
/// against `limits` before any method is called.
pub(crate) trait Target: Send {
    /// Data bytes and signal ids.
    fn limits(&self) -> (usize, usize);
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()>;
    fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Applies `origin`'s signal after every earlier write of this connection.
    fn signal(&mut self, id: usize, origin: usize, op: SignalOp, value: u64) -> Result<()>;
    fn fetch_add(&mut self, offset: usize, value: u64) -> Result<u64>;
    fn compare_swap(&mut self, offset: usize, expected: u64, desired: u64) -> Result<u64>;
    /// Returns once every earlier request is complete in memory.
    fn complete(&mut self) -> Result<()>;
}

impl Target for Memory {
    fn limits(&self) -> (usize, usize) {
        (self.bytes, self.signals)
    }
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: in bounds (checked by `serve`) of the target's data.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(offset), src.len()) };
        Ok(())
    }
    fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        // SAFETY: as for `write`.
        unsafe { std::ptr::copy_nonoverlapping(self.data.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn signal(&mut self, id: usize, origin: usize, op: SignalOp, value: u64) -> Result<()> {
        self.apply_signal(id, origin, op, value);
        Ok(())
    }
    fn fetch_add(&mut self, offset: usize, value: u64) -> Result<u64> {
        Ok(self.word(offset).fetch_add(value, Ordering::AcqRel))
    }
    fn compare_swap(&mut self, offset: usize, expected: u64, desired: u64) -> Result<u64> {
        Ok(self
            .word(offset)
            .compare_exchange(expected, desired, Ordering::AcqRel, Ordering::Acquire)
            .unwrap_or_else(|v| v))
    }
    fn complete(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Serves one origin until its connection ends; then marks the origin gone.
pub(crate) fn serve(mut s: Conn, origin: usize, mut mem: impl Target, gone: Arc<Vec<AtomicBool>>) {
    if let Err(why) = serve_requests(&mut s, origin, &mut mem) {
        tracing::debug!(origin, "window server: connection ended: {why}");
    }
    gone[origin].store(true, Ordering::Release);
    let _ = s.get_ref().shutdown(Shutdown::Both);
}

/// A window connection: sealed where its traffic leaves the machine (FERROCOMM_ENCRYPT).
pub(crate) type Conn = SealedStream<TcpStream>;

fn serve_requests(s: &mut Conn, origin: usize, mem: &mut dyn Target) -> std::result::Result<(), String> {
    let (bytes, signals) = mem.limits();
    let in_bounds = |offset: u64, len: u64| offset.checked_add(len).is_some_and(|end| end <= bytes as u64);
    let word_ok = |off: u64| in_bounds(off, 8) && off % 8 == 0;
    let mut h = [0u8; HEADER];
    let mut buf = Vec::new();
    loop {
        if let Err(e) = s.read_exact(&mut h) {
            return Err(format!("{e}"));
        }
        let (a, b, c) = (word(&h[8..16]), word(&h[16..24]), word(&h[24..32]));
        let reply = |s: &mut Conn, v: u64| s.write_all(&v.to_le_bytes()).map_err(|e| e.to_string());
        match h[0] {
            PUT if in_bounds(a, b) => {
                buf.resize(b as usize, 0);
                s.read_exact(&mut buf).map_err(|e| e.to_string())?;
                mem.write(a as usize, &buf).map_err(|e| e.to_string())?;
            }
            GET if in_bounds(a, b) => {
                buf.resize(b as usize, 0);
                mem.read(a as usize, &mut buf).map_err(|e| e.to_string())?;
                s.write_all(&buf).map_err(|e| e.to_string())?;
            }
            SIGNAL if (a as usize) < signals && b <= 1 => {
                let op = if b == 0 { SignalOp::Set } else { SignalOp::Add };
                mem.signal(a as usize, origin, op, c).map_err(|e| e.to_string())?;
            }
            FETCH_ADD if word_ok(a) => {
                let old = mem.fetch_add(a as usize, c).map_err(|e| e.to_string())?;
                reply(s, old)?;
            }
            COMPARE_SWAP if word_ok(a) => {
                let old = mem.compare_swap(a as usize, b, c).map_err(|e| e.to_string())?;
                reply(s, old)?;
            }
            // Requests are applied in arrival order, so once they are complete in memory, all
            // earlier ones are.
            FLUSH => {
                mem.complete().map_err(|e| e.to_string())?;
                reply(s, 0)?;
            }
            op => return Err(format!("refused request {op} (a={a}, b={b}) from rank {origin}")),
        }
    }
}

/// An origin's connection to one target's server.
pub(crate) struct TcpLink {
    stream: Conn,
    peer: usize,
    timeout: Duration,
}

impl TcpLink {
    pub(crate) fn new(stream: Conn, peer: usize, timeout: Duration) -> Result<TcpLink> {
        let io = |e| Error::io("window proxy connection", e);
        let s = stream.get_ref();
        s.set_nodelay(true).map_err(io)?;
        s.set_read_timeout(Some(timeout)).map_err(io)?;
        s.set_write_timeout(Some(timeout)).map_err(io)?;
        Ok(TcpLink { stream, peer, timeout })
    }

    fn fail(&self, op: &'static str, e: std::io::Error) -> Error {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => Error::Timeout {
                op,
                peer: Some(self.peer),
                after: self.timeout,
            },
            _ => Error::PeerLost {
                op,
                peer: self.peer,
                reason: format!("window proxy connection: {e}"),
            },
        }
    }

    fn send(&mut self, op: &'static str, h: [u8; HEADER], payload: &[u8]) -> Result<()> {
        self.stream.write_all(&h).map_err(|e| self.fail(op, e))?;
        self.stream.write_all(payload).map_err(|e| self.fail(op, e))
    }

    fn reply_word(&mut self, op: &'static str) -> Result<u64> {
        let mut r = [0u8; 8];
        self.stream.read_exact(&mut r).map_err(|e| self.fail(op, e))?;
        Ok(u64::from_le_bytes(r))
    }
}

impl Link for TcpLink {
    fn transport(&self) -> &'static str {
        "tcp"
    }

    fn put(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.send("put", header(PUT, offset as u64, src.len() as u64, 0), src)
    }

    fn get(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.send("get", header(GET, offset as u64, dst.len() as u64, 0), &[])?;
        self.stream.read_exact(dst).map_err(|e| self.fail("get", e))
    }

    fn signal(&mut self, id: usize, op: SignalOp, value: u64) -> Result<()> {
        let code = match op {
            SignalOp::Set => 0,
            SignalOp::Add => 1,
        };
        self.send("signal", header(SIGNAL, id as u64, code, value), &[])
    }

    fn fetch_add(&mut self, offset: usize, value: u64) -> Result<u64> {
        self.send("fetch_add", header(FETCH_ADD, offset as u64, 0, value), &[])?;
        self.reply_word("fetch_add")
    }

    fn compare_swap(&mut self, offset: usize, expected: u64, desired: u64) -> Result<u64> {
        self.send(
            "compare_swap",
            header(COMPARE_SWAP, offset as u64, expected, desired),
            &[],
        )?;
        self.reply_word("compare_swap")
    }

    fn flush(&mut self) -> Result<()> {
        self.send("flush", header(FLUSH, 0, 0, 0), &[])?;
        self.reply_word("flush").map(|_| ())
    }
}

/// A link from rank `origin` of two to the other rank's server on this host's loopback,
/// applying to `data` and `pad` (two slots per signal id), with the server's thread.
#[cfg(test)]
pub(crate) fn loopback(origin: usize, data: &mut [u64], pad: &mut [u64]) -> (TcpLink, std::thread::JoinHandle<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let from = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (served, _) = l.accept().unwrap();
    let mem = Memory {
        data: data.as_mut_ptr().cast(),
        bytes: data.len() * 8,
        pad: pad.as_mut_ptr().cast(),
        signals: pad.len() / 2,
        size: 2,
    };
    let gone = Arc::new(vec![AtomicBool::new(false), AtomicBool::new(false)]);
    let server = std::thread::spawn(move || serve(SealedStream::plain(served), origin, mem, gone));
    (
        TcpLink::new(SealedStream::plain(from), 1 - origin, Duration::from_secs(5)).unwrap(),
        server,
    )
}
