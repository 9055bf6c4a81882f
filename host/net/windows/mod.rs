//! The network path of windows: how one-sided operations reach ranks that cannot be mapped
//! (other hosts). Host calls run on a link (`link.rs`) to the target directly; kernels cannot,
//! so they push 16-byte descriptors into a queue (`fifo.rs`, format in [`descriptor`]) that a
//! proxy thread (`proxy.rs`) drains onto the same links. Transports: TCP (`tcp.rs`, always),
//! RDMA verbs (`rdma.rs`, with the feature of that name).
//!
//! [`QueueProducer`] is the host end of a window's queue: the same protocol a kernel speaks,
//! from Rust, so the whole kernel-to-network path runs (and is tested) without a GPU.
//!
//! May import: the contracts, bootstrap, links and the GPU wing (device windows' queue and
//! targets in GPU memory).

pub(crate) mod connections;
pub mod descriptor;
pub(crate) mod device_network;
pub(crate) mod device_queue;
pub(crate) mod fifo;
pub(crate) mod link;
pub(crate) mod proxy;
pub(crate) mod proxy_affinity;
#[cfg(feature = "rdma")]
pub(crate) mod rdma;
pub(crate) mod setup;
pub(crate) mod tcp;

use crate::contracts::error::{Error, Result};
use crate::contracts::window::SignalOp;
use descriptor::{Descriptor, Limits, MAX_PUT, MAX_WINDOW_BYTES};
use fifo::HostRing;
use link::SharedLink;
use proxy::{LocalData, Plan, Proxy};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

#[doc(hidden)]
pub use fifo::measure_pickup;

/// Slots of a host queue: enough for bursts of small puts without back-pressure.
const HOST_QUEUE_SLOTS: usize = 1024;

/// A queue in host memory with its proxy thread (a window's, created on first use). Opaque:
/// reach it through [`QueueProducer`].
pub struct HostQueue {
    // Field order: the proxy (which reads the ring) stops before the ring is freed.
    proxy: Proxy,
    ring: HostRing,
    limits: Limits,
    remote: Vec<bool>,
    timeout: Duration,
}

impl HostQueue {
    pub(crate) fn start(
        links: Vec<Option<Arc<SharedLink>>>,
        data: Box<dyn LocalData>,
        limits: Limits,
        timeout: Duration,
    ) -> Result<HostQueue> {
        if limits.bytes > MAX_WINDOW_BYTES {
            return Err(Error::invalid(
                "proxy queue",
                format!(
                    "a {}-byte window is larger than descriptors address (1 TiB)",
                    limits.bytes
                ),
            ));
        }
        let ring = HostRing::new(HOST_QUEUE_SLOTS)?;
        let remote = links.iter().map(Option::is_some).collect();
        for (rank, link) in links.iter().enumerate() {
            if let Some(l) = link {
                tracing::debug!(rank, transport = l.lock(false).transport(), "proxy queue: link");
            }
        }
        let proxy = Proxy::start(Plan {
            ring: ring.ring(),
            links,
            data,
            limits,
            cpus: None,
        })?;
        Ok(HostQueue {
            proxy,
            ring,
            limits,
            remote,
            timeout,
        })
    }
}

/// The host end of a window's proxy queue (`Window::proxy_queue`): puts and signals toward
/// ranks on other hosts, carried by the window's proxy thread exactly as a kernel's would be.
/// Every method checks its arguments before anything is queued.
/// It borrows the window: the proxy thread reads the window's memory, so no producer may
/// outlive it.
#[derive(Clone)]
pub struct QueueProducer<'w> {
    q: Arc<HostQueue>,
    window: PhantomData<&'w ()>,
}

impl QueueProducer<'_> {
    pub(crate) fn new(q: Arc<HostQueue>) -> Self {
        QueueProducer { q, window: PhantomData }
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        match self.q.remote.get(peer) {
            None => Err(Error::invalid(
                op,
                format!("rank {peer} is not in this window of {} ranks", self.q.remote.len()),
            )),
            Some(false) => Err(Error::invalid(
                op,
                format!("rank {peer} is reached by load/store, not through the proxy queue"),
            )),
            Some(true) => Ok(()),
        }
    }

    /// Queues `d`; returns its ticket.
    fn push(&self, d: Descriptor) -> Result<u64> {
        fifo::push(&self.q.ring, d.encode(), self.q.timeout, &|| self.q.proxy.take_error())
    }

    /// Queues a put of `bytes` from offset `src_offset` of this rank's window data to offset
    /// `dst_offset` of `peer`'s; it is visible there after a later signal or `flush`. Returns
    /// once the proxy has copied the source: its bytes may then change (as after any put).
    pub fn put(&self, peer: usize, dst_offset: usize, src_offset: usize, bytes: usize) -> Result<()> {
        self.check_peer("proxy put", peer)?;
        let size = self.q.limits.bytes;
        for (what, off) in [("destination", dst_offset), ("source", src_offset)] {
            if !matches!(off.checked_add(bytes), Some(end) if end <= size) {
                return Err(Error::invalid(
                    "proxy put",
                    format!("{what} range {off}..+{bytes} leaves the {size}-byte window"),
                ));
            }
        }
        let mut last = None;
        for start in (0..bytes).step_by(MAX_PUT) {
            let n = MAX_PUT.min(bytes - start);
            last = Some(self.push(Descriptor::Put {
                peer,
                dst: dst_offset + start,
                src: src_offset + start,
                bytes: n,
            })?);
        }
        // The proxy consumes in ticket order: the last chunk released means all were copied.
        match last {
            Some(t) => fifo::wait_consumed(&self.q.ring, t, self.q.timeout, &|| self.q.proxy.take_error()),
            None => Ok(()),
        }
    }

    /// Queues signal `id` of `peer` (our slot); it lands after every earlier put to `peer`.
    pub fn signal(&self, peer: usize, id: usize, op: SignalOp, value: u64) -> Result<()> {
        self.check_peer("proxy signal", peer)?;
        if id >= self.q.limits.signals {
            return Err(Error::invalid(
                "proxy signal",
                format!("signal id {id} of {}", self.q.limits.signals),
            ));
        }
        self.push(Descriptor::Signal { peer, id, op, value }).map(drop)
    }

    /// `put`, then `signal` to the same peer.
    #[allow(clippy::too_many_arguments)]
    pub fn put_signal(
        &self,
        peer: usize,
        dst_offset: usize,
        src_offset: usize,
        bytes: usize,
        id: usize,
        op: SignalOp,
        value: u64,
    ) -> Result<()> {
        self.put(peer, dst_offset, src_offset, bytes)?;
        self.signal(peer, id, op, value)
    }

    /// Waits until everything queued before this call is complete at its target, and reports
    /// the first error the proxy met since the last flush.
    pub fn flush(&self) -> Result<()> {
        fifo::wait_done(&self.q.ring, self.q.timeout, &|| self.q.proxy.take_error())?;
        match self.q.proxy.take_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Window memory that RDMA peers may access: kept registered while the window lives.
#[derive(Default)]
pub(crate) struct NetResources {
    #[cfg(feature = "rdma")]
    _regions: Vec<rdma::Region>,
}

/// Where a window's data and signal pad live, as the NIC must register them.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) enum WindowMemory {
    /// Host memory: (address, bytes) of the data and of the pad.
    Host {
        data: (*mut u8, usize),
        pad: (*mut u8, usize),
    },
    /// The segment of GPU `ordinal` mapped at `segment` (`bytes` long, granularity-aligned),
    /// with the data and the pad at (offset, bytes) in it: registered through a dma-buf.
    Gpu {
        ordinal: usize,
        segment: u64,
        bytes: usize,
        data: (usize, usize),
        pad: (usize, usize),
    },
}

/// What a window needs to move its network links onto RDMA.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) struct RdmaPlan<'a> {
    pub choice: crate::contracts::options::NetTransport,
    pub rank: usize,
    pub size: usize,
    pub store: &'a dyn crate::contracts::store::Store,
    pub memory: WindowMemory,
    pub timeout: Duration,
}

/// Whether this rank, which can use RDMA, reaches `peer` over it: only where the peer can
/// too. Under `FERROCOMM_NET=rdma` a peer that cannot is an error (a rank that cannot itself
/// fails with its own reason before asking).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
fn pair_over_rdma(choice: crate::contracts::options::NetTransport, peer_can: bool, peer: usize) -> Result<bool> {
    match (peer_can, choice) {
        (true, _) => Ok(true),
        (false, crate::contracts::options::NetTransport::Rdma) => Err(Error::Unavailable {
            backend: "rdma".into(),
            reason: format!("FERROCOMM_NET=rdma, but rank {peer} cannot use RDMA (its error says why)"),
        }),
        (false, _) => Ok(false),
    }
}

/// Carries `links` (TCP, indexed by rank) over RDMA when `FERROCOMM_NET` asks for it or, on
/// `auto`, where both ends of a pair can: each rank first says through the store whether it
/// opened a device and registered its window, so no rank waits for an endpoint its peer never
/// publishes. The TCP links stay beneath them for atomics (`link::AtomicsAtHome`) and so that
/// the target's server thread notices when an origin goes away, which the waits report as a
/// lost peer. Every rank of the window must make the same choice (they read the same
/// environment).
pub(crate) fn select_links(links: &mut [Option<Arc<SharedLink>>], plan: &RdmaPlan) -> Result<NetResources> {
    use crate::contracts::options::NetTransport;
    if links.iter().all(Option::is_none) || plan.choice == NetTransport::Tcp {
        return Ok(NetResources::default());
    }
    let can_key = |r: usize| format!("rdma/can/{r}");
    #[cfg(feature = "rdma")]
    {
        let opened = rdma::Device::open().and_then(|dev| {
            let (data, pad) = register_window(&dev, &plan.memory)?;
            Ok((dev, data, pad))
        });
        plan.store
            .set(&can_key(plan.rank), if opened.is_ok() { b"1" } else { b"0" })?;
        let (dev, data, pad) = match opened {
            Ok(o) => o,
            Err(e) if plan.choice == NetTransport::Rdma => return Err(e),
            Err(e) => {
                tracing::debug!("window links stay on TCP: {e}");
                return Ok(NetResources::default());
            }
        };
        let mut rdma_peers = Vec::new();
        for (t, l) in links.iter().enumerate() {
            if l.is_some() {
                let peer_can = plan.store.get(&can_key(t), plan.timeout)? == b"1";
                if pair_over_rdma(plan.choice, peer_can, t)? {
                    rdma_peers.push(t);
                }
            }
        }
        let mut pending = Vec::new();
        for &t in &rdma_peers {
            let p = rdma::Pending::create(&dev)?;
            let key = format!("rdma/{}/{t}", plan.rank);
            plan.store.set(&key, p.endpoint(&data, &pad).encode().as_bytes())?;
            pending.push((t, p));
        }
        for (t, p) in pending {
            let v = plan.store.get(&format!("rdma/{t}/{}", plan.rank), plan.timeout)?;
            let remote = rdma::Endpoint::decode(&String::from_utf8_lossy(&v))?;
            let fast = Box::new(p.connect(&remote, t, plan.rank, plan.size, plan.timeout)?);
            tracing::debug!(peer = t, device = dev.name, "window link over RDMA");
            if let Some(home) = links[t].take() {
                links[t] = Some(Arc::new(SharedLink::new(Box::new(link::AtomicsAtHome { fast, home }))));
            }
        }
        Ok(NetResources {
            _regions: vec![data, pad],
        })
    }
    #[cfg(not(feature = "rdma"))]
    {
        // Peers built with the feature wait for our word.
        plan.store.set(&can_key(plan.rank), b"0")?;
        match plan.choice {
            NetTransport::Rdma => Err(Error::Unavailable {
                backend: "rdma".into(),
                reason: "FERROCOMM_NET=rdma, but this build of ferrocomm lacks the `rdma` feature".into(),
            }),
            _ => Ok(NetResources::default()),
        }
    }
}

/// Registers the window's data and pad with `dev`.
#[cfg(feature = "rdma")]
fn register_window(dev: &Arc<rdma::Device>, memory: &WindowMemory) -> Result<(rdma::Region, rdma::Region)> {
    use std::os::fd::AsFd;
    match *memory {
        WindowMemory::Host { data, pad } => Ok((
            rdma::Region::register(dev, data.0, data.1)?,
            rdma::Region::register(dev, pad.0, pad.1)?,
        )),
        WindowMemory::Gpu {
            ordinal,
            segment,
            bytes,
            data,
            pad,
        } => {
            let fd = crate::gpu::memory::dmabuf::export(ordinal, segment, bytes)?;
            let region = |(offset, len): (usize, usize)| {
                rdma::Region::register_dmabuf(dev, fd.as_fd(), offset, len, segment + offset as u64)
            };
            Ok((region(data)?, region(pad)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::pair_over_rdma;
    use crate::contracts::options::NetTransport;

    #[test]
    fn a_pair_rides_rdma_only_where_the_peer_can_and_rdma_required_names_the_peer_that_cannot() {
        assert!(pair_over_rdma(NetTransport::Auto, true, 3).unwrap());
        assert!(!pair_over_rdma(NetTransport::Auto, false, 3).unwrap());
        assert!(pair_over_rdma(NetTransport::Rdma, true, 3).unwrap());
        let e = pair_over_rdma(NetTransport::Rdma, false, 3).unwrap_err();
        assert!(e.to_string().contains("rank 3 cannot use RDMA"), "{e}");
    }
}
