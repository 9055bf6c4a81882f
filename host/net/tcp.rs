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
use crate::error::{Error, Result};
use crate::window::SignalOp;
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

    fn in_bounds(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.bytes as u64)
    }
}

/// Serves one origin until its connection ends; then marks the origin gone.
pub(crate) fn serve(mut s: TcpStream, origin: usize, mem: Memory, gone: Arc<Vec<AtomicBool>>) {
    if let Err(why) = serve_requests(&mut s, origin, mem) {
        tracing::debug!(origin, "window proxy: connection ended: {why}");
    }
    gone[origin].store(true, Ordering::Release);
    let _ = s.shutdown(Shutdown::Both);
}

fn serve_requests(s: &mut TcpStream, origin: usize, mem: Memory) -> std::result::Result<(), String> {
    let mut h = [0u8; HEADER];
    let mut buf = Vec::new();
    loop {
        if let Err(e) = s.read_exact(&mut h) {
            return Err(format!("{e}"));
        }
        let (a, b, c) = (word(&h[8..16]), word(&h[16..24]), word(&h[24..32]));
        let word_ok = |off: u64| mem.in_bounds(off, 8) && off % 8 == 0;
        match h[0] {
            PUT if mem.in_bounds(a, b) => {
                buf.resize(b as usize, 0);
                s.read_exact(&mut buf).map_err(|e| e.to_string())?;
                // SAFETY: in bounds (checked above) of the target's data.
                unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), mem.data.add(a as usize), buf.len()) };
            }
            GET if mem.in_bounds(a, b) => {
                buf.resize(b as usize, 0);
                // SAFETY: as for PUT.
                unsafe { std::ptr::copy_nonoverlapping(mem.data.add(a as usize), buf.as_mut_ptr(), buf.len()) };
                s.write_all(&buf).map_err(|e| e.to_string())?;
            }
            SIGNAL if (a as usize) < mem.signals && b <= 1 => {
                let op = if b == 0 { SignalOp::Set } else { SignalOp::Add };
                mem.apply_signal(a as usize, origin, op, c);
            }
            FETCH_ADD if word_ok(a) => {
                let old = mem.word(a as usize).fetch_add(c, Ordering::AcqRel);
                s.write_all(&old.to_le_bytes()).map_err(|e| e.to_string())?;
            }
            COMPARE_SWAP if word_ok(a) => {
                let w = mem.word(a as usize);
                let old = w
                    .compare_exchange(b, c, Ordering::AcqRel, Ordering::Acquire)
                    .unwrap_or_else(|v| v);
                s.write_all(&old.to_le_bytes()).map_err(|e| e.to_string())?;
            }
            // Requests are applied in arrival order, so answering means all earlier ones are done.
            FLUSH => s.write_all(&0u64.to_le_bytes()).map_err(|e| e.to_string())?,
            op => return Err(format!("refused request {op} (a={a}, b={b}) from rank {origin}")),
        }
    }
}

/// An origin's connection to one target's server.
pub(crate) struct TcpLink {
    stream: TcpStream,
    peer: usize,
    timeout: Duration,
}

impl TcpLink {
    pub(crate) fn new(stream: TcpStream, peer: usize, timeout: Duration) -> Result<TcpLink> {
        let io = |e| Error::io("window proxy connection", e);
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        stream.set_write_timeout(Some(timeout)).map_err(io)?;
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
