//! Length-prefixed frames and a small field codec for the store protocol. Decoding checks every
//! length against what is left, so a malformed frame is an error, never a panic or a huge
//! allocation.

use crate::contracts::error::{Error, Result};
use std::io::{Read, Write};

/// The default cap on one store frame (keys and values are small rendezvous data).
pub const DEFAULT_MAX_FRAME: u32 = 16 << 20;

pub(crate) fn write_frame(w: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)
}

/// Reads one frame; `Ok(None)` on a clean end of stream before the length.
pub(crate) fn read_frame(r: &mut impl Read, max: u32, context: &'static str) -> Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::io(context, e)),
    }
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(Error::FrameTooLarge {
            context,
            size: len as u64,
            max: max as u64,
        });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).map_err(|e| Error::io(context, e))?;
    Ok(Some(body))
}

/// Builds a frame body field by field.
#[derive(Default)]
pub(crate) struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(&(v.len() as u32).to_le_bytes());
        self.0.extend_from_slice(v);
        self
    }
}

/// Reads fields back, failing on anything short or malformed.
pub(crate) struct Dec<'a> {
    buf: &'a [u8],
}

impl<'a> Dec<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Dec { buf }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(Error::protocol(
                "store frame",
                format!("truncated: needed {n} more bytes, {} left", self.buf.len()),
            ));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let b = self.take(4)?;
        let n = u32::from_le_bytes(b.try_into().unwrap_or([0; 4])) as usize;
        self.take(n)
    }
    pub fn str(&mut self) -> Result<&'a str> {
        std::str::from_utf8(self.bytes()?).map_err(|_| Error::protocol("store frame", "key is not UTF-8"))
    }
    pub fn finish(&self) -> Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(Error::protocol(
                "store frame",
                format!("{} trailing bytes", self.buf.len()),
            ))
        }
    }
}
