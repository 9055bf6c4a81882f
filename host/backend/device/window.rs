//! A window in GPU memory. Each rank's segment is a cuMem allocation (a shared memory file on
//! the host device, gpu.rs); every rank maps the segments of its host side by side
//! (memory::SymmetricMap), so kernels reach those peers by address. Peers in this process
//! share the physical handle; peers in other processes of this host receive it as a file
//! descriptor (gpu/fd_passing.rs). Ranks on other hosts are
//! reached over the network (net/windows/device_network.rs): host verbs on links, kernels through the proxy queue.
//! Host verbs toward this host run on the rank's own stream: copies by copy engine, signals,
//! waits and atomics by the small kernels of kernels/rma.cu, each complete when the call
//! returns.

use super::rank::DeviceRank;
use crate::bootstrap::PrefixStore;
use crate::contracts::backend::RunOptions;
use crate::contracts::error::{Error, Result};
use crate::contracts::window::{Cmp, Observed, SignalOp, SignalSource, WindowBackend, WindowSpec};
use crate::contracts::window_handle::{self as abi, DeviceStatus, WindowHandle};
use crate::gpu::fd_passing::FdServer;
use crate::gpu::kernels::{self, Function};
use crate::gpu::memory::symmetric::granularity;
use crate::gpu::memory::{multicast, MulticastMap, Pinned};
use crate::gpu::segment_sharing::{forget_released, Shared};
use crate::gpu::target::{Gpu, Mapping, Place, Segment, Stream};
use crate::net::links::host_identity;
use crate::net::links::FaultRecord;
use crate::net::windows::device_network::{self as window_network, GpuSegment, Network};
use crate::net::windows::link::SharedLink;
use cudarc::driver::CudaStream;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a rank's segment can be found, published through the store.
#[derive(Serialize, Deserialize)]
struct SegmentInfo {
    host: String,
    /// The window it asked for: (data bytes, signal ids).
    spec: (usize, usize),
    segment: Shared,
}

/// What `DeviceWindow::exchange` learnt: per rank, its segment where it is on this host, its
/// process and its host.
struct Peers {
    segments: Vec<Option<Segment>>,
    pids: Vec<u32>,
    hosts: Vec<String>,
}

const ALIGN: usize = 256;

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// The least common multiple of two granularities (1 if the driver reported 0).
fn lcm(a: usize, b: usize) -> usize {
    let (a, b) = (a.max(1), b.max(1));
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, b) * b
}

/// The library kernels a window calls.
struct Kernels {
    signal: Function,
    signal_from: Function,
    wait_signal: Function,
    fetch_add: Function,
    compare_swap: Function,
}

pub(crate) struct DeviceWindow {
    rank: usize,
    /// Links, proxy queue and server toward ranks on other hosts; stopped on drop before the
    /// segments are unmapped.
    net: Option<Network>,
    /// The handle carries its address; kept until drop, before `map` (unbound first).
    _multicast: Option<MulticastMap>,
    map: Mapping,
    gpu: Gpu,
    stream: Stream,
    kernels: Kernels,
    handle: WindowHandle,
    status: Pinned<DeviceStatus>,
    /// Results of waits and atomics: ok / source / value.
    out: Pinned<u64>,
    _abort_flag: Arc<Pinned<u32>>,
    /// One host verb at a time: they share `out` and the status record.
    lock: Mutex<()>,
    /// The communicator's timeout: the bound of host verbs that do not take their own.
    timeout: Duration,
    /// This window's first cause of failure (net/links/fault.rs).
    faults: FaultRecord,
}

impl DeviceWindow {
    pub(crate) fn create(b: &DeviceRank, spec: &WindowSpec) -> Result<DeviceWindow> {
        if spec.registered.is_some() {
            return Err(Error::invalid(
                "register",
                "the device backend allocates window memory on the GPU (new_window); register takes host memory",
            ));
        }
        let (rank, size) = (b.rank, b.size);
        let gpu = b.gpu;
        gpu.enter()?;
        let stream = gpu.stream()?;
        let f = |name: &str| gpu.function(name);
        let kernels = Kernels {
            signal: f("ferrocomm_signal")?,
            signal_from: f("ferrocomm_signal_from")?,
            wait_signal: f("ferrocomm_wait_signal")?,
            fetch_add: f("ferrocomm_fetch_add")?,
            compare_swap: f("ferrocomm_compare_swap")?,
        };

        // Segment layout (abi.h): data, signal pad [id][source], barrier slots [source], epoch.
        let signal_offset = align_up(spec.bytes, ALIGN);
        let barrier_offset = align_up(signal_offset + spec.signals * size * 8, ALIGN);
        let mut segment_bytes = barrier_offset + (size + 1) * 8;
        // With multicast, segments are whole multicast units (the driver binds no less).
        let multicast_unit = if b.multicast {
            let g = multicast::granularity(size, segment_bytes)?;
            segment_bytes = segment_bytes.next_multiple_of(lcm(g, granularity(b.ordinal)?));
            Some(g)
        } else {
            None
        };
        let own = gpu.segment(segment_bytes)?;
        let exchanged = Self::exchange(b, spec, &own);
        forget_released();
        let peers = exchanged?;
        let hosts = peers.hosts;
        let map = gpu.map(peers.segments)?;
        let multicast = match (multicast_unit, own.physical()) {
            (Some(g), Some(own)) => super::multicast::join(b, spec.id, own, &peers.pids, g, spec.timeout),
            _ => Ok(None),
        };
        forget_released();
        let multicast = multicast?;

        // Page-locked allocations come before the barrier below: once a peer has passed it,
        // it may run kernels that wait for us, and CUDA may serialize such an allocation
        // against every stream of the GPU (the programming guide's implicit synchronization),
        // which would hold us back until those kernels time out.
        let status = gpu.records(1)?;
        let out = gpu.records(3)?;

        // Fresh pads and barrier slots read zero on every rank before anyone signals.
        // SAFETY: our own mapped segment, which outlives the wait below.
        unsafe { stream.zero(map.addr(rank, 0), map.stride()) }?;
        stream.wait_idle("new_window", spec.timeout)?;
        let hints = BTreeMap::new();
        let barrier = || b.host.run_barrier(&RunOptions::new(spec.timeout, &hints));
        barrier()?;

        let mut handle = WindowHandle {
            base: map.base(),
            stride: map.stride() as u64,
            data_bytes: spec.bytes as u64,
            signal_offset: signal_offset as u64,
            barrier_offset: barrier_offset as u64,
            multicast: multicast.as_ref().map_or(0, MulticastMap::addr),
            status: status.device_addr(),
            abort_flag: b.abort_flag.device_addr(),
            fifo: 0,
            timeout_ns: spec.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: rank as i32,
            size: size as i32,
            signals: spec.signals as u32,
            abi_version: abi::ABI_VERSION,
        };
        // After the barrier: no rank's request can reach a pad before its owner zeroed it.
        let net = Network::start(window_network::Plan {
            store: &PrefixStore::new(format!("dwindow{}", spec.id), b.store.clone()),
            hosts: &hosts,
            transport: &b.transport,
            segment: GpuSegment {
                gpu,
                handle,
                signal_from: kernels.signal_from.clone(),
                fetch_add: kernels.fetch_add.clone(),
                compare_swap: kernels.compare_swap.clone(),
                timeout: spec.timeout,
            },
            stream: &stream,
            gpu,
            deadline: Instant::now() + spec.timeout,
        })?;
        handle.fifo = net.as_ref().map_or(0, |n| n.queue.device_addr());
        // The network allocates its queue and staging memory after that barrier: for the same
        // reason, every rank finishes doing so before any uses the window. Every rank has a
        // network or none: there is one wherever some rank is on another host.
        if net.is_some() {
            barrier()?;
        }
        Ok(DeviceWindow {
            rank,
            net,
            _multicast: multicast,
            map,
            gpu,
            stream,
            kernels,
            handle,
            status,
            out,
            _abort_flag: b.abort_flag.clone(),
            lock: Mutex::new(()),
            timeout: spec.timeout,
            faults: b.host.faults().scoped(&format!("dwindow{}", spec.id)),
        })
    }

    /// Publishes our segment and collects every rank's of this host, in rank order.
    fn exchange(b: &DeviceRank, spec: &WindowSpec, own: &Segment) -> Result<Peers> {
        let store = PrefixStore::new(format!("dwindow{}", spec.id), b.store.clone());
        let server = FdServer::bind()?;
        let me = SegmentInfo {
            host: host_identity(b.rank, &b.transport),
            spec: (spec.bytes, spec.signals),
            segment: Shared::publish(own, &server),
        };
        let infos =
            crate::bootstrap::all_gather_records(&store, "rank", b.rank, b.size, &me, "device window", spec.timeout)?;
        for (r, info) in infos.iter().enumerate() {
            if info.spec != me.spec {
                return Err(Error::Mismatch {
                    op: "new_window",
                    peer: r,
                    detail: format!(
                        "it asked for (bytes, signals) = {:?}, this rank for {:?}",
                        info.spec, me.spec
                    ),
                });
            }
            if info.host == me.host && info.segment.bytes != me.segment.bytes {
                return Err(Error::Mismatch {
                    op: "new_window",
                    peer: r,
                    detail: format!("segment of {} bytes, ours has {}", info.segment.bytes, me.segment.bytes),
                });
            }
        }

        let deadline = Instant::now() + spec.timeout;
        let here = |i: &SegmentInfo| i.host == me.host;
        let clients = infos
            .iter()
            .filter(|i| here(i) && i.segment.pid != me.segment.pid)
            .count();
        let fd = if clients > 0 { Some(own.export()?) } else { None };
        std::thread::scope(|s| {
            let serving = fd
                .as_ref()
                .map(|fd| s.spawn(|| server.serve(&[fd.as_fd()], clients, deadline)));
            let segments = infos
                .iter()
                .enumerate()
                .map(|(r, info)| {
                    if r == b.rank {
                        Ok(Some(own.clone()))
                    } else if here(info) {
                        info.segment.open(b.gpu, r, "segment", deadline).map(Some)
                    } else {
                        Ok(None)
                    }
                })
                .collect::<Result<Vec<_>>>();
            let served = serving.map_or(Ok(()), |h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::protocol("device window", "descriptor server panicked")))
            });
            let segments = segments?;
            served?;
            Ok(Peers {
                segments,
                pids: infos.iter().map(|i| i.segment.pid).collect(),
                hosts: infos.into_iter().map(|i| i.host).collect(),
            })
        })
    }

    /// Waits for the stream (bounded: device waits end by their own deadline, so `limit` only
    /// guards against a kernel that never ends), then turns a recorded device error into ours.
    pub(crate) fn finish(&self, op: &'static str, limit: Duration) -> Result<()> {
        match self.stream.wait_idle(op, limit + Duration::from_secs(1)) {
            Err(Error::Timeout { op, peer, .. }) => return Err(Error::Timeout { op, peer, after: limit }),
            r => r?,
        }
        self.take_status(op, limit)?;
        self.take_proxy_error()
    }

    /// Waits until every put and signal this rank's kernels queued toward other hosts is
    /// complete at its target (those kernels must have ended). Nothing to wait for on one host.
    pub(crate) fn drain_proxy(&self, limit: Duration) -> Result<()> {
        match &self.net {
            Some(n) => {
                self.gpu.enter()?;
                n.queue.drain(&self.stream, limit)
            }
            None => Ok(()),
        }
    }

    /// Reports and clears a kernel's queued put or signal that the proxy could not carry (a
    /// lost link, a bad descriptor).
    pub(crate) fn take_proxy_error(&self) -> Result<()> {
        match self.net.as_ref().and_then(|n| n.queue.take_error()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The link to `rank` where it is on another host.
    fn link(&self, rank: usize) -> Option<&Arc<SharedLink>> {
        self.net.as_ref()?.links().get(rank)?.as_ref()
    }

    /// Reports and clears the first error a kernel recorded, so the window stays usable.
    pub(crate) fn take_status(&self, op: &'static str, limit: Duration) -> Result<()> {
        let s = self.status.read(0);
        if s.code == abi::STATUS_OK {
            return Ok(());
        }
        self.status.write(0, DeviceStatus::default());
        let peer = usize::try_from(s.peer).ok();
        Err(match s.code {
            abi::STATUS_ABORTED => Error::Closed { op, state: "aborted" },
            // kernels/alltoall.cu: observed is the sender's bytes, or all ones for a chunk of
            // another call.
            abi::STATUS_MISMATCH => Error::Mismatch {
                op,
                peer: peer.unwrap_or(usize::MAX),
                detail: if s.observed == u64::MAX {
                    "its part belongs to another call: the ranks' calls are out of step".into()
                } else {
                    format!("it sent {} bytes where this rank expected {}", s.observed, s.expected)
                },
            },
            abi::STATUS_ABI_MISMATCH => Error::invalid(
                op,
                format!(
                    "window handle ABI version {}, kernel compiled for {}: build the kernel with this \
                     ferrocomm's device-api headers",
                    s.observed, s.expected
                ),
            ),
            // kernels/fused_norm.cu: a peer's host refused its call and told us in band.
            abi::STATUS_REFUSED => Error::invalid(
                op,
                format!(
                    "rank {} refused its call of {op} (an argument failed that rank's checks; it has the \
                     error); nothing moved",
                    s.peer
                ),
            ),
            abi::STATUS_INVALID => Error::invalid(op, self.invalid_argument(&s)),
            _ => Error::Timeout { op, peer, after: limit },
        })
    }

    /// What a device verb refused (`FERROCOMM_STATUS_INVALID`; the verb did nothing).
    fn invalid_argument(&self, s: &DeviceStatus) -> String {
        let (peer, bytes, offset) = (s.peer, s.expected, s.observed);
        match s.op {
            // kernels/multimem.cu on a window without a multicast address (the host plans
            // never launch it there; a user kernel might).
            abi::OP_COLLECTIVE => "a multimem kernel ran on a window without a multicast object".into(),
            abi::OP_OUT_OF_WINDOW => format!(
                "a kernel's put, get or atomic of {bytes} bytes at byte offset {offset:#x} of rank {peer} leaves \
                 the window's {}-byte data; it did nothing",
                self.handle.data_bytes
            ),
            abi::OP_BAD_RANK => {
                format!("a kernel's verb named rank {peer}, but the window has ranks 0..{bytes}; it did nothing")
            }
            abi::OP_BAD_SIGNAL => format!(
                "a kernel's verb named signal id {}, but the window has ids 0..{bytes}; it did nothing",
                s.signal_id
            ),
            abi::OP_MISALIGNED => {
                format!(
                    "a kernel's atomic at byte offset {offset:#x} of rank {peer} is not 8-byte aligned; it did nothing"
                )
            }
            abi::OP_NOT_VIA_PROXY => format!(
                "a kernel's get, atomic or barrier reached rank {peer}, which is behind the proxy queue (it carries \
                 puts and signals only)"
            ),
            abi::OP_PROXY => format!(
                "a kernel's proxy put of {bytes} bytes to rank {peer} named a source (address {offset:#x}) that is not \
                 in this window's data"
            ),
            other => format!("a kernel's verb refused an argument (device op {other}, rank {peer})"),
        }
    }

    fn enter(&self) -> Result<std::sync::MutexGuard<'_, ()>> {
        let g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.gpu.enter()?;
        Ok(g)
    }

    /// Makes the device current on the calling thread.
    pub(crate) fn enter_gpu(&self) -> Result<()> {
        self.gpu.enter()
    }

    /// The handle kernels take and the rank's stream, for the collectives on this window.
    pub(crate) fn handle_and_stream(&self) -> (WindowHandle, &Stream) {
        (self.handle, &self.stream)
    }
}

impl WindowBackend for DeviceWindow {
    fn put(&self, dst: usize, offset: usize, src: &[u8]) -> Result<()> {
        if let Some(l) = self.link(dst) {
            return l.lock(true).put(offset, src);
        }
        let _g = self.enter()?;
        // SAFETY: Window checked the range; the copy completes before `src` is released.
        unsafe {
            self.stream.copy(
                Place::Device(self.map.addr(dst, offset)),
                Place::Host(src.as_ptr() as usize),
                src.len(),
            )
        }?;
        self.finish("put", self.timeout)
    }

    fn get(&self, src: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        if let Some(l) = self.link(src) {
            return l.lock(false).get(offset, dst);
        }
        let _g = self.enter()?;
        // SAFETY: Window checked the range; `dst` outlives the synchronised copy.
        unsafe {
            self.stream.copy(
                Place::Host(dst.as_mut_ptr() as usize),
                Place::Device(self.map.addr(src, offset)),
                dst.len(),
            )
        }?;
        self.finish("get", self.timeout)
    }

    fn signal(&self, dst: usize, id: usize, op: SignalOp, value: u64) -> Result<()> {
        if let Some(l) = self.link(dst) {
            return l.lock(true).signal(id, op, value);
        }
        let _g = self.enter()?;
        let (peer, id, op) = (dst as i32, id as u32, signal_op(op));
        kernels::SIGNAL.launch(
            &self.kernels.signal,
            self.stream.queue(),
            1,
            (self.handle, peer, id, op, value),
        )?;
        self.finish("signal", self.timeout)
    }

    fn wait_signal(&self, id: usize, from: SignalSource, cmp: Cmp, value: u64, timeout: Duration) -> Result<Observed> {
        let _g = self.enter()?;
        let mut h = self.handle;
        h.timeout_ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
        let source = match from {
            SignalSource::Rank(r) => r as i32,
            SignalSource::Any => abi::SOURCE_ANY,
            SignalSource::Sum => abi::SOURCE_SUM,
        };
        let (id, cmp, out) = (id as u32, cmp_code(cmp), self.out.device_addr());
        kernels::WAIT_SIGNAL.launch(
            &self.kernels.wait_signal,
            self.stream.queue(),
            1,
            (h, id, source, cmp, value, out),
        )?;
        self.finish("wait_signal", timeout)?;
        if self.out.read(0) == 0 {
            let peer = usize::try_from(source).ok();
            if let (Some(p), Some(net)) = (peer, &self.net) {
                if net.lost(p) {
                    return Err(self.faults.resolve(Error::PeerLost {
                        op: "wait_signal",
                        peer: p,
                        reason: "its connection to this rank's window server closed".into(),
                    }));
                }
            }
            return Err(Error::Timeout {
                op: "wait_signal",
                peer,
                after: timeout,
            });
        }
        let src = self.out.read(1) as u32 as i32;
        Ok(Observed {
            source: usize::try_from(src).ok(),
            value: self.out.read(2),
        })
    }

    fn fetch_add(&self, dst: usize, offset: usize, value: u64) -> Result<u64> {
        if let Some(l) = self.link(dst) {
            return l.lock(false).fetch_add(offset, value);
        }
        let _g = self.enter()?;
        let (peer, offset, out) = (dst as i32, offset as u64, self.out.device_addr());
        kernels::FETCH_ADD.launch(
            &self.kernels.fetch_add,
            self.stream.queue(),
            1,
            (self.handle, peer, offset, value, out),
        )?;
        self.finish("fetch_add", self.timeout)?;
        Ok(self.out.read(0))
    }

    fn compare_swap(&self, dst: usize, offset: usize, expected: u64, desired: u64) -> Result<u64> {
        if let Some(l) = self.link(dst) {
            return l.lock(false).compare_swap(offset, expected, desired);
        }
        let _g = self.enter()?;
        let (peer, offset, out) = (dst as i32, offset as u64, self.out.device_addr());
        kernels::COMPARE_SWAP.launch(
            &self.kernels.compare_swap,
            self.stream.queue(),
            1,
            (self.handle, peer, offset, expected, desired, out),
        )?;
        self.finish("compare_swap", self.timeout)?;
        Ok(self.out.read(0))
    }

    /// Host verbs on this host are complete when they return, and each link to another host
    /// is FIFO: every verb is already ordered before the next.
    fn fence(&self) -> Result<()> {
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        let _g = self.enter()?;
        self.finish("flush", self.timeout)?;
        for l in self.net.iter().flat_map(|n| n.links().iter().flatten()) {
            l.flush_if_dirty()?;
        }
        Ok(())
    }

    fn local_base(&self) -> *mut u8 {
        self.map.addr(self.rank, 0) as *mut u8
    }

    fn remote_base(&self, rank: usize) -> Option<*mut u8> {
        self.map.is_mapped(rank).then(|| self.map.addr(rank, 0) as *mut u8)
    }

    fn device(&self) -> Option<(WindowHandle, Arc<CudaStream>)> {
        self.stream.cuda().map(|s| (self.handle, s.clone()))
    }

    fn handle(&self) -> Option<WindowHandle> {
        Some(self.handle)
    }

    fn synchronize(&self, timeout: Duration) -> Result<()> {
        let _g = self.enter()?;
        self.finish("synchronize", timeout)
    }
}

impl Drop for DeviceWindow {
    fn drop(&mut self) {
        // Unmapping under a running kernel would fault it; wait (bounded) first.
        let _ = self.gpu.enter();
        let _ = self.finish("drop", Duration::from_secs(5));
        // The proxy, the server threads and the NIC registrations use the segment: they stop
        // before it is unmapped.
        drop(self.net.take());
    }
}

fn signal_op(op: SignalOp) -> u32 {
    match op {
        SignalOp::Set => 0,
        SignalOp::Add => 1,
    }
}

fn cmp_code(c: Cmp) -> u32 {
    match c {
        Cmp::Eq => 0,
        Cmp::Ne => 1,
        Cmp::Ge => 2,
        Cmp::Gt => 3,
        Cmp::Le => 4,
        Cmp::Lt => 5,
    }
}
