//! The proxy queue's ring (abi.h `ferrocomm_proxy_queue`) as the host sees it: a consumer for
//! the proxy thread, and producers for host code, which speak the same protocol as the device
//! producer in device-api (impl/proxy.cuh). The ring's words may live in ordinary memory (host
//! producers) or in host-pinned memory mapped into a GPU (kernel producers); either way the
//! host touches them only through these atomics.

use super::descriptor::{parity, PARITY_BIT};
use crate::contracts::config;
use crate::contracts::error::{Error, Result};
use crate::net::links::{back_off, SPIN_ROUNDS};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The words of one queue that the consumer touches, by host address. Producers' `head` is
/// not among them: a kernel's queue keeps it in device memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ring {
    /// `2 * capacity` words.
    pub slots: *const AtomicU64,
    pub tail: *const AtomicU64,
    pub done: *const AtomicU64,
    pub capacity: u64,
}

// SAFETY: the words are atomics in memory that outlives every user of the ring (its owner joins
// the proxy thread and producers before freeing it).
unsafe impl Send for Ring {}
// SAFETY: as for Send; `&Ring` reaches the memory only through those atomics.
unsafe impl Sync for Ring {}

impl Ring {
    fn word(&self, i: u64) -> &AtomicU64 {
        // SAFETY: i < 2 * capacity by construction at every call.
        unsafe { &*self.slots.add(i as usize) }
    }
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: valid for the ring's life (see `Send`).
        unsafe { &*self.tail }
    }
    fn done(&self) -> &AtomicU64 {
        // SAFETY: as above.
        unsafe { &*self.done }
    }
    fn slot(&self, ticket: u64) -> u64 {
        2 * (ticket & (self.capacity - 1))
    }
}

/// A ring in ordinary host memory, for host producers: head, tail and done each on their own
/// cache line, then the slots.
pub(crate) struct HostRing {
    words: Box<[AtomicU64]>,
    capacity: u64,
}

const LINE: usize = 8; // words per 64-byte line

impl HostRing {
    pub(crate) fn new(capacity: usize) -> Result<HostRing> {
        if !capacity.is_power_of_two() || capacity < 2 {
            return Err(Error::invalid(
                "proxy queue",
                format!("capacity {capacity} is not a power of two >= 2"),
            ));
        }
        let words = (0..3 * LINE + 2 * capacity).map(|_| AtomicU64::new(0)).collect();
        Ok(HostRing {
            words,
            capacity: capacity as u64,
        })
    }

    /// Tickets taken by producers.
    fn head(&self) -> &AtomicU64 {
        &self.words[0]
    }

    pub(crate) fn ring(&self) -> Ring {
        let base = self.words.as_ptr();
        // SAFETY: all offsets lie inside `words`.
        unsafe {
            Ring {
                tail: base.add(LINE),
                done: base.add(2 * LINE),
                slots: base.add(3 * LINE),
                capacity: self.capacity,
            }
        }
    }
}

/// The proxy's end: pops descriptors in ticket order.
pub(crate) struct Consumer {
    ring: Ring,
    next: u64,
}

impl Consumer {
    pub(crate) fn new(ring: Ring) -> Consumer {
        Consumer { ring, next: 0 }
    }

    /// The next descriptor's words if its producer has published it. Its slot stays taken
    /// until `release`: the consumer first copies what the descriptor names (a put's source).
    pub(crate) fn pop(&mut self) -> Option<[u64; 2]> {
        let r = &self.ring;
        let at = r.slot(self.next);
        // Acquire pairs with the producer's release of word 0: word 1 is then complete.
        let w0 = r.word(at).load(Ordering::Acquire);
        if w0 >> PARITY_BIT != parity(self.next, r.capacity) {
            return None;
        }
        let w1 = r.word(at + 1).load(Ordering::Relaxed);
        self.next += 1;
        Some([w0 & !(1 << PARITY_BIT), w1])
    }

    /// Publishes that everything popped is consumed: its slot may be reused and, for a put,
    /// its source bytes have been copied (the producer may overwrite them).
    pub(crate) fn release(&self) {
        // Release: our reads of the slot and the source happen before a producer, seeing the
        // new tail, reuses either.
        self.ring.tail().store(self.next, Ordering::Release);
    }

    /// Tickets popped so far.
    pub(crate) fn popped(&self) -> u64 {
        self.next
    }

    /// Publishes that the first `count` descriptors are complete at their targets.
    pub(crate) fn complete(&self, count: u64) {
        self.ring.done().store(count, Ordering::Release);
    }
}

/// The proxy's idle policy: spin for `poll_for` after the last descriptor, then sleep in short
/// steps. A sleep costs tens of microseconds of pickup latency (timer slack), so the polling
/// window decides how long a quiet queue stays fast; `FERROCOMM_PROXY_POLL_US` sets it
/// (default 2000 with 4 or more cores, else 0). The window spins
/// rather than yields: measured on Linux (docs/results/net.md), a thread that had yielded, even
/// once every 64 polls, then woke ~2 ms late from its next sleeps beside a busy thread.
pub(crate) struct Idle {
    rounds: u32,
    since: Instant,
    poll_for: Duration,
}

impl Idle {
    pub(crate) fn new(poll_for: Duration) -> Idle {
        Idle {
            rounds: 0,
            since: Instant::now(),
            poll_for,
        }
    }

    /// The process's `FERROCOMM_PROXY_POLL_US` ([`config::current`]): proxies are started
    /// where no communicator's options are at hand (the benchmark's pickup measurement).
    pub(crate) fn from_config() -> Result<Idle> {
        // A spinning proxy needs a core of its own: on small hosts it would take turns with the
        // rank's own spinning threads (measured: 1 ms per queued put on 2 cores).
        let spare_cores = std::thread::available_parallelism().map_or(1, |n| n.get()) >= 4;
        let us = config::current()?
            .proxy_poll_us
            .unwrap_or(if spare_cores { 2000 } else { 0 });
        Ok(Idle::new(Duration::from_micros(us)))
    }

    /// Work arrived.
    pub(crate) fn reset(&mut self) {
        self.rounds = 0;
    }

    /// Nothing to do: wait a little.
    pub(crate) fn wait(&mut self) {
        if self.rounds == 0 {
            self.since = Instant::now();
        }
        self.rounds = self.rounds.saturating_add(1);
        // The clock is read only after a few polls: a busy queue never pays for it.
        if self.rounds < 64 || self.since.elapsed() < self.poll_for {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// Host producers' protocol, the same as a kernel's: ticket, back-pressure, word 1, release of
/// word 0. `failed` is polled while waiting so that a dead proxy ends the wait early.
pub(crate) fn push(
    host: &HostRing,
    words: [u64; 2],
    timeout: Duration,
    failed: &dyn Fn() -> Option<Error>,
) -> Result<u64> {
    let ticket = host.head().fetch_add(1, Ordering::Relaxed);
    let ring = host.ring();
    // Acquire pairs with the consumer's release of tail: its reads of the slot are over.
    let free = || ticket - ring.tail().load(Ordering::Acquire) < ring.capacity;
    bounded_wait("proxy queue push (queue full)", timeout, failed, free)?;
    let at = ring.slot(ticket);
    ring.word(at + 1).store(words[1], Ordering::Relaxed);
    let w0 = words[0] | (parity(ticket, ring.capacity) << PARITY_BIT);
    ring.word(at).store(w0, Ordering::Release);
    Ok(ticket)
}

/// Waits until the consumer has released `ticket`: a put's source may then be overwritten.
pub(crate) fn wait_consumed(
    host: &HostRing,
    ticket: u64,
    timeout: Duration,
    failed: &dyn Fn() -> Option<Error>,
) -> Result<()> {
    let ring = host.ring();
    bounded_wait("proxy queue put (source still in use)", timeout, failed, || {
        ring.tail().load(Ordering::Acquire) > ticket
    })
}

/// Waits until every descriptor taken before this call is complete at its target.
pub(crate) fn wait_done(host: &HostRing, timeout: Duration, failed: &dyn Fn() -> Option<Error>) -> Result<()> {
    let target = host.head().load(Ordering::Acquire);
    let ring = host.ring();
    bounded_wait("proxy queue flush", timeout, failed, || {
        ring.done().load(Ordering::Acquire) >= target
    })
}

/// Waits until `ready`, at most `timeout`, ending early with the error `failed` reports.
fn bounded_wait(
    op: &'static str,
    timeout: Duration,
    failed: &dyn Fn() -> Option<Error>,
    ready: impl Fn() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut round = 0u32;
    while !ready() {
        if let Some(e) = failed() {
            return Err(e);
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                op,
                peer: None,
                after: timeout,
            });
        }
        back_off(round, SPIN_ROUNDS);
        round = round.saturating_add(1);
    }
    Ok(())
}

/// Queue-to-proxy pickup latency, for ferrocomm-bench: a host producer stamps each descriptor
/// and a consumer thread, polling as the proxy does (`Consumer::pop`, then `Idle::wait` when
/// idle), measures how long it sat in the ring. One descriptor in flight at a time; `gap`
/// between them lets the consumer fall idle (zero: it is always spinning).
pub fn measure_pickup(samples: usize, gap: Duration) -> Result<Vec<Duration>> {
    let ring = HostRing::new(1024)?;
    let r = ring.ring();
    let base = Instant::now();
    let stamp = move || base.elapsed().as_nanos() as u64;
    let mut idle = Idle::from_config()?;
    std::thread::scope(|s| {
        let consumer = s.spawn(move || {
            let (mut c, mut out) = (Consumer::new(r), Vec::with_capacity(samples));
            while out.len() < samples {
                match c.pop() {
                    Some(w) => {
                        out.push(Duration::from_nanos(stamp().saturating_sub(w[1])));
                        c.release();
                        idle.reset();
                    }
                    None => idle.wait(),
                }
            }
            out
        });
        for i in 0..samples as u64 {
            if !gap.is_zero() {
                std::thread::sleep(gap);
            }
            push(&ring, [0, stamp()], Duration::from_secs(10), &|| None)?;
            while r.tail().load(Ordering::Acquire) <= i {
                std::hint::spin_loop();
            }
        }
        consumer
            .join()
            .map_err(|_| Error::protocol("pickup benchmark", "consumer panicked"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn never() -> Option<Error> {
        None
    }

    #[test]
    fn many_producers_one_consumer_over_many_laps() {
        // 4 producers x 5000 descriptors through 16 slots: ~1250 laps, constant back-pressure.
        let ring = Arc::new(HostRing::new(16).unwrap());
        let (producers, each) = (4u64, 5000u64);
        std::thread::scope(|s| {
            for p in 0..producers {
                let ring = ring.clone();
                s.spawn(move || {
                    for i in 0..each {
                        // Word 0 carries the producer in bits 32.., word 1 the sequence number.
                        push(
                            &ring,
                            [(p << 32) | i, i.wrapping_mul(0x9e37_79b9)],
                            Duration::from_secs(60),
                            &never,
                        )
                        .unwrap();
                    }
                });
            }
            let mut c = Consumer::new(ring.ring());
            let mut next = vec![0u64; producers as usize];
            let start = Instant::now();
            while c.popped() < producers * each {
                assert!(start.elapsed() < Duration::from_secs(60), "consumer starved");
                let Some(w) = c.pop() else { continue };
                c.release();
                let (p, i) = ((w[0] >> 32) as usize, w[0] & 0xffff_ffff);
                // Each producer's descriptors arrive whole and in its own order.
                assert_eq!(i, next[p], "producer {p}");
                assert_eq!(w[1], i.wrapping_mul(0x9e37_79b9));
                next[p] += 1;
            }
            assert!(c.pop().is_none());
        });
    }

    #[test]
    fn a_full_queue_times_out_and_flush_waits_for_done() {
        let ring = HostRing::new(2).unwrap();
        let r = ring.ring();
        let soon = || Duration::from_millis(50);
        push(&ring, [1, 1], soon(), &never).unwrap();
        push(&ring, [2, 2], soon(), &never).unwrap();
        let e = push(&ring, [3, 3], soon(), &never).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        // The consumer sees the two published ones; flush waits until they are done.
        let mut c = Consumer::new(r);
        assert_eq!(c.pop(), Some([1, 1]));
        assert!(matches!(wait_done(&ring, soon(), &never), Err(Error::Timeout { .. })));
        c.complete(c.popped());
        assert_eq!(c.pop(), Some([2, 2]));
        // The timed-out push took ticket 2 and never published it: the consumer waits there.
        assert_eq!(c.pop(), None);
        let lost = || Some(Error::protocol("proxy", "gone"));
        assert!(matches!(wait_done(&ring, soon(), &lost), Err(Error::Protocol { .. })));
    }

    #[test]
    fn stale_slots_from_the_last_lap_are_not_read_again() {
        let ring = HostRing::new(2).unwrap();
        let r = ring.ring();
        let far = Duration::from_secs(5);
        let mut c = Consumer::new(r);
        for i in 0..10u64 {
            push(&ring, [i, i], far, &never).unwrap();
            assert_eq!(c.pop(), Some([i, i]));
            c.release();
            assert_eq!(c.pop(), None, "slot of ticket {} read twice", i);
        }
    }

    #[test]
    fn a_put_source_is_free_only_once_the_consumer_releases_it() {
        let ring = HostRing::new(4).unwrap();
        let soon = Duration::from_millis(30);
        let ticket = push(&ring, [7, 7], soon, &never).unwrap();
        let mut c = Consumer::new(ring.ring());
        assert!(wait_consumed(&ring, ticket, soon, &never).is_err(), "not even popped");
        assert_eq!(c.pop(), Some([7, 7]));
        let e = wait_consumed(&ring, ticket, soon, &never).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "popped, source not yet copied: {e}");
        c.release();
        wait_consumed(&ring, ticket, soon, &never).unwrap();
    }

    #[test]
    fn capacity_must_be_a_power_of_two() {
        assert!(HostRing::new(12).is_err());
        assert!(HostRing::new(1).is_err());
    }
}
