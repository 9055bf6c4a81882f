//! The `nccl` backend: collectives and point-to-point on device buffers through libnccl,
//! loaded at run time (see [`library`]). Operations on host buffers (and the control plane:
//! split lists, objects) run on the CPU engine underneath, as on the `device` backend.
//!
//! Streams: a synchronous operation is enqueued on the issuing thread's current stream and
//! returns (CUDA graph capture works: nothing waits on a capturing stream); an asynchronous one
//! runs on the communicator's own stream, after the issuing stream's earlier work, and leaves an
//! event that `Work::wait` makes the waiter's stream wait for. A watchdog bounds every
//! enqueued operation by its timeout and aborts the communicator on expiry or on an NCCL
//! asynchronous error.
//!
//! May import: the contracts, bootstrap, the GPU wing and the CPU backend underneath.

mod calls;
mod comm;
mod watchdog;

pub(crate) use calls::reduces;

use super::cpu::{self, CpuBackend};
use super::norm_pass::NormPass;
use crate::contracts::backend::{Backend, BackendInit, LentLinks, LinkLedger, RunOptions};
use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::{Error, Result};
use crate::contracts::fence::Fence;
use crate::contracts::ops::{BufMut, DeviceBytes, Location, Op};
use crate::contracts::placement::Device;
use crate::gpu::cuda::{self, stream::Event};
use crate::gpu::nccl_library::{self as library, UniqueId, SPLIT_NOCOLOR};
use comm::NcclComm;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::ffi::c_int;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use watchdog::Watchdog;

pub(crate) struct NcclBackend {
    rank: usize,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    // Field order is drop order: the watchdog stops before the communicator goes.
    watchdog: Watchdog,
    comm: Arc<NcclComm>,
    /// Asynchronous operations run here.
    own_stream: Arc<CudaStream>,
    /// One element that barriers all-reduce.
    barrier_word: CudaSlice<f32>,
    /// The CPU engine for host buffers; `None` inside the device backend, which has its own.
    host: Option<CpuBackend>,
    /// The fused norm's steps around NCCL's all_reduce, loaded at the first call.
    norm_pass: Mutex<Option<Arc<NormPass>>>,
    timeout: Duration,
}

/// Why this rank cannot use NCCL, or `Ok` with the library and the GPU's context.
fn prerequisites(device: Device) -> Result<(&'static library::Nccl, usize, Arc<CudaContext>)> {
    let Device::Cuda(ordinal) = device else {
        return Err(Error::Unavailable {
            backend: "nccl".into(),
            reason: format!("NCCL works on CUDA devices, not {device:?}"),
        });
    };
    let lib = library::nccl()?;
    let ctx = cuda::context(ordinal).map_err(|e| match e {
        Error::Unavailable { reason, .. } => Error::Unavailable {
            backend: "nccl".into(),
            reason,
        },
        e => e,
    })?;
    Ok((lib, ordinal, ctx))
}

pub(crate) fn create(init: &BackendInit) -> Result<Box<dyn Backend>> {
    Ok(Box::new(NcclBackend::create(init, true)?))
}

impl NcclBackend {
    /// Joins the NCCL communicator of `init`'s group; `with_host` adds a CPU engine for
    /// operations on host buffers.
    pub(crate) fn create(init: &BackendInit, with_host: bool) -> Result<NcclBackend> {
        let timeout = init.options.timeout;
        // Rank 0 publishes the unique id, or why it has none, so that no rank waits for an id
        // that will never come.
        let ready = prerequisites(init.device);
        let id = exchange_id(init, ready.as_ref().map(|r| r.0).map_err(|e| e.to_string()))?;
        // Every rank says whether it can join before anyone enters the init, which would
        // otherwise wait out its timeout for a rank that never comes.
        agree(init, ready.as_ref().map(drop).map_err(|e| e.to_string()))?;
        let (lib, ordinal, ctx) = ready?;
        let comm = Arc::new(NcclComm::init(lib, init.size, id, init.rank, timeout)?);
        tracing::debug!(rank = init.rank, size = init.size, nccl = ?lib, "NCCL communicator ready");
        Self::around(comm, init, ordinal, ctx, with_host)
    }

    /// The backend around a ready NCCL communicator.
    fn around(
        comm: Arc<NcclComm>,
        init: &BackendInit,
        ordinal: usize,
        ctx: Arc<CudaContext>,
        with_host: bool,
    ) -> Result<NcclBackend> {
        let own_stream = ctx.new_stream().map_err(|e| cuda::err("cuStreamCreate", e))?;
        let barrier_word = own_stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| cuda::err("cuMemAlloc", e))?;
        own_stream
            .synchronize()
            .map_err(|e| cuda::err("cuStreamSynchronize", e))?;
        Ok(NcclBackend {
            rank: init.rank,
            ordinal,
            watchdog: Watchdog::start(comm.clone(), ctx.clone())?,
            ctx,
            comm,
            own_stream,
            barrier_word,
            host: with_host.then(|| cpu::create_host(init)).transpose()?,
            norm_pass: Mutex::new(None),
            timeout: init.options.timeout,
        })
    }

    /// Enqueues `op` (device buffers, or a barrier) and, unless the stream is being captured,
    /// has the watchdog bound it.
    pub(crate) fn run_device(&self, op: &mut Op<'_>, opts: &RunOptions) -> Result<()> {
        let name = op.name();
        self.watchdog.check(name)?;
        self.ctx.bind_to_thread().map_err(|e| cuda::err("cuCtxSetCurrent", e))?;
        let capturing = cuda::stream::is_capturing(opts.stream)?;
        // Asynchronous: the own stream, after the issuing stream's earlier work.
        let stream = match opts.fence {
            Some(_) => {
                let own = self.own_stream.cu_stream() as u64;
                Event::record_on(opts.stream)?.make_wait(own)?;
                own
            }
            None => opts.stream,
        };
        // A barrier is an all-reduce of one word: every rank must arrive for it to finish.
        let word;
        let is_barrier = matches!(op, Op::Barrier);
        let issued: &Op = match op {
            Op::Barrier => {
                let (ptr, _sync) = self.barrier_word.device_ptr(&self.own_stream);
                let bytes = DeviceBytes {
                    ordinal: self.ordinal,
                    ptr,
                    len: 4,
                };
                word = Op::AllReduce {
                    buf: BufMut::device(bytes, DType::F32),
                    op: ReduceOp::Sum,
                };
                &word
            }
            op => op,
        };
        calls::issue(&self.comm, issued, self.rank, stream as library::Stream, opts.timeout)?;
        if capturing {
            // Recorded into the graph; replays are bounded by the stream's user, not here.
            return Ok(());
        }
        if is_barrier {
            // A barrier returns once every rank reached it and this rank's earlier GPU work on
            // the stream is done.
            let r = Event::record_on(stream)?.wait("barrier", opts.timeout);
            if r.is_err() {
                self.comm.abort();
            }
            return r;
        }
        if let Some(slot) = opts.fence {
            slot.set(Box::new(EventFence {
                event: Event::record_on(stream)?,
                ctx: self.ctx.clone(),
            }));
        }
        self.watchdog.track(name, stream, opts.timeout)
    }
}

impl NcclBackend {
    /// The norm pass's kernels (backend/norm_pass.rs), loaded once.
    fn norm_pass(&self) -> Result<Arc<NormPass>> {
        self.ctx.bind_to_thread().map_err(|e| cuda::err("cuCtxSetCurrent", e))?;
        let mut slot = self.norm_pass.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = slot.as_ref() {
            return Ok(p.clone());
        }
        let p = Arc::new(NormPass::load(crate::gpu::target::Gpu::Cuda(self.ordinal))?);
        *slot = Some(p.clone());
        Ok(p)
    }
}

/// Rank 0's unique id (or its reason for having none) through the store.
fn exchange_id(init: &BackendInit, lib: std::result::Result<&'static library::Nccl, String>) -> Result<UniqueId> {
    const KEY: &str = "nccl/unique_id";
    let unavailable = |reason: String| Error::Unavailable {
        backend: "nccl".into(),
        reason,
    };
    if init.rank == 0 {
        let id = lib.map_err(&unavailable).and_then(|lib| lib.unique_id());
        let value = match &id {
            Ok(id) => [&[1u8][..], &id.0[..]].concat(),
            Err(e) => [&[0u8][..], format!("rank 0 has no NCCL: {e}").as_bytes()].concat(),
        };
        init.store.set(KEY, &value)?;
        return id;
    }
    let v = init.store.get(KEY, init.options.timeout)?;
    match v.split_first() {
        Some((1, id)) if id.len() == 128 => {
            let mut out = UniqueId([0; 128]);
            out.0.copy_from_slice(id);
            Ok(out)
        }
        Some((0, why)) => Err(unavailable(String::from_utf8_lossy(why).into_owned())),
        _ => Err(Error::Protocol {
            context: "nccl unique id",
            reason: format!("malformed value of {} bytes in the store", v.len()),
        }),
    }
}

/// Publishes whether this rank can join and checks every other rank's answer. A rank that
/// cannot join reports its own reason (to its caller) without waiting for the others.
fn agree(init: &BackendInit, mine: std::result::Result<(), String>) -> Result<()> {
    let Ok(()) = mine else {
        let why = mine.err().unwrap_or_default();
        return init
            .store
            .set(&format!("nccl/ready/{}", init.rank), format!("0{why}").as_bytes());
    };
    let all = crate::bootstrap::all_gather(
        &*init.store,
        "nccl/ready",
        init.rank,
        init.size,
        b"1",
        init.options.timeout,
    )?;
    match all.iter().enumerate().find(|(_, v)| v.first() != Some(&b'1')) {
        Some((r, v)) => Err(Error::Unavailable {
            backend: "nccl".into(),
            reason: format!(
                "rank {r} cannot join: {}",
                String::from_utf8_lossy(v.get(1..).unwrap_or_default())
            ),
        }),
        None => Ok(()),
    }
}

/// The event behind an asynchronous operation. Waiters may be threads that never touched
/// CUDA, so the GPU's context is made current first.
struct EventFence {
    event: Event,
    ctx: Arc<CudaContext>,
}

impl Fence for EventFence {
    fn is_complete(&self) -> Result<bool> {
        self.ctx.bind_to_thread().map_err(|e| cuda::err("cuCtxSetCurrent", e))?;
        self.event.is_complete()
    }
    fn stream_wait(&self, stream: u64) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| cuda::err("cuCtxSetCurrent", e))?;
        self.event.make_wait(stream)
    }
}

impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn run(&self, op: &mut Op<'_>, opts: &RunOptions) -> Result<()> {
        match op.location()? {
            Some(Location::Host) => match &self.host {
                Some(h) => h.run(op, opts),
                None => Err(Error::invalid(
                    op.name(),
                    "this NCCL communicator runs device buffers only",
                )),
            },
            _ => {
                // NCCL picks its algorithms itself (NCCL_ALGO and the like are its knobs).
                crate::contracts::backend::unknown_hints_ignored("nccl", op.name(), opts.hints, &[]);
                match op {
                    Op::AllReduceRmsNorm(f) => {
                        let inner = RunOptions { fence: None, ..*opts };
                        self.norm_pass()?
                            .run(f, opts.stream, opts.timeout, |sum| self.run_device(sum, &inner))
                    }
                    op => self.run_device(op, opts),
                }
            }
        }
    }

    fn abort(&self) {
        self.comm.abort();
        if let Some(h) = &self.host {
            h.abort();
        }
    }

    /// Only the host engine's links go to a smaller communicator; NCCL's own comes anew.
    fn link_ledger(&self) -> Option<LinkLedger> {
        self.host.as_ref()?.link_ledger()
    }

    fn lend_links(&self, members: &[usize], keep_board: bool, timeout: Duration) -> Result<LentLinks> {
        match &self.host {
            Some(h) => h.lend_links(members, keep_board, timeout),
            None => Err(Error::Unavailable {
                backend: "nccl".into(),
                reason: "it has no host engine whose links could be handed on".into(),
            }),
        }
    }

    fn finalize(&self) -> Result<()> {
        let r = self.comm.finalize(self.timeout);
        if let Some(h) = &self.host {
            h.finalize()?;
        }
        r
    }

    /// `ncclCommSplit`: color is the group's first parent rank, key the position in the group.
    fn split(&self, group: &[usize], init: Option<&BackendInit>) -> Option<Result<Option<Box<dyn Backend>>>> {
        let r = (|| {
            self.watchdog.check("split")?;
            let (color, key) = match group.iter().position(|&r| r == self.rank) {
                Some(k) => (group[0] as c_int, k as c_int),
                None => (SPLIT_NOCOLOR, 0),
            };
            let child = self.comm.split(color, key, self.timeout)?;
            match (child, init) {
                (Some(c), Some(init)) => {
                    let with_host = self.host.is_some();
                    let b = Self::around(Arc::new(c), init, self.ordinal, self.ctx.clone(), with_host)?;
                    Ok(Some(Box::new(b) as Box<dyn Backend>))
                }
                (None, None) => Ok(None),
                _ => Err(Error::InvalidSplit(
                    "NCCL's split disagrees with ferrocomm's group membership".into(),
                )),
            }
        })();
        Some(r)
    }
}
