//! TCP links between ranks on different hosts: one non-blocking stream per peer pair.

use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;

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
