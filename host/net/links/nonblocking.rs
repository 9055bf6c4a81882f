//! The outcome of one system call on a non-blocking TCP socket, as the links count it: bytes
//! moved (0: the socket cannot take or give any now), or why the connection is gone.

use std::io::{ErrorKind, Result};

/// A send: bytes taken, 0 where the socket's buffer is full, or why the connection is gone.
pub(super) fn sent(r: Result<usize>) -> std::result::Result<usize, String> {
    match r {
        Ok(n) => Ok(n),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(0),
        Err(e) => Err(format!("connection lost while sending: {e}")),
    }
}

/// A receive: bytes read, 0 where none has arrived, or why the connection is gone (the peer
/// closing it among the reasons: a read of 0 bytes into a non-empty buffer).
pub(super) fn received(r: Result<usize>) -> std::result::Result<usize, String> {
    match r {
        Ok(0) => Err("connection closed by peer".into()),
        Ok(n) => Ok(n),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(0),
        Err(e) => Err(format!("connection lost while receiving: {e}")),
    }
}

/// Two connected non-blocking sockets over loopback.
#[cfg(test)]
pub(super) fn loopback_pair() -> (std::net::TcpStream, std::net::TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    (a, b)
}
