//! A device window's network side ([`Network`]), for ranks on other hosts: host verbs toward
//! them run on links, kernels' puts and signals go through the window's proxy queue (queue.rs)
//! onto the same links. Over TCP (net/tcp.rs) the window server applies their requests to this
//! rank's GPU segment ([`GpuTarget`], one per connection); over RDMA (`FERROCOMM_NET`, feature
//! `rdma`) the peers' NICs write the segment themselves, registered as a dma-buf (GPUDirect
//! RDMA, net::select_links). The proxy reads the sources of queued puts out of the segment
//! ([`GpuData`]). Each has a stream of its own, created non-blocking so that its copies run
//! beside a kernel that is waiting for them.

use crate::contracts::error::{Error, Result};
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
use crate::net::windows::tcp::{self, Target, TcpLink};
use crate::net::windows::{select_links, NetResources, RdmaPlan, WindowMemory};
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The links, the proxy queue and the server of a window with ranks on other hosts.
pub(super) struct Network {
    /// Per rank, the link where the rank is on another host.
    pub(super) links: Vec<Option<Arc<SharedLink>>>,
    pub(super) queue: DeviceQueue,
    /// Per rank: its connection to our server has closed.
    gone: Arc<Vec<AtomicBool>>,
    /// The connections we serve, to shut down on drop.
    served: Vec<TcpStream>,
    threads: Vec<JoinHandle<()>>,
    /// Our segment's registration with the NIC, for RDMA links; dropped last, after the proxy
    /// and the links.
    _registered: NetResources,
}

/// What the window's set-up hands to [`Network::start`].
pub(super) struct Plan<'a> {
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
    pub(super) fn start(p: Plan) -> Result<Option<Network>> {
        let (rank, size) = (p.segment.handle.rank as usize, p.hosts.len());
        let by_net = |o: usize, t: usize| p.hosts[o] != p.hosts[t];
        if !(0..size).any(|t| by_net(rank, t)) {
            return Ok(None);
        }
        let mut mesh =
            crate::net::windows::connections::connect(p.store, rank, size, &by_net, p.transport, p.deadline)?;
        let timeout = p.segment.timeout;
        let mut links = Vec::with_capacity(size);
        for (t, stream) in mesh.to.iter_mut().enumerate() {
            links.push(match stream.take() {
                Some(s) => Some(Arc::new(SharedLink::new(Box::new(TcpLink::new(s, t, timeout)?)))),
                None => None,
            });
        }
        // Links move to RDMA where FERROCOMM_NET chooses it and both ends can.
        let h = &p.segment.handle;
        let registered = select_links(
            &mut links,
            &RdmaPlan {
                choice: p.transport.net,
                rank,
                size,
                store: p.store,
                memory: match p.gpu {
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
                },
                timeout: p.deadline.saturating_duration_since(Instant::now()),
            },
        )?;
        let data = GpuData::new(p.gpu, p.segment.data(0), timeout)?;
        let limits = Limits {
            size,
            bytes: p.segment.handle.data_bytes as usize,
            signals: p.segment.handle.signals as usize,
        };
        let queue = DeviceQueue::start(p.gpu, p.stream, links.clone(), Box::new(data), limits)?;
        let mut net = Network {
            links,
            queue,
            gone: Arc::new((0..size).map(|_| AtomicBool::new(false)).collect()),
            served: Vec::new(),
            threads: Vec::new(),
            _registered: registered,
        };
        // From here an error drops `net`, which stops the servers already started.
        for (origin, stream) in mesh.from {
            net.served
                .push(stream.try_clone().map_err(|e| Error::io("window server", e))?);
            let target = GpuTarget::new(p.segment.clone())?;
            let gone = net.gone.clone();
            net.threads.push(
                std::thread::Builder::new()
                    .name("ferrocomm-winserve".into())
                    .spawn(move || tcp::serve(stream, origin, target, gone))
                    .map_err(|e| Error::io("starting a window server thread", e))?,
            );
        }
        Ok(Some(net))
    }

    /// Whether `origin`'s connection to our server has closed (it can no longer signal us).
    pub(super) fn lost(&self, origin: usize) -> bool {
        self.gone
            .get(origin)
            .is_some_and(|g| g.load(std::sync::atomic::Ordering::Acquire))
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // The server threads write our segment: they end before the window unmaps it.
        for s in &self.served {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// What a server thread needs to reach this rank's segment.
#[derive(Clone)]
pub(super) struct GpuSegment {
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
pub(super) struct GpuTarget {
    seg: GpuSegment,
    stream: Stream,
    /// An atomic's result.
    out: Pinned<u64>,
}

impl GpuTarget {
    pub(super) fn new(seg: GpuSegment) -> Result<GpuTarget> {
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
pub(super) struct GpuData {
    gpu: Gpu,
    stream: Stream,
    base: u64,
    timeout: Duration,
}

impl GpuData {
    pub(super) fn new(gpu: Gpu, base: u64, timeout: Duration) -> Result<GpuData> {
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
