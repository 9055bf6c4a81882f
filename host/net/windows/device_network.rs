//! A device window's network side ([`Network`]), for ranks on other hosts: host verbs toward
//! them run on links, kernels' puts and signals go through the window's proxy queue
//! (device_queue.rs) onto the same links, all set up by setup.rs as for CPU windows. Over TCP
//! (tcp.rs) the window server applies their requests to this
//! rank's GPU segment ([`GpuTarget`], one per connection); over RDMA (`FERROCOMM_NET`, feature
//! `rdma`) the peers' NICs write the segment themselves, registered as a dma-buf (GPUDirect
//! RDMA, `select_links`). The proxy reads the sources of queued puts out of the segment
//! ([`GpuData`]). Each has a stream of its own, created non-blocking so that its copies run
//! beside a kernel that is waiting for them.

use crate::contracts::error::Result;
use crate::contracts::options::TransportOptions;
use crate::contracts::store::Store;
use crate::contracts::window::SignalOp;
use crate::contracts::window_handle::WindowHandle;
use crate::gpu::kernels::{self, Function};
use crate::gpu::memory::Pinned;
use crate::gpu::target::{Gpu, Place, Stream};
use crate::net::windows::descriptor::Limits;
use crate::net::windows::device_queue::DeviceQueue;
use crate::net::windows::link::SharedLink;
use crate::net::windows::proxy::LocalData;
use crate::net::windows::setup::{NetPlan, WindowNetwork};
use crate::net::windows::tcp::Target;
use crate::net::windows::WindowMemory;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The proxy queue and the network (links, servers) of a device window with ranks on other
/// hosts. Field order: the proxy, which sends on the links and reads the segment, stops first.
pub(crate) struct Network {
    pub(crate) queue: DeviceQueue,
    net: WindowNetwork,
}

/// What the window's set-up hands to [`Network::start`].
pub(crate) struct Plan<'a> {
    /// The window's store namespace.
    pub store: &'a dyn Store,
    /// Every rank's `transport::host_identity`.
    pub hosts: &'a [String],
    pub transport: &'a TransportOptions,
    pub segment: GpuSegment,
    /// The rank's own stream, for the queue's allocations.
    pub stream: &'a Stream,
    /// The device, whose nearby CPUs run the proxy thread.
    pub gpu: Gpu,
    pub deadline: Instant,
}

impl Network {
    /// Collective over the window's ranks; `None` when every rank is on this host.
    pub(crate) fn start(p: Plan) -> Result<Option<Network>> {
        let (rank, size) = (p.segment.handle.rank as usize, p.hosts.len());
        let by_net = |o: usize, t: usize| p.hosts[o] != p.hosts[t];
        if !(0..size).any(|t| by_net(rank, t)) {
            return Ok(None);
        }
        let h = &p.segment.handle;
        let memory = match p.gpu {
            Gpu::Cuda(ordinal) => WindowMemory::Gpu {
                ordinal,
                segment: p.segment.data(0),
                bytes: h.stride as usize,
                data: (0, h.data_bytes as usize),
                pad: (h.signal_offset as usize, h.signals as usize * size * 8),
            },
            // The host device's segment is host memory.
            Gpu::Host => WindowMemory::Host {
                data: (p.segment.data(0) as *mut u8, h.data_bytes as usize),
                pad: (
                    p.segment.data(h.signal_offset as usize) as *mut u8,
                    h.signals as usize * size * 8,
                ),
            },
        };
        let timeout = p.segment.timeout;
        let net = WindowNetwork::start(
            NetPlan {
                store: p.store,
                rank,
                size,
                by_net: &by_net,
                transport: p.transport,
                memory,
                timeout,
                deadline: p.deadline,
            },
            || GpuTarget::new(p.segment.clone()),
        )?;
        let data = GpuData::new(p.gpu, p.segment.data(0), timeout)?;
        let limits = Limits {
            size,
            bytes: h.data_bytes as usize,
            signals: h.signals as usize,
        };
        let queue = DeviceQueue::start(p.gpu, p.stream, net.links.clone(), Box::new(data), limits)?;
        Ok(Some(Network { queue, net }))
    }

    /// Per rank, the link where the rank is on another host.
    pub(crate) fn links(&self) -> &[Option<Arc<SharedLink>>] {
        &self.net.links
    }

    /// Whether `origin`'s connection to our server has closed (it can no longer signal us).
    pub(crate) fn lost(&self, origin: usize) -> bool {
        self.net.lost(origin)
    }
}

/// What a server thread needs to reach this rank's segment.
#[derive(Clone)]
pub(crate) struct GpuSegment {
    pub gpu: Gpu,
    /// This rank's handle: its segment is `handle.base + rank * stride`.
    pub handle: WindowHandle,
    /// kernels/rma.cu's ferrocomm_signal_from, ferrocomm_fetch_add, ferrocomm_compare_swap.
    pub signal_from: Function,
    pub fetch_add: Function,
    pub compare_swap: Function,
    /// Bound of each wait for this rank's own stream (copies and one-thread kernels).
    pub timeout: Duration,
}

impl GpuSegment {
    fn data(&self, offset: usize) -> u64 {
        self.handle.base + self.handle.rank as u64 * self.handle.stride + offset as u64
    }
}

/// One origin's requests applied to this rank's segment, in order on one stream.
pub(crate) struct GpuTarget {
    seg: GpuSegment,
    stream: Stream,
    /// An atomic's result.
    out: Pinned<u64>,
}

impl GpuTarget {
    pub(crate) fn new(seg: GpuSegment) -> Result<GpuTarget> {
        seg.gpu.enter()?;
        Ok(GpuTarget {
            stream: seg.gpu.stream()?,
            out: seg.gpu.records(1)?,
            seg,
        })
    }

    fn enter(&self) -> Result<()> {
        self.seg.gpu.enter()
    }

    fn wait(&self, op: &'static str) -> Result<()> {
        self.stream.wait_idle(op, self.seg.timeout)
    }

    /// Runs a one-thread atomic kernel on our own rank and returns its result.
    fn atomic(&self, f: &Function, offset: usize, a: u64, b: Option<u64>) -> Result<u64> {
        self.enter()?;
        let (h, rank, offset, out) = (
            self.seg.handle,
            self.seg.handle.rank,
            offset as u64,
            self.out.device_addr(),
        );
        let queue = self.stream.queue();
        match b {
            None => kernels::FETCH_ADD.launch(f, queue, 1, (h, rank, offset, a, out))?,
            Some(b) => kernels::COMPARE_SWAP.launch(f, queue, 1, (h, rank, offset, a, b, out))?,
        }
        self.wait("window server atomic")?;
        Ok(self.out.read(0))
    }
}

impl Drop for GpuTarget {
    fn drop(&mut self) {
        // It ends on its server thread, which may never have made the context current; the
        // stream and pinned memory are released right after this, under it.
        let _ = self.seg.gpu.enter();
        // `signal` queues its kernel without waiting, and the window's memory may be unmapped
        // as soon as its server has stopped (DeviceWindow::drop): a signal still queued then
        // would write into unmapped memory (seen on the host device: a SIGSEGV in
        // `ferrocomm_signal_from` at the end of a MoE test over TCP).
        if let Err(e) = self.wait("window server close") {
            tracing::warn!(error = %e, "a window server's last signals did not finish before it closed");
        }
    }
}

impl Target for GpuTarget {
    fn limits(&self) -> (usize, usize) {
        (self.seg.handle.data_bytes as usize, self.seg.handle.signals as usize)
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.enter()?;
        // SAFETY: the server checked the range against the segment's data; `src` outlives the
        // wait below.
        unsafe {
            self.stream.copy(
                Place::Device(self.seg.data(offset)),
                Place::Host(src.as_ptr() as usize),
                src.len(),
            )
        }?;
        // `src` is the server's buffer, reused for the next request: the copy must have read it
        // (an asynchronous copy from pageable memory may return before it has).
        self.wait("window server put")
    }

    fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.enter()?;
        // SAFETY: as for `write`; `dst` outlives the wait below.
        unsafe {
            self.stream.copy(
                Place::Host(dst.as_mut_ptr() as usize),
                Place::Device(self.seg.data(offset)),
                dst.len(),
            )
        }?;
        self.wait("window server get")
    }

    fn signal(&mut self, id: usize, origin: usize, op: SignalOp, value: u64) -> Result<()> {
        self.enter()?;
        let (origin, id) = (origin as i32, id as u32);
        let op: u32 = match op {
            SignalOp::Set => 0,
            SignalOp::Add => 1,
        };
        // Stream order puts it after this origin's earlier copies: no wait needed here.
        kernels::SIGNAL_FROM.launch(
            &self.seg.signal_from,
            self.stream.queue(),
            1,
            (self.seg.handle, origin, id, op, value),
        )
    }

    fn fetch_add(&mut self, offset: usize, value: u64) -> Result<u64> {
        self.atomic(&self.seg.fetch_add, offset, value, None)
    }

    fn compare_swap(&mut self, offset: usize, expected: u64, desired: u64) -> Result<u64> {
        self.atomic(&self.seg.compare_swap, offset, expected, Some(desired))
    }

    fn complete(&mut self) -> Result<()> {
        self.enter()?;
        self.wait("window server flush")
    }
}

/// This rank's window data as the proxy reads put sources: a device-to-host copy each.
pub(crate) struct GpuData {
    gpu: Gpu,
    stream: Stream,
    base: u64,
    timeout: Duration,
}

impl GpuData {
    pub(crate) fn new(gpu: Gpu, base: u64, timeout: Duration) -> Result<GpuData> {
        Ok(GpuData {
            stream: gpu.stream()?,
            gpu,
            base,
            timeout,
        })
    }
}

impl Drop for GpuData {
    fn drop(&mut self) {
        // Dropped on the proxy thread: the stream is destroyed under its context.
        let _ = self.gpu.enter();
    }
}

impl LocalData for GpuData {
    fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.gpu.enter()?;
        // SAFETY: the descriptor's range was checked against the window data; `dst` outlives
        // the wait. The kernel that queued the put released its source before the descriptor
        // (impl/proxy.cuh), and we read the descriptor with acquire.
        unsafe {
            self.stream.copy(
                Place::Host(dst.as_mut_ptr() as usize),
                Place::Device(self.base + offset as u64),
                dst.len(),
            )
        }?;
        self.stream.wait_idle("proxy read of a put source", self.timeout)
    }
}
