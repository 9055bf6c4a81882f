//! The `device` backend: windows in GPU memory that kernels drive (device-api), with the same
//! host verbs as CPU windows. Collectives on host buffers, and the control plane of window
//! creation, run on the CPU engine underneath; collectives on device buffers go to NCCL, to
//! ferrocomm's one-shot kernels (collectives.rs) or through the host (host_staged.rs), as route.rs
//! decides.
//!
//! May import: the contracts, bootstrap, the network, the GPU wing and the other backends
//! (the CPU engine underneath, NCCL beside it).

mod call_order;
mod collectives;
mod host_staged;
mod moe;
mod multicast;
mod rank;
mod route;
mod topology;
mod window;

use super::cpu;
use super::nccl::NcclBackend;
use super::norm_pass::NormPass;
use crate::bootstrap::PrefixStore;
use crate::contracts::backend::{hint_ignored, Backend, BackendInit, LentLinks, LinkLedger, RunOptions};
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::{Location, Op};
use crate::contracts::placement::Device;
use crate::contracts::store::Store;
use crate::contracts::window::{WindowBackend, WindowSpec};
use crate::gpu::memory::Pinned;
use rank::DeviceRank;
use route::{NormRoute, Policy, Route};
use std::sync::Arc;

pub(crate) struct DeviceBackend {
    /// What windows and the own collectives use too.
    me: DeviceRank,
    /// NCCL for collectives on device buffers, where every rank has it and a GPU of its own.
    nccl: Option<NcclBackend>,
    /// ferrocomm's own collective kernels, where every rank is on this host.
    own: Option<collectives::OwnCollectives>,
    /// ferrocomm's own MoE dispatch / combine kernels (peers on other hosts through the proxy).
    moe: Option<moe::OwnMoe>,
    /// The fused norm's steps apart (NCCL's fallback, the hint `algorithm` = `unfused`).
    norm_pass: Option<NormPass>,
    policy: Policy,
    /// Another rank of this process runs on this GPU: own kernels need a stream per rank.
    gpu_shared_in_process: bool,
}

pub(crate) fn create(init: &BackendInit) -> Result<Box<dyn Backend>> {
    let (gpu, ordinal) = match init.device {
        Device::Cuda(ordinal) => (crate::gpu::target::Gpu::Cuda(ordinal), ordinal),
        Device::Host(_) => (crate::gpu::target::Gpu::Host, 0),
        other => {
            return Err(Error::Unavailable {
                backend: "device".into(),
                reason: format!("it drives CUDA devices and the host device, not {other:?}"),
            })
        }
    };
    gpu.open()?;
    let abort_flag: Arc<Pinned<u32>> = Arc::new(gpu.records(1)?);
    let team = topology::agree(init, gpu)?;
    if team.gpu_shared_in_process[init.rank] {
        if let Some(why) = crate::gpu::cuda::queues::shared_gpu_concern() {
            tracing::warn!(rank = init.rank, "ranks share GPU {ordinal} in this process: {why}");
        }
    }
    let nccl = join_nccl(init, &team)?;
    if let Err(why) = &team.multicast {
        tracing::debug!(reason = %why, "device windows without multicast objects");
    }
    let policy = Policy::new(nccl.is_some(), init.options.config.nccl_threshold);
    let mut backend = DeviceBackend {
        me: DeviceRank {
            gpu,
            timeout: init.options.timeout,
            ordinal,
            rank: init.rank,
            size: init.size,
            host: Arc::new(cpu::create_host(init)?),
            store: init.store.clone(),
            transport: init.options.transport.clone(),
            abort_flag,
            multicast: team.multicast.is_ok(),
            one_host: team.one_host,
        },
        nccl,
        own: None,
        moe: None,
        norm_pass: None,
        policy,
        gpu_shared_in_process: team.gpu_shared_in_process[init.rank],
    };
    backend.own = match collectives::OwnCollectives::create(&backend.me, init.options) {
        Ok(own) => Some(own),
        Err(Error::Unavailable { reason, .. }) => {
            tracing::debug!(%reason, "device backend without its own collective kernels");
            None
        }
        Err(e) => return Err(e),
    };
    backend.moe = match moe::OwnMoe::create(&backend.me) {
        Ok(moe) => Some(moe),
        Err(Error::Unavailable { reason, .. }) => {
            tracing::debug!(%reason, "device backend without its own MoE kernels");
            None
        }
        Err(e) => return Err(e),
    };
    backend.norm_pass = match NormPass::load(gpu) {
        Ok(pass) => Some(pass),
        Err(Error::Unavailable { reason, .. }) => {
            tracing::debug!(%reason, "device backend without the norm pass's kernels");
            None
        }
        Err(e) => return Err(e),
    };
    Ok(Box::new(backend))
}

/// NCCL joins where the team agreed it can; without it the backend works on, by its own path.
fn join_nccl(init: &BackendInit, team: &topology::Team) -> Result<Option<NcclBackend>> {
    if let Err(why) = &team.nccl {
        tracing::debug!(reason = %why, "device backend without NCCL: collectives on device buffers use its own path");
        return Ok(None);
    }
    let scoped: Arc<dyn Store> = Arc::new(PrefixStore::new("nccl", init.store.clone()));
    let nccl_init = BackendInit { store: scoped, ..*init };
    NcclBackend::create(&nccl_init, false).map(Some)
}

impl DeviceBackend {
    /// Ranks that share a GPU in one process cannot run their collective kernels on the
    /// legacy default stream (raw 0 or `CU_STREAM_LEGACY`), which every thread shares: one
    /// rank's kernel would queue behind another's that waits for it, until the timeout.
    fn check_own_stream(&self, op: &'static str, stream: u64) -> Result<()> {
        const LEGACY: u64 = 1;
        if self.gpu_shared_in_process && (stream == 0 || stream == LEGACY) {
            return Err(Error::invalid(
                op,
                "ranks that share a GPU in one process need a stream each \
                 (ferrocomm::device::use_stream): on the legacy default stream one rank's \
                 kernel would wait behind another's that waits for it",
            ));
        }
        Ok(())
    }
}

impl DeviceBackend {
    /// The fused norm `op` as its steps apart: the all_reduce of the f32 sums takes the usual
    /// route (the hint `route` applies to it; `algorithm` was the norm's), synchronously on the
    /// issuing stream, where the steps after it are enqueued too.
    fn run_norm_pass(&self, pass: &NormPass, op: &mut Op<'_>, opts: &RunOptions) -> Result<()> {
        let Op::AllReduceRmsNorm(f) = op else {
            return Err(Error::invalid(op.name(), "the norm pass runs the fused norm only"));
        };
        if self.me.gpu != crate::gpu::target::Gpu::Host {
            crate::gpu::cuda::context(self.me.ordinal)?;
        }
        let mut hints = opts.hints.clone();
        hints.remove("algorithm");
        let inner = RunOptions {
            hints: &hints,
            fence: None,
            ..*opts
        };
        pass.run(f, opts.stream, opts.timeout, |sum| self.run(sum, &inner))
    }
}

/// Runs `run` with `opts` narrowed to the hints the CPU engine knows (see `route::engine_hints`).
fn on_engine(op: &'static str, opts: &RunOptions, run: impl FnOnce(&RunOptions) -> Result<()>) -> Result<()> {
    let hints = route::engine_hints(op, opts.hints);
    run(&RunOptions { hints: &hints, ..*opts })
}

impl Backend for DeviceBackend {
    fn name(&self) -> &'static str {
        "device"
    }

    /// Operations on host buffers (and barriers) run on the CPU engine (same semantics, same
    /// oracle); on device buffers, through NCCL or the backend's own path (see `route`).
    fn run(&self, op: &mut Op<'_>, opts: &RunOptions) -> Result<()> {
        let name = op.name();
        route::check_hints(name, opts.hints)?;
        // MoE dispatch / combine: the own kernels wherever they take the shape (the same
        // decision for both halves on every rank: see moe.rs), on the host device or on device
        // buffers; otherwise the paths below (CPU engine, staged copy).
        if let Some(moe) = self.moe.as_ref().filter(|m| m.supports(op)) {
            if self.me.gpu == crate::gpu::target::Gpu::Host {
                return moe.run(&self.me, op, opts.stream, opts.timeout);
            }
            if matches!(op.location()?, Some(Location::Cuda(_))) {
                crate::gpu::cuda::context(self.me.ordinal)?;
                self.check_own_stream(name, opts.stream)?;
                return moe.run(&self.me, op, opts.stream, opts.timeout);
            }
        }
        if matches!(op, Op::AllReduceRmsNorm(_)) {
            if let Some(pass) = &self.norm_pass {
                let host_device = self.me.gpu == crate::gpu::target::Gpu::Host;
                let reach = host_device || matches!(op.location()?, Some(Location::Cuda(_)));
                let fused = self.own.as_ref().is_some_and(|k| k.supports(op, opts.hints));
                if route::norm_route(opts.hints, reach, fused, self.nccl.is_some()) == NormRoute::Unfused {
                    return self.run_norm_pass(pass, op, opts);
                }
            }
        }
        if self.me.gpu == crate::gpu::target::Gpu::Host {
            // Host memory is the host device's memory: its kernels run what they can, unless
            // the hints ask for one of the CPU engine's algorithms.
            return match self.own.as_ref() {
                Some(kernels) if !route::wants_engine(opts.hints) && kernels.supports(op, opts.hints) => {
                    kernels.run(op, opts.hints, opts.stream, opts.timeout)
                }
                _ => on_engine(name, opts, |o| self.me.host.run(op, o)),
            };
        }
        if !matches!(op.location()?, Some(Location::Cuda(_))) {
            if let Some(r) = opts.hints.get("route") {
                hint_ignored("device", name, "route", r, "host buffers run on the CPU engine");
            }
            return on_engine(name, opts, |o| self.me.host.run(op, o));
        }
        // The issuing thread, or the worker for an asynchronous call, may not have the GPU's
        // context current yet.
        crate::gpu::cuda::context(self.me.ordinal)?;
        let own = self.own.as_ref().filter(|k| k.supports(op, opts.hints));
        match (self.policy.choose(op, opts.hints, own.is_some())?, &self.nccl, own) {
            (Route::Nccl, Some(nccl), _) => {
                if let Some(a) = opts.hints.get("algorithm") {
                    hint_ignored(
                        "device",
                        name,
                        "algorithm",
                        a,
                        "NCCL runs this operation and picks its own",
                    );
                }
                nccl.run_device(op, opts)
            }
            (_, _, Some(kernels)) => {
                self.check_own_stream(name, opts.stream)?;
                kernels.run(op, opts.hints, opts.stream, opts.timeout)
            }
            _ => on_engine(name, opts, |o| host_staged::run(&self.me.host, op, o)),
        }
    }

    /// A refused MoE send half or fused norm on the own kernels takes part far enough to fail
    /// every peer at once (`OwnMoe::refuse`: a header flagged refused in every peer's slot;
    /// `OwnCollectives::refuse_norm`: a launch whose headers say refused); an operation the CPU
    /// engine runs on every rank (host buffers, the host device's engine) is refused by the
    /// engine, in band, as on the `cpu` backend. Not where the peers' route cannot be told
    /// (a fused norm of an element type it does not take, device buffers the kernels do not
    /// take) nor the fused norm's steps apart (an all_reduce by NCCL or the own kernels, then
    /// the norm): there the peers wait until their timeout, as NCCL's do.
    fn refuse(&self, op: &Op<'_>, reason: &str, opts: &RunOptions) {
        if !op.refused_in_band() {
            return;
        }
        let host_device = self.me.gpu == crate::gpu::target::Gpu::Host;
        let on_gpu = matches!(op.location(), Ok(Some(Location::Cuda(_))));
        // The own kernels need the GPU's context and a stream they may use.
        let ready = || {
            host_device
                || crate::gpu::cuda::context(self.me.ordinal)
                    .and_then(|_| self.check_own_stream(op.name(), opts.stream))
                    .is_ok()
        };
        let told = |r: Result<()>| {
            if let Err(e) = r {
                tracing::debug!(rank = self.me.rank, error = %e, "the peers could not be told of a refused {}", op.name());
            }
        };
        if let Some(moe) = self.moe.as_ref().filter(|m| m.supports(op)) {
            if host_device || on_gpu {
                if ready() {
                    told(moe.refuse(&self.me, op, opts.stream, opts.timeout));
                }
                return;
            }
        }
        if let Op::AllReduceRmsNorm(f) = op {
            // An element type the fused norm does not take, often the reason for the refusal,
            // says nothing of the route the peers' calls took: nothing can be told then.
            if crate::gpu::kernels::norm_suffix(f.x.dtype(), f.quantised()).is_none() {
                return;
            }
            // The route `run` would take, from what does not depend on the refused lengths.
            let own = self.own.as_ref().filter(|k| k.takes_norm(f, opts.hints));
            let reach = host_device || on_gpu;
            if self.norm_pass.is_some()
                && route::norm_route(opts.hints, reach, own.is_some(), self.nccl.is_some()) == NormRoute::Unfused
            {
                return;
            }
            let kernels = own.filter(|_| {
                if host_device {
                    !route::wants_engine(opts.hints)
                } else {
                    on_gpu && self.policy.choose(op, opts.hints, true).is_ok_and(|r| r == Route::Own)
                }
            });
            if let Some(k) = kernels {
                if ready() {
                    told(k.refuse_norm(f, opts.stream, opts.timeout));
                }
                return;
            }
        }
        // The CPU engine, where the peers' calls surely run there too: on the host device
        // (MoE shapes the own kernels do not take, the fused norm they cannot run), or on host
        // buffers. Not device buffers the kernels do not take, whose peers may have taken
        // the kernels or NCCL (their refusal could leave a message on the engine's links).
        if !host_device && !matches!(op.location(), Ok(None | Some(Location::Host))) {
            return;
        }
        told(on_engine(op.name(), opts, |o| {
            self.me.host.refuse(op, reason, o);
            Ok(())
        }));
    }

    fn abort(&self) {
        self.me.abort_flag.write(0, 1);
        if let Some(n) = &self.nccl {
            n.abort();
        }
        self.me.host.abort();
    }

    /// The host engine's links (its control plane and host-memory operations) go to a
    /// smaller communicator; the device side of that one is made anew.
    fn link_ledger(&self) -> Option<LinkLedger> {
        self.me.host.link_ledger()
    }

    fn lend_links(&self, members: &[usize], keep_board: bool, timeout: std::time::Duration) -> Result<LentLinks> {
        self.me.host.lend_links(members, keep_board, timeout)
    }

    fn finalize(&self) -> Result<()> {
        let r = self.nccl.as_ref().map_or(Ok(()), |n| n.finalize());
        let r = r.and(
            self.own
                .as_ref()
                .map_or(Ok(()), |k| k.check("finalize", self.me.timeout)),
        );
        let r = r.and(
            self.moe
                .as_ref()
                .map_or(Ok(()), |m| m.check("finalize", self.me.timeout)),
        );
        self.me.host.finalize()?;
        r
    }

    fn new_window(&self, spec: &WindowSpec) -> Result<Box<dyn WindowBackend>> {
        Ok(Box::new(window::DeviceWindow::create(&self.me, spec)?))
    }
}
