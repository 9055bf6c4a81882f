//! A link: one origin's ordered channel of one-sided operations to one target's window, over
//! some transport (tcp.rs always; rdma.rs with the `rdma` feature). Host calls on a window and
//! the proxy thread draining a kernel's queue share the same links, so there is one network
//! path, whoever issues the operation.

use crate::contracts::error::Result;
use crate::contracts::window::SignalOp;
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

/// A link whose data, signals and flushes ride on a fast transport (RDMA) while its atomics go
/// to the home rank's window server over the TCP link beside it: a NIC's atomics are atomic
/// only among themselves, the server's are atomic with the home rank's own
/// (docs/memory-model.md, rule 4). Every request is complete at the target when its call
/// returns (both transports wait), so the two paths stay in issue order.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) struct AtomicsAtHome {
    pub fast: Box<dyn Link>,
    /// Also what keeps the connection that tells the target's server we are alive.
    pub home: std::sync::Arc<SharedLink>,
}

impl Link for AtomicsAtHome {
    fn transport(&self) -> &'static str {
        self.fast.transport()
    }
    fn put(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.fast.put(offset, src)
    }
    fn get(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.fast.get(offset, dst)
    }
    fn signal(&mut self, id: usize, op: SignalOp, value: u64) -> Result<()> {
        self.fast.signal(id, op, value)
    }
    fn fetch_add(&mut self, offset: usize, value: u64) -> Result<u64> {
        self.fast.flush()?;
        self.home.lock(true).fetch_add(offset, value)
    }
    fn compare_swap(&mut self, offset: usize, expected: u64, desired: u64) -> Result<u64> {
        self.fast.flush()?;
        self.home.lock(true).compare_swap(offset, expected, desired)
    }
    fn flush(&mut self) -> Result<()> {
        self.fast.flush()?;
        self.home.flush_if_dirty()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tcp;
    use super::*;
    use std::sync::Arc;

    /// Two targets stand for the two paths, so each operation shows which one carried it:
    /// data, gets and signals the fast one, atomics the home one.
    #[test]
    fn atomics_take_the_home_link_and_everything_else_the_fast_one() {
        let (mut fast_data, mut fast_pad) = (vec![0u64; 8], vec![0u64; 4]);
        let (mut home_data, mut home_pad) = (vec![0u64; 8], vec![0u64; 4]);
        home_data[3] = 40;
        let (fast, fast_server) = tcp::loopback(1, &mut fast_data, &mut fast_pad);
        let (home, home_server) = tcp::loopback(1, &mut home_data, &mut home_pad);
        let mut link = AtomicsAtHome {
            fast: Box::new(fast),
            home: Arc::new(SharedLink::new(Box::new(home))),
        };
        link.put(8, &7u64.to_ne_bytes()).unwrap();
        link.signal(1, SignalOp::Add, 5).unwrap();
        assert_eq!(link.fetch_add(24, 2).unwrap(), 40);
        assert_eq!(link.compare_swap(24, 42, 9).unwrap(), 42);
        let mut back = [0u8; 8];
        link.get(8, &mut back).unwrap();
        assert_eq!(u64::from_ne_bytes(back), 7);
        link.flush().unwrap();
        drop(link);
        fast_server.join().unwrap();
        home_server.join().unwrap();
        assert_eq!((fast_data[1], fast_data[3]), (7, 0), "the put went fast, no atomic did");
        assert_eq!(fast_pad[3], 5, "signal 1 from rank 1: slot [1][1]");
        assert_eq!(
            (home_data[1], home_data[3]),
            (0, 9),
            "the atomics ran at home, the put did not"
        );
        assert!(home_pad.iter().all(|&w| w == 0));
    }
}
