//! The CPU backend: host buffers, shared memory between ranks of one host, TCP between hosts.
//! It implements the whole API and is the oracle every other backend is tested against.

mod algorithms;
mod engine;
mod oneshot;
mod window;

use super::{Backend, BackendInit, RunOptions};
use crate::bootstrap::Store;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::ops::{Location, Op, P2p};
use crate::options::{env_parse, TransportOptions};
use crate::transport::{self, OwnerState};
use crate::window::{WindowBackend, WindowSpec};
use algorithms::{Algo, Scratch};
use engine::{Engine, OpCtx, Tag, Xfer};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Size thresholds of algorithm choice. `FERROCOMM_CPU_DIRECT_MAX` (bytes per rank, default
/// 64 KiB): at or below, direct exchanges; above, ring or chain. `FERROCOMM_CPU_CHUNK` (default
/// 256 KiB): the pipelining unit of broadcast.
#[derive(Clone, Copy, Debug)]
struct Tuning {
    direct_max: usize,
    chunk: usize,
}

impl Tuning {
    fn from_env() -> Result<Tuning> {
        let chunk = env_parse("FERROCOMM_CPU_CHUNK")?.unwrap_or(256 << 10);
        if chunk == 0 {
            return Err(Error::Config("FERROCOMM_CPU_CHUNK must be positive".into()));
        }
        Ok(Tuning {
            direct_max: env_parse("FERROCOMM_CPU_DIRECT_MAX")?.unwrap_or(64 << 10),
            chunk,
        })
    }

    fn choose(&self, op: &'static str, bytes: usize, opts: &RunOptions) -> Result<Algo> {
        let algo = match opts.hints.get("algorithm").map(String::as_str) {
            Some("direct") => Algo::Direct,
            Some("ring") => Algo::Ring,
            Some("oneshot") => {
                return Err(Error::invalid(
                    op,
                    "the `oneshot` algorithm serves all_reduce, all_gather and all_to_all only",
                ))
            }
            Some(other) => {
                return Err(Error::invalid(
                    op,
                    format!("unknown algorithm hint `{other}` (cpu backend: oneshot, direct, ring)"),
                ))
            }
            None if bytes <= self.direct_max => Algo::Direct,
            None => Algo::Ring,
        };
        tracing::trace!(op, bytes, ?algo, "cpu algorithm");
        Ok(algo)
    }

    /// Does this all_reduce, all_gather or all_to_all go through the board (oneshot.rs)?
    /// `available`: every rank shares this host and a contribution fits a slot.
    fn use_board(&self, op: &'static str, bytes: usize, opts: &RunOptions, available: bool) -> Result<bool> {
        let board = match opts.hints.get("algorithm").map(String::as_str) {
            Some("oneshot") if !available => {
                return Err(Error::invalid(
                    op,
                    format!(
                        "the `oneshot` algorithm needs every rank on this host and at most {} KiB per rank",
                        transport::board::SLOT_BYTES >> 10
                    ),
                ))
            }
            Some("oneshot") => true,
            Some(_) => false,
            None => available && bytes <= self.direct_max,
        };
        if board {
            tracing::trace!(op, bytes, "cpu algorithm: oneshot");
        }
        Ok(board)
    }
}

struct State {
    engine: Engine,
    scratch: Scratch,
    /// Set by a failure in the middle of a transfer: the streams may be out of step, so later
    /// operations refuse to run rather than read garbage.
    broken: bool,
}

pub(crate) struct CpuBackend {
    state: Mutex<State>,
    abort: Arc<AtomicBool>,
    announce: transport::Announcer,
    tuning: Tuning,
    /// What windows need to set themselves up.
    rank: usize,
    size: usize,
    store: Arc<dyn Store>,
    transport: TransportOptions,
}

pub(crate) fn create(init: &BackendInit) -> Result<Box<dyn Backend>> {
    if init.device != crate::Device::Cpu {
        return Err(Error::Unavailable {
            backend: "cpu".into(),
            reason: format!("it runs on host memory, not on {:?}", init.device),
        });
    }
    Ok(Box::new(create_host(init)?))
}

/// The CPU engine for a communicator of any device: other backends run their host-memory
/// operations and their control plane (barriers, small exchanges) on it.
pub(crate) fn create_host(init: &BackendInit) -> Result<CpuBackend> {
    init.options.transport.validate()?;
    let tuning = Tuning::from_env()?;
    let t = transport::connect_all(
        init.rank,
        init.size,
        &*init.store,
        &init.options.transport,
        init.options.timeout,
    )?;
    let announce = t.announcer();
    Ok(CpuBackend {
        state: Mutex::new(State {
            engine: Engine::new(init.rank, init.size, t),
            scratch: Scratch::default(),
            broken: false,
        }),
        abort: Arc::new(AtomicBool::new(false)),
        announce,
        tuning,
        rank: init.rank,
        size: init.size,
        store: init.store.clone(),
        transport: init.options.transport.clone(),
    })
}

fn tag(code: u8, dtype: DType, op: Option<ReduceOp>) -> Tag {
    Tag {
        op: code,
        dtype: dtype as u8,
        redop: op.map_or(0, ReduceOp::code),
        nbytes: 0,
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn run(&self, op: &mut Op<'_>, opts: &RunOptions) -> Result<()> {
        let name = op.name();
        if let Some(Location::Cuda(ordinal)) = op.location()? {
            return Err(Error::invalid(
                name,
                format!("the cpu backend works on host memory; this buffer is on CUDA device {ordinal}"),
            ));
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::Closed {
                op: name,
                state: "aborted",
            });
        }
        if st.broken {
            return Err(Error::Closed {
                op: name,
                state: "broken by an earlier failed operation",
            });
        }
        let ctx = OpCtx {
            op: name,
            deadline: Instant::now() + opts.timeout,
            timeout: opts.timeout,
            abort: &self.abort,
        };
        let State {
            engine,
            scratch,
            broken,
        } = &mut *st;
        let r = self.dispatch(engine, scratch, &ctx, op, opts);
        if let Err(e) = &r {
            // Argument errors are found before any byte moves; everything else may leave a
            // message half sent.
            if !matches!(e, Error::InvalidArgument { .. }) {
                *broken = true;
                // Tell peers that wait on us which rank is at the root, so every survivor
                // reports the lost rank rather than the rank that failed next to it.
                self.announce.announce(match e {
                    Error::PeerLost { peer, .. } | Error::Timeout { peer: Some(peer), .. } => OwnerState::Lost(*peer),
                    _ => OwnerState::Aborted,
                });
            }
        }
        r
    }

    fn abort(&self) {
        self.abort.store(true, Ordering::Release);
        self.announce.announce(OwnerState::Aborted);
    }

    fn finalize(&self) -> Result<()> {
        self.announce.announce(OwnerState::Closed);
        Ok(())
    }

    fn new_window(&self, spec: &WindowSpec) -> Result<Box<dyn WindowBackend>> {
        let setup = window::Setup {
            rank: self.rank,
            size: self.size,
            store: &self.store,
            transport: &self.transport,
            abort: self.abort.clone(),
        };
        Ok(Box::new(window::CpuWindow::create(spec, &setup)?))
    }
}

impl CpuBackend {
    /// A barrier over the communicator, for backends that use this engine as control plane.
    pub(crate) fn run_barrier(&self, opts: &RunOptions) -> Result<()> {
        self.run(&mut Op::Barrier, opts)
    }

    fn dispatch(&self, e: &mut Engine, s: &mut Scratch, ctx: &OpCtx, op: &mut Op<'_>, opts: &RunOptions) -> Result<()> {
        let algo = |bytes: usize| self.tuning.choose(ctx.op, bytes, opts);
        match op {
            Op::AllReduce { buf, op } => {
                let (d, o, bytes) = (buf.dtype(), *op, buf.host_bytes().len());
                let t = tag(1, d, Some(o));
                if self.tuning.use_board(ctx.op, bytes, opts, oneshot::fits(e, bytes))? {
                    return oneshot::all_reduce(e, ctx, t, buf.host_bytes_mut(), d, o);
                }
                let a = algo(bytes)?;
                algorithms::all_reduce(e, s, ctx, t, buf.host_bytes_mut(), d, o, a)
            }
            Op::Reduce { buf, op, root } => {
                let (d, o) = (buf.dtype(), *op);
                let a = algo(buf.host_bytes().len())?;
                algorithms::reduce(e, s, ctx, tag(2, d, Some(o)), buf.host_bytes_mut(), d, o, *root, a)
            }
            Op::Broadcast { buf, root } => {
                let d = buf.dtype();
                let a = algo(buf.host_bytes().len())?;
                algorithms::broadcast(
                    e,
                    ctx,
                    tag(3, d, None),
                    buf.host_bytes_mut(),
                    *root,
                    a,
                    self.tuning.chunk,
                )
            }
            Op::AllGather { input, outputs } => {
                let t = tag(4, input.dtype(), None);
                let mut outs: Vec<&mut [u8]> = outputs.iter_mut().map(|o| o.host_bytes_mut()).collect();
                // Decided on what every rank knows alike (all_gather_v: counts differ by rank).
                let total = outs.iter().map(|o| o.len()).sum();
                let largest = outs.iter().map(|o| o.len()).max().unwrap_or(0);
                if self.tuning.use_board(ctx.op, total, opts, oneshot::fits(e, largest))? {
                    return oneshot::all_gather(e, ctx, t, input.host_bytes(), &mut outs);
                }
                let a = algo(total)?;
                algorithms::all_gather(e, ctx, t, input.host_bytes(), &mut outs, a)
            }
            Op::ReduceScatter { inputs, output, op } => {
                let (d, o) = (output.dtype(), *op);
                let ins: Vec<&[u8]> = inputs.iter().map(|i| i.host_bytes()).collect();
                let a = algo(ins.iter().map(|i| i.len()).sum())?;
                algorithms::reduce_scatter(e, s, ctx, tag(5, d, Some(o)), &ins, output.host_bytes_mut(), d, o, a)
            }
            Op::AllToAll { inputs, outputs } => {
                let t = tag(6, inputs[0].dtype(), None);
                let ins: Vec<&[u8]> = inputs.iter().map(|i| i.host_bytes()).collect();
                let mut outs: Vec<&mut [u8]> = outputs.iter_mut().map(|o| o.host_bytes_mut()).collect();
                // Whether the blocks fit is settled inside the round (all_to_all_v: sizes differ
                // by rank), so here only the board and the hint count.
                if self.tuning.use_board(ctx.op, 0, opts, oneshot::fits(e, 0))?
                    && oneshot::all_to_all(e, ctx, t, &ins, &mut outs)?
                {
                    return Ok(());
                }
                algorithms::all_to_all(e, ctx, t, &ins, &mut outs)
            }
            Op::Scatter { inputs, output, root } => {
                let ins: Option<Vec<&[u8]>> = inputs.as_ref().map(|v| v.iter().map(|i| i.host_bytes()).collect());
                let d = output.dtype();
                algorithms::scatter(e, ctx, tag(7, d, None), ins.as_deref(), output.host_bytes_mut(), *root)
            }
            Op::Gather { input, outputs, root } => {
                let mut outs: Option<Vec<&mut [u8]>> = outputs
                    .as_mut()
                    .map(|v| v.iter_mut().map(|o| o.host_bytes_mut()).collect());
                algorithms::gather(
                    e,
                    ctx,
                    tag(8, input.dtype(), None),
                    input.host_bytes(),
                    outs.as_deref_mut(),
                    *root,
                )
            }
            Op::Barrier if oneshot::fits(e, 0) => oneshot::barrier(e, ctx, tag(9, DType::U8, None)),
            Op::Barrier => algorithms::barrier(e, ctx, tag(9, DType::U8, None)),
            Op::Batch(list) => {
                let mut x: Vec<Xfer> = Vec::with_capacity(list.len());
                for p in list.iter_mut() {
                    x.push(match p {
                        P2p::Send { buf, peer } => e.send(*peer, tag(10, buf.dtype(), None), buf.host_bytes()),
                        P2p::Recv { buf, peer } => {
                            let t = tag(10, buf.dtype(), None);
                            e.recv(*peer, t, buf.host_bytes_mut())
                        }
                    });
                }
                e.exchange(ctx, &mut x)
            }
        }
    }
}
