//! The network path of windows: how one-sided operations reach ranks that cannot be mapped
//! (other hosts). Host calls run on a link (`link.rs`) to the target directly; kernels cannot,
//! so they push 16-byte descriptors into a queue (`fifo.rs`, format in [`descriptor`]) that a
//! proxy thread (`proxy.rs`) drains onto the same links. Transports: TCP (`tcp.rs`, always),
//! RDMA verbs (`rdma.rs`, with the feature of that name).
//!
//! [`QueueProducer`] is the host end of a window's queue: the same protocol a kernel speaks,
//! from Rust, so the whole kernel-to-network path runs (and is tested) without a GPU.

pub(crate) mod affinity;
pub mod descriptor;
pub(crate) mod fifo;
pub(crate) mod link;
pub(crate) mod mesh;
pub(crate) mod proxy;
#[cfg(feature = "rdma")]
pub(crate) mod rdma;
pub(crate) mod tcp;

use crate::error::{Error, Result};
use crate::window::SignalOp;
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

/// What a window needs to move its network links onto RDMA.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) struct RdmaPlan<'a> {
    pub choice: crate::options::NetTransport,
    pub rank: usize,
    pub size: usize,
    pub store: &'a dyn crate::bootstrap::Store,
    /// This rank's window data and signal pad: (address, bytes).
    pub data: (*mut u8, usize),
    pub pad: (*mut u8, usize),
    pub timeout: Duration,
}

/// Carries `links` (TCP, indexed by rank) over RDMA when `FERROCOMM_NET` asks for it or, on
/// `auto`, when a device opens. The TCP connections stay open beside them: the target's
/// server thread notices when an origin goes away, which the waits report as a lost peer.
/// Every rank of the window must make the same choice (they read the same environment).
pub(crate) fn select_links(
    links: &mut [Option<Arc<SharedLink>>],
    plan: &RdmaPlan,
) -> Result<(NetResources, Vec<Arc<SharedLink>>)> {
    use crate::options::NetTransport;
    if links.iter().all(Option::is_none) || plan.choice == NetTransport::Tcp {
        return Ok((NetResources::default(), Vec::new()));
    }
    #[cfg(feature = "rdma")]
    {
        let dev = match (rdma::Device::open(), plan.choice) {
            (Ok(d), _) => d,
            (Err(e), NetTransport::Rdma) => return Err(e),
            (Err(e), _) => {
                tracing::debug!("window links stay on TCP: {e}");
                return Ok((NetResources::default(), Vec::new()));
            }
        };
        let data = rdma::Region::register(&dev, plan.data.0, plan.data.1)?;
        let pad = rdma::Region::register(&dev, plan.pad.0, plan.pad.1)?;
        let mut pending = Vec::new();
        for (t, l) in links.iter().enumerate() {
            if l.is_some() {
                let p = rdma::Pending::create(&dev)?;
                let key = format!("rdma/{}/{t}", plan.rank);
                plan.store.set(&key, p.endpoint(&data, &pad).encode().as_bytes())?;
                pending.push((t, p));
            }
        }
        let mut tcp = Vec::new();
        for (t, p) in pending {
            let v = plan.store.get(&format!("rdma/{t}/{}", plan.rank), plan.timeout)?;
            let remote = rdma::Endpoint::decode(&String::from_utf8_lossy(&v))?;
            let link = p.connect(&remote, t, plan.rank, plan.size, plan.timeout)?;
            tracing::debug!(peer = t, device = dev.name, "window link over RDMA");
            if let Some(old) = links[t].replace(Arc::new(SharedLink::new(Box::new(link)))) {
                tcp.push(old);
            }
        }
        Ok((
            NetResources {
                _regions: vec![data, pad],
            },
            tcp,
        ))
    }
    #[cfg(not(feature = "rdma"))]
    match plan.choice {
        NetTransport::Rdma => Err(Error::Unavailable {
            backend: "rdma".into(),
            reason: "FERROCOMM_NET=rdma, but this build of ferrocomm lacks the `rdma` feature".into(),
        }),
        _ => Ok((NetResources::default(), Vec::new())),
    }
}
