//! A link: one origin's ordered channel of one-sided operations to one target's window, over
//! some transport (tcp.rs always; rdma.rs with the `rdma` feature). Host calls on a window and
//! the proxy thread draining a kernel's queue share the same links, so there is one network
//! path, whoever issues the operation.

use crate::error::Result;
use crate::window::SignalOp;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Operations on the target's window, applied in issue order: a put followed by a signal on
/// the same link is visible at the target before the signal (docs/memory-model.md, rule 1).
pub(crate) trait Link: Send {
    /// Which transport carries it, for logs and errors.
    fn transport(&self) -> &'static str;
    fn put(&mut self, offset: usize, src: &[u8]) -> Result<()>;
    fn get(&mut self, offset: usize, dst: &mut [u8]) -> Result<()>;
    fn signal(&mut self, id: usize, op: SignalOp, value: u64) -> Result<()>;
    fn fetch_add(&mut self, offset: usize, value: u64) -> Result<u64>;
    fn compare_swap(&mut self, offset: usize, expected: u64, desired: u64) -> Result<u64>;
    /// Returns once everything issued before is complete at the target.
    fn flush(&mut self) -> Result<()>;
}

/// A link shared by the window's callers and its proxy thread.
pub(crate) struct SharedLink {
    link: Mutex<Box<dyn Link>>,
    /// Written since the last flush: a flush has work to do.
    dirty: AtomicBool,
}

impl SharedLink {
    pub(crate) fn new(link: Box<dyn Link>) -> SharedLink {
        SharedLink {
            link: Mutex::new(link),
            dirty: AtomicBool::new(false),
        }
    }

    /// The link, for an operation that `writes` (or only reads) the target.
    pub(crate) fn lock(&self, writes: bool) -> MutexGuard<'_, Box<dyn Link>> {
        if writes {
            self.dirty.store(true, Ordering::Relaxed);
        }
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Completes earlier writes at the target, if there were any since the last flush.
    pub(crate) fn flush_if_dirty(&self) -> Result<()> {
        if self.dirty.swap(false, Ordering::Relaxed) {
            self.lock(false).flush()?;
        }
        Ok(())
    }
}
