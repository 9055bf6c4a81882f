//! Windows on the CPU backend. Each rank's segment (data, then the signal pad) lives in POSIX
//! shared memory, mapped by every rank of the host; other hosts, and every peer of a registered
//! user buffer, go through a link to the target's server (net/windows/tcp.rs); the window's proxy queue
//! (net/), made on first use, carries queued puts and signals over the same links. Waits read
//! the caller's own pad.

use crate::bootstrap::{self, PrefixStore};
use crate::contracts::error::{Error, Result};
use crate::contracts::options::TransportOptions;
use crate::contracts::store::Store;
use crate::contracts::window::{Cmp, Observed, SignalOp, SignalSource, WindowBackend, WindowSpec};
use crate::net::links::{check_owner, host_identity, FaultRecord, OwnerState, PeerGone, ProcessWatch, Segment};
use crate::net::windows::descriptor::Limits;
use crate::net::windows::link::SharedLink;
use crate::net::windows::proxy::HostData;
use crate::net::windows::setup::{NetPlan, WindowNetwork};
use crate::net::windows::tcp::Memory;
use crate::net::windows::HostQueue;
use crate::net::windows::WindowMemory;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How this rank reaches one peer's segment.
enum Path {
    /// Our own segment.
    Local,
    /// The peer's segment is mapped here: `mem` points into `seg`, which keeps it mapped.
    Mapped {
        mem: Memory,
        seg: Arc<Segment>,
        watch: Option<ProcessWatch>,
    },
    /// Through a link to the peer's server.
    Net(Arc<SharedLink>),
}

pub(crate) struct CpuWindow {
    rank: usize,
    own: Arc<Segment>,
    mem: Memory,
    paths: Vec<Path>,
    abort: Arc<AtomicBool>,
    /// This window's first cause of failure (see net/links/fault.rs).
    faults: FaultRecord,
    /// Links toward the ranks reached over the network, and our servers for them.
    net: WindowNetwork,
    /// The proxy queue, started by the first `proxy_queue` call.
    queue: Mutex<Option<Arc<HostQueue>>>,
    timeout: Duration,
    /// For rate-limiting process probes in `ensure_alive`.
    born: Instant,
    last_probe: AtomicU64,
}

// SAFETY: `mem` holds raw pointers into our segment or the registered buffer, both valid until
// drop; all shared access goes through raw copies and atomics per docs/memory-model.md, and the
// proxy connections are behind mutexes.
unsafe impl Send for CpuWindow {}
// SAFETY: as for Send: through `&CpuWindow` the memory is reached only by raw copies and
// atomics (the window's ordering contract), and the mutable state is behind mutexes or atomics.
unsafe impl Sync for CpuWindow {}

/// Per rank, the link when the rank is reached over the network.
fn net_links(paths: &[Path]) -> Vec<Option<Arc<SharedLink>>> {
    (paths.iter())
        .map(|p| match p {
            Path::Net(link) => Some(link.clone()),
            _ => None,
        })
        .collect()
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

static WINDOW_COUNTER: AtomicU64 = AtomicU64::new(0);

pub(crate) struct Setup<'a> {
    pub rank: usize,
    pub size: usize,
    pub store: &'a Arc<dyn Store>,
    pub transport: &'a TransportOptions,
    pub abort: Arc<AtomicBool>,
    pub faults: FaultRecord,
}

impl CpuWindow {
    /// Collective: builds this rank's part of window `spec`.
    pub(crate) fn create(spec: &WindowSpec, s: &Setup) -> Result<CpuWindow> {
        let (rank, size) = (s.rank, s.size);
        let deadline = Instant::now() + spec.timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        let store = PrefixStore::new(format!("window{}", spec.id), s.store.clone());
        if let Some(p) = spec.registered {
            if p as usize % 8 != 0 {
                return Err(Error::invalid(
                    "register",
                    "the buffer must be 8-byte aligned for atomics",
                ));
            }
        }
        let data_len = if spec.registered.is_some() {
            0
        } else {
            round_up(spec.bytes, 64)
        };
        let pad_len = spec.signals * size * 8;
        let name = format!(
            "/ferrocomm-win-{}-{rank}-{}-{}",
            std::process::id(),
            WINDOW_COUNTER.fetch_add(1, Ordering::Relaxed),
            &bootstrap::random_token()?[..12]
        );
        let own = Arc::new(Segment::create(&name, data_len + pad_len)?);
        let data = spec.registered.unwrap_or(own.payload());
        // SAFETY: the pad follows the data inside our segment's payload.
        let pad = unsafe { own.payload().add(data_len) };
        let mem = Memory {
            data,
            bytes: spec.bytes,
            pad,
            signals: spec.signals,
            size,
        };

        // Round 1: who is where, and does everyone ask for the same window?
        let host = host_identity(rank, s.transport);
        let my_spec = format!("{} {} {}", spec.bytes, spec.signals, spec.registered.is_some());
        store.set(&format!("host/{rank}"), format!("{host}\n{my_spec}").as_bytes())?;
        let mut hosts = Vec::with_capacity(size);
        for p in 0..size {
            let v = String::from_utf8_lossy(&store.get(&format!("host/{p}"), left())?).into_owned();
            let (h, sp) = v.split_once('\n').unwrap_or((&v, ""));
            if sp != my_spec {
                return Err(Error::Mismatch {
                    op: "new_window",
                    peer: p,
                    detail: format!("it asked for (bytes signals registered) = ({sp}), this rank for ({my_spec})"),
                });
            }
            hosts.push(h.to_owned());
        }
        // Registered memory is reachable only through its owner's proxy: peers never hold raw
        // pointers into it, so dropping the window (which joins the proxy) ends all access.
        let by_proxy = |origin: usize, target: usize| {
            origin != target && (spec.registered.is_some() || hosts[origin] != hosts[target])
        };
        // Round 2: segments; then the window's network (net/windows/setup.rs).
        store.set(&format!("seg/{rank}"), own.name().as_bytes())?;
        let net = WindowNetwork::start(
            NetPlan {
                store: &store,
                rank,
                size,
                by_net: &by_proxy,
                transport: s.transport,
                memory: WindowMemory::Host {
                    data: (data, spec.bytes),
                    pad: (pad, pad_len),
                },
                timeout: spec.timeout,
                deadline,
            },
            || Ok(mem),
        )?;
        let mut paths = Vec::with_capacity(size);
        for t in 0..size {
            paths.push(if t == rank {
                Path::Local
            } else if let Some(link) = &net.links[t] {
                Path::Net(link.clone())
            } else {
                let name = String::from_utf8_lossy(&store.get(&format!("seg/{t}"), left())?).into_owned();
                let seg = Arc::new(Segment::open(&name, data_len + pad_len)?);
                let watch = ProcessWatch::open(seg.owner_pid());
                // Every rank lays its segment out alike: data, then the pad.
                // SAFETY: the pad lies inside the mapping (same sizes, checked by `open`).
                let pad = unsafe { seg.payload().add(data_len) };
                Path::Mapped {
                    mem: Memory {
                        data: seg.payload(),
                        pad,
                        ..mem
                    },
                    seg,
                    watch,
                }
            });
        }

        let w = CpuWindow {
            rank,
            own,
            mem,
            paths,
            abort: s.abort.clone(),
            faults: s.faults.scoped(&format!("window{}", spec.id)),
            net,
            queue: Mutex::new(None),
            timeout: spec.timeout,
            born: Instant::now(),
            last_probe: AtomicU64::new(0),
        };
        store.set(&format!("ready/{rank}"), b"1")?;
        let keys: Vec<String> = (0..size).map(|r| format!("ready/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let waited = store.wait(&refs, left());
        w.own.unlink();
        waited?;
        Ok(w)
    }

    /// The memory of `rank` if we can touch it directly (ourselves or a mapped peer).
    fn direct(&self, rank: usize) -> Option<&Memory> {
        match &self.paths[rank] {
            Path::Local => Some(&self.mem),
            Path::Mapped { mem, .. } => Some(mem),
            Path::Net(_) => None,
        }
    }

    /// The link to `rank` (only called when `direct` is `None`).
    fn link(
        &self,
        rank: usize,
        writes: bool,
    ) -> Result<std::sync::MutexGuard<'_, Box<dyn crate::net::windows::link::Link>>> {
        match &self.paths[rank] {
            Path::Net(link) => Ok(link.lock(writes)),
            _ => Err(Error::protocol("window", format!("rank {rank} has no network path"))),
        }
    }

    /// Whether `p` can still write to us, and if not, why.
    /// Whether `p` can still write to us, and if not, which rank is at the root of it.
    fn peer_state(&self, p: usize, probe_process: bool) -> std::result::Result<(), PeerGone> {
        match &self.paths[p] {
            Path::Local => Ok(()),
            Path::Mapped { seg, watch, .. } => check_owner(p, seg, watch.as_ref().filter(|_| probe_process)),
            Path::Net(_) if self.net.lost(p) => Err(PeerGone {
                rank: p,
                reason: "its connection to this rank's server closed".into(),
            }),
            Path::Net(_) => Ok(()),
        }
    }

    /// Records in our segment that we failed because `rank` was lost, so ranks waiting on us
    /// report `rank` too; reports the communicator's first cause (see net/links/fault.rs).
    fn note_loss<T>(&self, r: Result<T>) -> Result<T> {
        // A timed-out wait is not a loss: nothing is half done, and the caller may wait again.
        let e = match r {
            Err(e @ Error::PeerLost { .. }) => self.faults.resolve(e),
            other => return other,
        };
        if let Error::PeerLost { peer, .. } = &e {
            self.own.set_state(OwnerState::Lost(*peer));
        }
        Err(e)
    }

    /// Before a one-sided access to a mapped peer: is it still there? The state word is one
    /// load; the process probe (a syscall) runs at most once a millisecond per window.
    fn ensure_alive(&self, op: &'static str, rank: usize) -> Result<()> {
        if !matches!(self.paths[rank], Path::Mapped { .. }) {
            return Ok(());
        }
        let now = self.born.elapsed().as_micros() as u64;
        let probe = now.saturating_sub(self.last_probe.load(Ordering::Relaxed)) >= 1000;
        if probe {
            self.last_probe.store(now, Ordering::Relaxed);
        }
        let r = self.peer_state(rank, probe).map_err(|g| Error::PeerLost {
            op,
            peer: g.rank,
            reason: g.reason,
        });
        self.note_loss(r)
    }

    fn read_signals(&self, id: usize, from: SignalSource, cmp: Cmp, value: u64) -> Option<Observed> {
        let slot = |src: usize| self.mem.slot(id, src).load(Ordering::Acquire);
        match from {
            SignalSource::Rank(r) => {
                let v = slot(r);
                cmp.holds(v, value).then_some(Observed {
                    source: Some(r),
                    value: v,
                })
            }
            SignalSource::Any => (0..self.mem.size).find_map(|r| {
                let v = slot(r);
                cmp.holds(v, value).then_some(Observed {
                    source: Some(r),
                    value: v,
                })
            }),
            SignalSource::Sum => {
                let v = (0..self.mem.size).fold(0u64, |a, r| a.wrapping_add(slot(r)));
                cmp.holds(v, value).then_some(Observed { source: None, value: v })
            }
        }
    }
}

impl WindowBackend for CpuWindow {
    fn put(&self, dst: usize, offset: usize, src: &[u8]) -> Result<()> {
        self.ensure_alive("put", dst)?;
        let Some(m) = self.direct(dst) else {
            return self.note_loss(self.link(dst, true)?.put(offset, src));
        };
        // SAFETY: `Window` checked the range against the segment size.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), m.data.add(offset), src.len()) };
        Ok(())
    }

    fn get(&self, src: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.ensure_alive("get", src)?;
        let Some(m) = self.direct(src) else {
            return self.note_loss(self.link(src, false)?.get(offset, dst));
        };
        // SAFETY: as in `put`.
        unsafe { std::ptr::copy_nonoverlapping(m.data.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn signal(&self, dst: usize, id: usize, op: SignalOp, value: u64) -> Result<()> {
        self.ensure_alive("signal", dst)?;
        match self.direct(dst) {
            Some(m) => {
                m.apply_signal(id, self.rank, op, value);
                Ok(())
            }
            None => self.note_loss(self.link(dst, true)?.signal(id, op, value)),
        }
    }

    fn wait_signal(&self, id: usize, from: SignalSource, cmp: Cmp, value: u64, timeout: Duration) -> Result<Observed> {
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        let mut next_check = Instant::now() + Duration::from_millis(5);
        loop {
            if let Some(o) = self.read_signals(id, from, cmp, value) {
                return Ok(o);
            }
            spins = spins.saturating_add(1);
            if spins < 64 {
                std::hint::spin_loop();
                continue;
            }
            if spins < 2048 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            let now = Instant::now();
            if now < next_check {
                continue;
            }
            next_check = now + Duration::from_millis(5);
            let peer = match from {
                SignalSource::Rank(r) => Some(r),
                _ => None,
            };
            if self.abort.load(Ordering::Acquire) {
                return Err(Error::Closed {
                    op: "wait_signal",
                    state: "aborted",
                });
            }
            if now >= deadline {
                return self.note_loss(Err(Error::Timeout {
                    op: "wait_signal",
                    peer,
                    after: timeout,
                }));
            }
            let watched: Vec<usize> = peer.map_or_else(|| (0..self.mem.size).collect(), |r| vec![r]);
            if let Some(g) = watched.into_iter().find_map(|p| self.peer_state(p, true).err()) {
                // A peer's last signal may have landed just before it left: look once more.
                if let Some(o) = self.read_signals(id, from, cmp, value) {
                    return Ok(o);
                }
                return self.note_loss(Err(Error::PeerLost {
                    op: "wait_signal",
                    peer: g.rank,
                    reason: g.reason,
                }));
            }
        }
    }

    fn fetch_add(&self, dst: usize, offset: usize, value: u64) -> Result<u64> {
        self.ensure_alive("fetch_add", dst)?;
        match self.direct(dst) {
            Some(m) => Ok(m.word(offset).fetch_add(value, Ordering::AcqRel)),
            None => self.note_loss(self.link(dst, false)?.fetch_add(offset, value)),
        }
    }

    fn compare_swap(&self, dst: usize, offset: usize, expected: u64, desired: u64) -> Result<u64> {
        self.ensure_alive("compare_swap", dst)?;
        match self.direct(dst) {
            Some(m) => Ok(m
                .word(offset)
                .compare_exchange(expected, desired, Ordering::AcqRel, Ordering::Acquire)
                .unwrap_or_else(|v| v)),
            None => self.note_loss(self.link(dst, false)?.compare_swap(offset, expected, desired)),
        }
    }

    fn fence(&self) -> Result<()> {
        // Mapped stores: a release fence orders them; proxy streams are FIFO already.
        std::sync::atomic::fence(Ordering::Release);
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        std::sync::atomic::fence(Ordering::SeqCst);
        for p in &self.paths {
            if let Path::Net(link) = p {
                link.flush_if_dirty()?;
            }
        }
        Ok(())
    }

    fn local_base(&self) -> *mut u8 {
        self.mem.data
    }

    fn remote_base(&self, rank: usize) -> Option<*mut u8> {
        self.direct(rank).map(|m| m.data)
    }

    fn proxy_queue(&self) -> Result<Arc<dyn std::any::Any + Send + Sync>> {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = &*q {
            return Ok(q.clone());
        }
        let links = net_links(&self.paths);
        if links.iter().all(Option::is_none) {
            return Err(Error::Unavailable {
                backend: "cpu".into(),
                reason: "no rank of this window is reached over the network, so it has no proxy queue".into(),
            });
        }
        let limits = Limits {
            size: self.mem.size,
            bytes: self.mem.bytes,
            signals: self.mem.signals,
        };
        let started = Arc::new(HostQueue::start(
            links,
            Box::new(HostData(self.mem.data)),
            limits,
            self.timeout,
        )?);
        *q = Some(started.clone());
        Ok(started)
    }
}

impl Drop for CpuWindow {
    fn drop(&mut self) {
        self.own.close();
        // The proxy thread reads our memory: it stops first; then the servers and the RDMA
        // registrations, before the memory (maybe a user buffer) goes away.
        drop(self.queue.lock().unwrap_or_else(|p| p.into_inner()).take());
        self.net.stop();
    }
}
