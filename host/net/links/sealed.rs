//! The sealed form of a non-blocking TCP link: what the caller writes is sealed into records
//! (bootstrap/seal.rs) and what arrives is opened, with the same partial, never-blocking
//! semantics as the plain stream.
//!
//! A write seals at most one record and reports its bytes as written only once the whole
//! record is in the kernel; until then it reports 0, and the caller, as with a full socket,
//! comes back with the same bytes (the engine retries from where it stopped). So bytes are
//! never held back in a buffer the caller thinks it has handed over: a rank that goes on to
//! wait on another peer cannot strand its own sends.

use super::nonblocking;
use crate::bootstrap::seal::{Opener, Sealer, SessionKeys, LEN_BYTES, RECORD_PLAIN_MAX, TAG_BYTES};
use std::io::{Read, Write};
use std::net::TcpStream;

pub(crate) struct Sealed {
    sealer: Sealer,
    opener: Opener,
    /// A sealed record not yet wholly written, and how much of it is.
    out: Vec<u8>,
    out_at: usize,
    /// The plaintext bytes that record carries.
    out_plain: usize,
    /// Bytes received, in `buf[start..end]`: records are opened in place.
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The opened record at `start`: its plaintext not yet read is `buf[at..to]`, and the
    /// record ends at `record_end`.
    opened: Option<Opened>,
    /// Bytes moved on the socket since the owner last took this (see `Link::take_progress`).
    pub progressed: bool,
}

#[derive(Clone, Copy)]
struct Opened {
    at: usize,
    to: usize,
    record_end: usize,
}

/// Room for two whole records: one being read out while the next arrives.
const BUF_BYTES: usize = 2 * (LEN_BYTES + RECORD_PLAIN_MAX + TAG_BYTES);

/// The result of one step: bytes moved (0: would block), or why the link is gone.
pub(crate) type Step = std::result::Result<usize, String>;

impl Sealed {
    pub fn new(keys: &SessionKeys) -> Sealed {
        Sealed {
            sealer: Sealer::new(&keys.send),
            opener: Opener::new(&keys.recv),
            out: Vec::new(),
            out_at: 0,
            out_plain: 0,
            buf: vec![0u8; BUF_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            opened: None,
            progressed: false,
        }
    }

    /// Writes as much of the pending record as the socket takes; true once it is all out.
    fn flush(&mut self, mut s: &TcpStream) -> std::result::Result<bool, String> {
        while self.out_at < self.out.len() {
            let n = nonblocking::sent(s.write(&self.out[self.out_at..]))?;
            if n == 0 {
                return Ok(false);
            }
            self.out_at += n;
            self.progressed = true;
        }
        Ok(true)
    }

    pub fn write(&mut self, s: &TcpStream, src: &[u8]) -> Step {
        if self.out_at == self.out.len() {
            if src.is_empty() {
                return Ok(0);
            }
            let n = src.len().min(RECORD_PLAIN_MAX);
            self.out.clear();
            self.out_at = 0;
            self.sealer
                .seal_into(&src[..n], &mut self.out)
                .map_err(|e| e.to_string())?;
            self.out_plain = n;
        } else if src.len() < self.out_plain {
            // The caller must come back with the bytes it was told were not yet written.
            return Err(format!(
                "internal: a sealed record of {} bytes is pending, but the caller now writes {}",
                self.out_plain,
                src.len()
            ));
        }
        if self.flush(s)? {
            Ok(self.out_plain)
        } else {
            Ok(0)
        }
    }

    pub fn read(&mut self, mut s: &TcpStream, dst: &mut [u8]) -> Step {
        if dst.is_empty() {
            return Ok(0);
        }
        loop {
            if let Some(o) = &mut self.opened {
                let n = dst.len().min(o.to - o.at);
                dst[..n].copy_from_slice(&self.buf[o.at..o.at + n]);
                o.at += n;
                if o.at == o.to {
                    self.start = o.record_end;
                    self.opened = None;
                }
                if n > 0 {
                    return Ok(n);
                }
                continue;
            }
            let held = &mut self.buf[self.start..self.end];
            let need = match Opener::record_len(held).map_err(|e| e.to_string())? {
                Some(len) if held.len() >= len => {
                    let plain = self.opener.open(&mut held[..len]).map_err(|e| e.to_string())?.len();
                    let at = self.start + LEN_BYTES;
                    self.opened = Some(Opened {
                        at,
                        to: at + plain,
                        record_end: self.start + len,
                    });
                    continue;
                }
                Some(len) => len,
                None => LEN_BYTES,
            };
            // Make room for the rest of this record at the end of the buffer.
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            } else if self.buf.len() - self.start < need {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            let n = nonblocking::received(s.read(&mut self.buf[self.end..]))?;
            if n == 0 {
                return Ok(0);
            }
            self.end += n;
            self.progressed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::seal::session_keys;
    use crate::net::links::nonblocking::loopback_pair as pair;
    use std::time::{Duration, Instant};

    /// 8 MiB each way at once, in uneven pieces, over non-blocking sockets whose buffers fill:
    /// every byte arrives in order, and none travels in the clear.
    #[test]
    fn both_ways_at_once_every_byte_arrives_sealed() {
        let (a, b) = pair();
        let (ka, kb) = (
            session_keys(b"s", &[1; 32], &[2; 32], true),
            session_keys(b"s", &[1; 32], &[2; 32], false),
        );
        let (mut sa, mut sb) = (Sealed::new(&ka), Sealed::new(&kb));
        let len = 8 << 20;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4093) as u8).collect();
        let (mut wa, mut wb, mut ra, mut rb) = (0, 0, 0, 0);
        let (mut got_a, mut got_b) = (vec![0u8; len], vec![0u8; len]);
        let t = Instant::now();
        let (mut piece, mut pa, mut pb) = (1usize, 1usize, 1usize);
        while ra < len || rb < len {
            assert!(t.elapsed() < Duration::from_secs(60), "stuck at {wa} {wb} {ra} {rb}");
            piece = piece * 31 % 100_003 + 1;
            // As the engine does: a write that moved nothing is retried with the same bytes.
            if wa < len {
                let n = sa.write(&a, &src[wa..(wa + pa).min(len)]).unwrap();
                wa += n;
                if n > 0 {
                    pa = piece;
                }
            }
            if wb < len {
                let n = sb.write(&b, &src[wb..(wb + pb).min(len)]).unwrap();
                wb += n;
                if n > 0 {
                    pb = piece / 2 + 1;
                }
            }
            let end = (rb + piece).min(len);
            rb += sb.read(&b, &mut got_b[rb..end]).unwrap();
            let end = (ra + piece / 3 + 1).min(len);
            ra += sa.read(&a, &mut got_a[ra..end]).unwrap();
        }
        assert!(got_a == src && got_b == src);
    }

    /// A peer that does not seal, or a byte changed on the way, ends the link with a reason.
    #[test]
    fn unsealed_or_altered_bytes_end_the_link() {
        let (a, b) = pair();
        let k = session_keys(b"s", &[1; 32], &[2; 32], false);
        let mut sb = Sealed::new(&k);
        (&a).write_all(b"plain bytes, not a record").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let e = sb.read(&b, &mut [0u8; 64]).unwrap_err();
        assert!(e.contains("not one we seal"), "{e}");

        let (a, b) = pair();
        let ka = session_keys(b"s", &[1; 32], &[2; 32], true);
        let mut sealer = Sealer::new(&ka.send);
        let mut rec = Vec::new();
        sealer.seal_into(b"collective data", &mut rec).unwrap();
        rec[7] ^= 0x20;
        (&a).write_all(&rec).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut sb = Sealed::new(&k);
        let e = sb.read(&b, &mut [0u8; 64]).unwrap_err();
        assert!(e.contains("integrity check"), "{e}");
    }
}
