//! Sealed records: AES-256-GCM over a byte stream, for traffic that leaves the host. Each
//! direction of a connection has its own key, derived from the shared secret and both sides'
//! handshake nonces (so every connection's keys are fresh), and numbers its records from 0: a
//! record that is altered, dropped, replayed or reordered fails to open.
//!
//! A record on the wire is `len: u32 LE` (of what follows), the ciphertext, then the 16-byte
//! tag; the length is authenticated too.

use crate::contracts::error::{Error, Result};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

/// The most plaintext one record carries: large enough that the per-record cost (a length,
/// a tag, a nonce) vanishes, small enough to bound the buffers.
pub(crate) const RECORD_PLAIN_MAX: usize = 64 << 10;
pub(crate) const TAG_BYTES: usize = 16;
pub(crate) const LEN_BYTES: usize = 4;

/// The two keys of one connection, from one side's point of view.
#[derive(Clone)]
pub(crate) struct SessionKeys {
    pub send: [u8; 32],
    pub recv: [u8; 32],
}

/// Keys for a connection whose handshake used `listener_nonce` and `dialler_nonce` under
/// `secret`; `dialler` says which side we are.
pub(crate) fn session_keys(secret: &[u8], listener_nonce: &[u8], dialler_nonce: &[u8], dialler: bool) -> SessionKeys {
    let label = |dir: &str| {
        let mut l = format!("session {dir} ").into_bytes();
        l.extend_from_slice(listener_nonce);
        l.extend_from_slice(dialler_nonce);
        // Nonces are bytes; the label only has to be unique, not text.
        super::auth::derive(secret, &l)
    };
    let (to_listener, to_dialler) = (label("to-listener"), label("to-dialler"));
    if dialler {
        SessionKeys {
            send: to_listener,
            recv: to_dialler,
        }
    } else {
        SessionKeys {
            send: to_dialler,
            recv: to_listener,
        }
    }
}

/// Record `counter`'s nonce: each key seals each counter once (keys are per connection and
/// direction), which is all AES-GCM asks.
fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

fn cipher(key: &[u8; 32]) -> LessSafeKey {
    // A 32-byte key is what AES-256 takes, so this cannot fail.
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).unwrap_or_else(|_| unreachable!()))
}

/// Seals records in one direction.
pub(crate) struct Sealer {
    cipher: LessSafeKey,
    counter: u64,
}

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKeys(..)") // never print keys
    }
}

impl Sealer {
    pub fn new(key: &[u8; 32]) -> Sealer {
        Sealer {
            cipher: cipher(key),
            counter: 0,
        }
    }

    /// Appends one record sealing `plain` (at most [`RECORD_PLAIN_MAX`] bytes) to `out`.
    pub fn seal_into(&mut self, plain: &[u8], out: &mut Vec<u8>) -> Result<()> {
        debug_assert!(plain.len() <= RECORD_PLAIN_MAX);
        let len = ((plain.len() + TAG_BYTES) as u32).to_le_bytes();
        let start = out.len();
        out.extend_from_slice(&len);
        out.extend_from_slice(plain);
        let tag = self
            .cipher
            .seal_in_place_separate_tag(nonce(self.counter), Aad::from(len), &mut out[start + LEN_BYTES..])
            .map_err(|_| Error::protocol("sealed stream", "cannot seal a record"))?;
        self.counter += 1;
        out.extend_from_slice(tag.as_ref());
        Ok(())
    }
}

/// Opens records in one direction, in order.
pub(crate) struct Opener {
    cipher: LessSafeKey,
    counter: u64,
}

impl Opener {
    pub fn new(key: &[u8; 32]) -> Opener {
        Opener {
            cipher: cipher(key),
            counter: 0,
        }
    }

    /// The length of the record at the front of `buf` (header included), once its header is
    /// there; `Err` for a length no sealer makes.
    pub fn record_len(buf: &[u8]) -> Result<Option<usize>> {
        if buf.len() < LEN_BYTES {
            return Ok(None);
        }
        let body = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if !(TAG_BYTES..=RECORD_PLAIN_MAX + TAG_BYTES).contains(&body) {
            return Err(Error::protocol(
                "sealed stream",
                format!("a record of {body} bytes: not one we seal (tampered, or the peer does not seal)"),
            ));
        }
        Ok(Some(LEN_BYTES + body))
    }

    /// Opens the whole record `rec` (header included) in place; returns its plaintext, which
    /// starts at `rec[LEN_BYTES..]`. `Err` when it was altered, replayed or reordered.
    pub fn open<'a>(&mut self, rec: &'a mut [u8]) -> Result<&'a [u8]> {
        let (head, rest) = rec.split_at_mut(LEN_BYTES);
        let aad = [head[0], head[1], head[2], head[3]];
        let body = self
            .cipher
            .open_in_place(nonce(self.counter), Aad::from(aad), rest)
            .map_err(|_| {
                Error::protocol(
                    "sealed stream",
                    "a record failed its integrity check (altered, replayed or reordered on the way, or the keys differ)",
                )
            })?;
        self.counter += 1;
        Ok(&*body)
    }
}

/// A blocking stream whose traffic is sealed, or passed through where no keys are given: what
/// blocking users (window servers and their origins, the store) read and write instead of the
/// socket. Each `write` seals one record; `read` opens whole records and hands out their
/// plaintext.
pub(crate) struct SealedStream<S> {
    inner: S,
    seal: Option<Box<Seal>>,
}

struct Seal {
    sealer: Sealer,
    opener: Opener,
    record: Vec<u8>,
    /// The opened record's plaintext not yet read: `record[at..to]`.
    at: usize,
    to: usize,
}

impl<S> SealedStream<S> {
    /// `inner` as it is, unsealed.
    pub fn plain(inner: S) -> SealedStream<S> {
        SealedStream { inner, seal: None }
    }

    /// `inner` sealed with `keys`.
    pub fn sealed(inner: S, keys: &SessionKeys) -> SealedStream<S> {
        SealedStream {
            inner,
            seal: Some(Box::new(Seal {
                sealer: Sealer::new(&keys.send),
                opener: Opener::new(&keys.recv),
                record: Vec::new(),
                at: 0,
                to: 0,
            })),
        }
    }

    /// The underlying stream (to set timeouts or shut it down).
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

fn broken(e: Error) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

impl<S: std::io::Write> std::io::Write for SealedStream<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let Some(seal) = &mut self.seal else {
            return self.inner.write(buf);
        };
        if buf.is_empty() {
            return Ok(0);
        }
        let n = buf.len().min(RECORD_PLAIN_MAX);
        let mut out = Vec::with_capacity(n + LEN_BYTES + TAG_BYTES);
        seal.sealer.seal_into(&buf[..n], &mut out).map_err(broken)?;
        // A record is written whole or the stream is broken: a timeout mid-record leaves the
        // peer unable to open anything after it, which the caller reports as the link's loss.
        self.inner.write_all(&out)?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<S: std::io::Read> std::io::Read for SealedStream<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let Some(seal) = &mut self.seal else {
            return self.inner.read(buf);
        };
        if buf.is_empty() {
            return Ok(0);
        }
        while seal.at == seal.to {
            let mut head = [0u8; LEN_BYTES];
            // A clean end before a record is the peer closing; within one, an error.
            match self.inner.read(&mut head[..1])? {
                0 => return Ok(0),
                _ => self.inner.read_exact(&mut head[1..])?,
            }
            let len = Opener::record_len(&head).map_err(broken)?.unwrap_or(LEN_BYTES);
            seal.record.clear();
            seal.record.extend_from_slice(&head);
            seal.record.resize(len, 0);
            self.inner.read_exact(&mut seal.record[LEN_BYTES..])?;
            let plain = seal.opener.open(&mut seal.record).map_err(broken)?.len();
            (seal.at, seal.to) = (LEN_BYTES, LEN_BYTES + plain);
        }
        let n = buf.len().min(seal.to - seal.at);
        buf[..n].copy_from_slice(&seal.record[seal.at..seal.at + n]);
        seal.at += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_open_in_order_and_any_change_is_caught() {
        let a = session_keys(b"secret", &[1; 32], &[2; 32], true);
        let b = session_keys(b"secret", &[1; 32], &[2; 32], false);
        assert_eq!(a.send, b.recv);
        assert_eq!(a.recv, b.send);
        assert_ne!(a.send, a.recv);
        assert_ne!(
            session_keys(b"secret", &[1; 32], &[3; 32], true).send,
            a.send,
            "fresh per connection"
        );

        let (mut s, mut o) = (Sealer::new(&a.send), Opener::new(&b.recv));
        let mut wire = Vec::new();
        s.seal_into(b"first", &mut wire).unwrap();
        s.seal_into(b"second record", &mut wire).unwrap();
        assert!(
            !wire.windows(5).any(|w| w == b"first"),
            "the plaintext is not on the wire"
        );
        let n = Opener::record_len(&wire).unwrap().unwrap();
        let (r1, r2) = wire.split_at_mut(n);
        let (mut r1c, mut r2c) = (r1.to_vec(), r2.to_vec());
        // Out of order: the second record cannot be opened first.
        assert!(o.open(&mut r2c.clone()).is_err());
        assert_eq!(o.open(&mut r1c).unwrap(), b"first");
        // A flipped bit anywhere (length, body, tag) is caught.
        for i in 0..r2.len() {
            let mut bad = r2.to_vec();
            bad[i] ^= 1;
            let len_ok = Opener::record_len(&bad).map(|l| l == Some(bad.len())).unwrap_or(false);
            let mut fresh = Opener::new(&b.recv);
            fresh.open(&mut r1.to_vec()).unwrap();
            assert!(!len_ok || fresh.open(&mut bad).is_err(), "byte {i}");
        }
        assert_eq!(o.open(&mut r2c).unwrap(), b"second record");
        // A replay of the first record is caught.
        assert!(o.open(&mut r1.to_vec()).is_err());
        assert!(Opener::record_len(&[0xff, 0xff, 0xff, 0x7f]).is_err());
    }

    /// Writes and reads of any size through a sealed pair of streams come out whole and in
    /// order, in either direction; the plain form passes bytes through.
    #[test]
    fn a_sealed_stream_carries_writes_of_any_size() {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let (ka, kb) = (
            session_keys(b"k", &[5; 32], &[6; 32], true),
            session_keys(b"k", &[5; 32], &[6; 32], false),
        );
        let sizes = [1usize, 32, 7, RECORD_PLAIN_MAX, RECORD_PLAIN_MAX + 1, 300_000, 0, 5];
        let data: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&n| (0..n).map(|i| (i * 13 + n) as u8).collect())
            .collect();
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            let mut w = SealedStream::sealed(a, &ka);
            for d in &sent {
                w.write_all(d).unwrap();
            }
        });
        let mut r = SealedStream::sealed(b, &kb);
        for d in &data {
            let mut got = vec![0u8; d.len()];
            r.read_exact(&mut got).unwrap();
            assert_eq!(&got, d);
        }
        writer.join().unwrap();
        assert_eq!(r.read(&mut [0u8; 4]).unwrap(), 0, "a clean end after the last record");
    }
}
