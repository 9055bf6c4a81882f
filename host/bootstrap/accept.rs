//! Accepting on a non-blocking listener until a deadline: shared by the TCP link listener and
//! the descriptor socket, so both time out the same way and report how long they waited.

use crate::contracts::error::{Error, Result};
use std::time::{Duration, Instant};

/// Calls `accept` (on a non-blocking listener) until it yields a connection, fails, or
/// `deadline` passes (`Error::Timeout` naming `op`). `context` names the listener in I/O errors.
pub(crate) fn accept_until<S>(
    mut accept: impl FnMut() -> std::io::Result<S>,
    deadline: Instant,
    op: &'static str,
    context: &str,
) -> Result<S> {
    let started = Instant::now();
    loop {
        match accept() {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        op,
                        peer: None,
                        after: started.elapsed(),
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(Error::io(context.to_owned(), e)),
        }
    }
}
