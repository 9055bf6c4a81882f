//! The proxy thread: drains one window's queue in ticket order, runs each descriptor on the
//! link to its target, and publishes completion. A put's source bytes are copied out of this
//! rank's window data (host memory, or GPU memory by a device-to-host copy) into a staging
//! buffer first, so a link only ever sees ordinary host bytes; the slot is released (`tail`)
//! only after that copy, so a producer that waits for it may then overwrite its source.

use super::descriptor::{Descriptor, Limits};
use super::fifo::{Consumer, Idle, Ring};
use super::link::SharedLink;
use crate::contracts::error::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// This rank's window data, as the proxy reads put sources.
pub(crate) trait LocalData: Send {
    /// Copies `dst.len()` bytes at `offset` (in bounds: checked by the descriptor) into `dst`.
    fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<()>;
}

/// Window data in host memory.
pub(crate) struct HostData(pub *const u8);

// SAFETY: the window's memory outlives its proxy thread (the window joins it before freeing).
unsafe impl Send for HostData {}

impl LocalData for HostData {
    fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        // SAFETY: in bounds (see the trait); a raw copy, as every access to window memory.
        unsafe { std::ptr::copy_nonoverlapping(self.0.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

/// What the proxy thread works with.
pub(crate) struct Plan {
    pub ring: Ring,
    /// Per rank: the link when the rank is reached through this queue.
    pub links: Vec<Option<Arc<SharedLink>>>,
    pub data: Box<dyn LocalData>,
    pub limits: Limits,
    /// CPUs to run on (near the GPU whose memory the queue lives in); `None`: anywhere.
    pub cpus: Option<Vec<usize>>,
}

/// Descriptors run since the last completion before the proxy completes them anyway, so a
/// producer that never lets the queue go idle still sees `done` advance.
const COMPLETE_EVERY: u64 = 256;

pub(crate) struct Proxy {
    stop: Arc<AtomicBool>,
    error: Arc<Mutex<Option<Error>>>,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    pub(crate) fn start(plan: Plan) -> Result<Proxy> {
        let stop = Arc::new(AtomicBool::new(false));
        let error = Arc::new(Mutex::new(None));
        let (s, e) = (stop.clone(), error.clone());
        let idle = Idle::from_config()?;
        let thread = std::thread::Builder::new()
            .name("ferrocomm-proxy".into())
            .spawn(move || run(plan, idle, &s, &e))
            .map_err(|e| Error::io("starting the proxy thread", e))?;
        Ok(Proxy {
            stop,
            error,
            thread: Some(thread),
        })
    }

    /// The first error the proxy met since the last call (a lost link, a malformed
    /// descriptor); taking it leaves the queue usable.
    pub(crate) fn take_error(&self) -> Option<Error> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // The thread drains what is published, then stops.
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut plan: Plan, mut idle: Idle, stop: &AtomicBool, error: &Mutex<Option<Error>>) {
    if let Some(cpus) = &plan.cpus {
        match super::proxy_affinity::pin_current_thread(cpus) {
            Ok(()) => tracing::debug!(?cpus, "proxy thread pinned near its GPU"),
            Err(e) => tracing::debug!("proxy thread left unpinned: {e}"),
        }
    }
    let mut consumer = Consumer::new(plan.ring);
    let mut staging = Vec::new();
    let mut completed = 0u64;
    let record = |e: Error| {
        tracing::debug!("proxy: {e}");
        error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
    };
    loop {
        if let Some(words) = consumer.pop() {
            idle.reset();
            let ready = prepare(&mut plan, words, &mut staging);
            // The put's source is in `staging` now: the producer may reuse it and the slot.
            consumer.release();
            if let Err(e) = ready.and_then(|(d, link)| send(d, &link, &staging)) {
                record(e);
            }
            if consumer.popped() - completed >= COMPLETE_EVERY {
                completed = complete(&plan, &consumer, &record);
            }
            continue;
        }
        if completed < consumer.popped() {
            completed = complete(&plan, &consumer, &record);
            continue;
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        idle.wait();
    }
}

/// Decodes a descriptor, finds its link and, for a put, copies the source into `staging`.
fn prepare(plan: &mut Plan, words: [u64; 2], staging: &mut Vec<u8>) -> Result<(Descriptor, Arc<SharedLink>)> {
    let d = Descriptor::decode(words, &plan.limits).map_err(|why| Error::protocol("proxy queue", why))?;
    let peer = match d {
        Descriptor::Put { peer, .. } | Descriptor::Signal { peer, .. } => peer,
    };
    let link = plan.links[peer].clone().ok_or_else(|| {
        Error::protocol(
            "proxy queue",
            format!("a descriptor for rank {peer}, which is reached by load/store, not through the proxy"),
        )
    })?;
    if let Descriptor::Put { src, bytes, .. } = d {
        staging.resize(bytes, 0);
        plan.data.read(src, staging)?;
    }
    Ok((d, link))
}

fn send(d: Descriptor, link: &SharedLink, staging: &[u8]) -> Result<()> {
    match d {
        Descriptor::Put { dst, .. } => link.lock(true).put(dst, staging),
        Descriptor::Signal { id, op, value, .. } => link.lock(true).signal(id, op, value),
    }
}

/// Flushes every link written since the last completion, then publishes the count. A failed
/// link still counts as complete (the error is recorded and flush reports it first).
fn complete(plan: &Plan, consumer: &Consumer, record: &dyn Fn(Error)) -> u64 {
    for link in plan.links.iter().flatten() {
        if let Err(e) = link.flush_if_dirty() {
            record(e);
        }
    }
    consumer.complete(consumer.popped());
    consumer.popped()
}

#[cfg(test)]
mod tests {
    use super::super::descriptor::{Descriptor, OP_SHIFT, PUT};
    use super::super::fifo::{self, HostRing};
    use super::super::tcp;
    use super::*;
    use std::time::Duration;

    /// A proxy whose one link goes to a server on this thread's loopback, applying to `target`.
    fn pipeline(source: &[u64], target: &mut [u64], pad: &mut [u64]) -> (HostRing, Proxy, std::thread::JoinHandle<()>) {
        let (link, server) = tcp::loopback(0, target, pad);
        let ring = HostRing::new(8).unwrap();
        let proxy = Proxy::start(Plan {
            ring: ring.ring(),
            links: vec![None, Some(Arc::new(SharedLink::new(Box::new(link))))],
            data: Box::new(HostData(source.as_ptr().cast())),
            limits: Limits {
                size: 2,
                bytes: source.len() * 8,
                signals: pad.len() / 2,
            },
            cpus: None,
        })
        .unwrap();
        (ring, proxy, server)
    }

    #[test]
    fn malformed_descriptors_become_errors_and_good_ones_still_run() {
        let source: Vec<u64> = (0..64).map(|i| i * 3 + 1).collect();
        let (mut target, mut pad) = (vec![0u64; 64], vec![0u64; 8]);
        let (ring, proxy, server) = pipeline(&source, &mut target, &mut pad);
        let t = Duration::from_secs(5);
        let none = || None;
        let put = |peer, dst, src, bytes| Descriptor::Put { peer, dst, src, bytes }.encode();
        fifo::push(&ring, [9 << OP_SHIFT, 0], t, &none).unwrap(); // unknown op
        fifo::push(&ring, put(0, 0, 0, 8), t, &none).unwrap(); // rank 0 is not behind the queue
        fifo::push(&ring, put(1, 8, 16, 64), t, &none).unwrap(); // good: words 2..10 -> 1..9
        fifo::push(&ring, [(PUT << OP_SHIFT) | (1 << 40) | 511, 8 << 40], t, &none).unwrap(); // leaves the window
        fifo::wait_done(&ring, t, &none).unwrap();
        let e = proxy.take_error().expect("the first bad descriptor is reported");
        assert!(e.to_string().contains("unknown descriptor op 9"), "{e}");
        assert!(proxy.take_error().is_none(), "only the first error is kept");
        drop(proxy);
        server.join().unwrap();
        assert_eq!(&target[1..9], &source[2..10]);
        assert!(
            target[0] == 0 && target[9..].iter().all(|&w| w == 0),
            "nothing else written"
        );
    }
}
