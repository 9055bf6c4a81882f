//! The CPU backend: host buffers, shared memory between ranks of one host, TCP between hosts.
//! It implements the whole API and is the oracle every other backend is tested against.
//!
//! May import: the contracts, bootstrap and the network (links and the window path).

mod algorithms;
mod broadcast_tree;
mod engine;
mod header;
mod held_calls;
mod idle_senders;
mod inference;
mod late_calls;
mod oneshot;
mod two_level;
mod window;

use crate::contracts::backend::{Backend, BackendInit, LentLinks, LinkLedger, RunOptions};
use crate::contracts::config::Config;
use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::{Op, P2p};
use crate::contracts::options::TransportOptions;
use crate::contracts::store::Store;
use crate::contracts::window::{WindowBackend, WindowSpec};
use crate::net::links::{self, Cause, FaultRecord, OwnerState};
use algorithms::{Algo, Scratch};
use engine::{Engine, OpCtx, Xfer, Xfers};
use header::{Call, Tag, ANY_COUNT};
use oneshot::RoundOp;
use smallvec::SmallVec;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Algorithm choice. `FERROCOMM_CPU_DIRECT_MAX` (bytes per rank, default 64 KiB): at or below,
/// direct exchanges; above, ring or chain. `FERROCOMM_CPU_CHUNK` (default 256 KiB): the
/// pipelining unit of broadcast. The hint `algorithm` = `oneshot` (shared-memory rounds),
/// `direct`, `ring` or `two_level` (all_reduce across machines, two_level.rs) overrides the
/// size rule where it can be honoured and is ignored where not; any other value is refused
/// (see `CommOptions::hints`).
#[derive(Clone, Copy, Debug)]
struct Tuning {
    direct_max: usize,
    chunk: usize,
}

impl Tuning {
    fn from_config(c: &Config) -> Tuning {
        Tuning {
            direct_max: c.cpu_direct_max,
            chunk: c.cpu_chunk,
        }
    }

    /// The operations that may run as shared-memory rounds: `use_board` decides for them first.
    const BOARD_OPS: [&'static str; 5] = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"];

    /// The algorithm of every operation but the shared-memory rounds: the hint's, else by size.
    fn choose(&self, op: &'static str, bytes: usize, opts: &RunOptions) -> Result<Algo> {
        // `use_board` saw the hints of the board operations first and said what it ignored.
        let first_look = !Self::BOARD_OPS.contains(&op);
        let algo = match Self::wanted(op, opts.hints, first_look)? {
            Some(Wanted::Direct) => Algo::Direct,
            Some(Wanted::Ring) => Algo::Ring,
            wanted => {
                if wanted == Some(Wanted::OneShot) && first_look {
                    crate::contracts::backend::hint_ignored(
                        "cpu",
                        op,
                        "algorithm",
                        "oneshot",
                        "shared-memory rounds serve all_reduce, all_gather, reduce_scatter, all_to_all and broadcast only",
                    );
                }
                if wanted == Some(Wanted::TwoLevel) && op != "all_reduce" {
                    crate::contracts::backend::hint_ignored(
                        "cpu",
                        op,
                        "algorithm",
                        "two_level",
                        "only all_reduce runs in two levels",
                    );
                }
                self.by_size(bytes)
            }
        };
        tracing::trace!(op, bytes, ?algo, "cpu algorithm");
        Ok(algo)
    }

    fn by_size(&self, bytes: usize) -> Algo {
        if bytes <= self.direct_max {
            Algo::Direct
        } else {
            Algo::Ring
        }
    }

    /// Whether an all_reduce of `bytes` runs in two levels (two_level.rs): where the ranks span
    /// machines evenly (`layout`), by the hint `two_level`, else from `TWO_LEVEL_FROM` bytes
    /// unless another algorithm is hinted.
    fn two_level<'l>(
        &self,
        bytes: usize,
        opts: &RunOptions,
        layout: Option<&'l two_level::Layout>,
    ) -> Result<Option<&'l two_level::Layout>> {
        let wanted = Self::wanted("all_reduce", opts.hints, false)?;
        let Some(layout) = layout else {
            if wanted == Some(Wanted::TwoLevel) {
                crate::contracts::backend::hint_ignored(
                    "cpu",
                    "all_reduce",
                    "algorithm",
                    "two_level",
                    "the ranks do not span machines with as many ranks, at least two, on each",
                );
            }
            return Ok(None);
        };
        let yes = match wanted {
            Some(w) => w == Wanted::TwoLevel,
            None => bytes >= two_level::TWO_LEVEL_FROM,
        };
        Ok(yes.then_some(layout))
    }

    /// Does this all_reduce, all_gather, reduce_scatter, all_to_all or broadcast go through the
    /// board (oneshot.rs)?
    /// `available`: every rank shares this host and a contribution fits a slot (a broadcast's
    /// callers ask for one slot's piece of it); alike on every rank, so ranks that ignore the
    /// hint all do.
    fn use_board(&self, op: &'static str, bytes: usize, opts: &RunOptions, available: bool) -> Result<bool> {
        self.use_board_for(op, bytes, opts, available, 0..=self.direct_max)
    }

    /// As `use_board`, with `sizes` instead of up to `FERROCOMM_CPU_DIRECT_MAX` as the `bytes`
    /// that go through the board without a hint.
    fn use_board_for(
        &self,
        op: &'static str,
        bytes: usize,
        opts: &RunOptions,
        available: bool,
        sizes: RangeInclusive<usize>,
    ) -> Result<bool> {
        let board = match Self::wanted(op, opts.hints, true)? {
            Some(Wanted::OneShot) if available => true,
            Some(Wanted::OneShot) => {
                let why = format!(
                    "shared-memory rounds need every rank on this host and, but for broadcast, at \
                     most {} KiB per rank",
                    crate::net::links::shm_board::SLOT_BYTES >> 10
                );
                crate::contracts::backend::hint_ignored("cpu", op, "algorithm", "oneshot", &why);
                false
            }
            // Two levels serve all_reduce across machines only: elsewhere (one host) the
            // operation runs as without the hint.
            Some(Wanted::TwoLevel) | None => available && sizes.contains(&bytes),
            Some(_) => false,
        };
        if board {
            tracing::trace!(op, bytes, "cpu algorithm: oneshot");
        }
        Ok(board)
    }

    /// The `algorithm` hint of one operation. A value the backend does not know is an argument
    /// error (a typo must not pass for advice); keys of other backends are ignored, and noted
    /// on the `first_look` of an operation's hints.
    fn wanted(
        op: &'static str,
        hints: &std::collections::BTreeMap<String, String>,
        first_look: bool,
    ) -> Result<Option<Wanted>> {
        // Most calls have none: nothing to look up or note.
        if hints.is_empty() {
            return Ok(None);
        }
        if first_look {
            crate::contracts::backend::unknown_hints_ignored("cpu", op, hints, &["algorithm"]);
        }
        Ok(Some(match hints.get("algorithm").map(String::as_str) {
            None => return Ok(None),
            Some("oneshot") => Wanted::OneShot,
            Some("direct") => Wanted::Direct,
            Some("ring") => Wanted::Ring,
            Some("two_level") => Wanted::TwoLevel,
            Some(other) => {
                return Err(Error::invalid(
                    op,
                    format!(
                        "hint algorithm={other:?}: the cpu backend accepts \"oneshot\", \"direct\", \"ring\" or \"two_level\""
                    ),
                ))
            }
        }))
    }
}

/// Values of the `algorithm` hint (see `Tuning`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wanted {
    /// Shared-memory rounds, for the operations in `Tuning::BOARD_OPS`.
    OneShot,
    Direct,
    Ring,
    /// all_reduce in two levels, where the ranks span machines (two_level.rs).
    TwoLevel,
}

/// Tests of `Tuning`'s decisions, kept beside it.
#[cfg(test)]
mod tuning_tests;

/// Why a lent engine's operations are refused.
const LENT: &str = "shrunk: its links went to the smaller communicator";

struct State {
    engine: Engine,
    scratch: Scratch,
    /// MoE rows between the send and receive halves of a dispatch or combine.
    pending: inference::Pending,
    /// Set by a failure in the middle of a transfer: the streams may be out of step, so later
    /// operations refuse to run rather than read garbage.
    broken: bool,
    /// Set once `link_ledger` reported what the links carried: nothing more may travel on
    /// them, or the ledger the shrink decides by would be wrong.
    frozen: bool,
    /// The engine holds calls and the thread that sends a quiet rank's has it on its list
    /// (idle_senders.rs).
    watched: bool,
    /// The engine's count of operations when that thread last looked.
    ops_at_last_look: Option<u64>,
    /// The communicator's abort flag (`CpuBackend::abort`): an aborted rank sends nothing more.
    aborted: Arc<AtomicBool>,
}

impl idle_senders::QuietSender for Mutex<State> {
    fn send_if_quiet(&self) -> bool {
        let mut st = match self.try_lock() {
            Ok(st) => st,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            // Running: it sends its held calls itself when it waits, or with later ones.
            Err(std::sync::TryLockError::WouldBlock) => return true,
        };
        let ops = st.engine.ops_begun();
        let quiet = st.ops_at_last_look.replace(ops) == Some(ops);
        // A frozen engine's links carry nothing more (its hand-over sends them); a broken or
        // aborted one's peers learn of it otherwise.
        let stopped = st.broken || st.frozen || st.aborted.load(Ordering::Acquire);
        let holds = !stopped && st.engine.holds_calls();
        let still = holds && (!quiet || st.engine.send_held_calls());
        st.watched = still;
        if !still {
            st.ops_at_last_look = None;
        }
        still
    }
}

pub(crate) struct CpuBackend {
    /// Shared with the thread that sends a quiet rank's held calls (idle_senders.rs).
    state: Arc<Mutex<State>>,
    abort: Arc<AtomicBool>,
    /// Set once `lend_links` handed the links to a smaller communicator: this engine runs
    /// nothing more and announces nothing on links that are no longer its own.
    lent: AtomicBool,
    announce: links::Announcer,
    /// The first cause of a failure, shared by every rank (see net/links/fault.rs).
    faults: FaultRecord,
    /// The communicator's timeout: bounds the wait for peers' calls before closing.
    timeout: std::time::Duration,
    tuning: Tuning,
    /// Where the ranks span machines evenly: the layout of the two-level all_reduce.
    layout: Option<two_level::Layout>,
    /// What windows need to set themselves up.
    rank: usize,
    size: usize,
    store: Arc<dyn Store>,
    transport: TransportOptions,
}

/// One entry per rank, on the stack up to 8 ranks.
type PerRank<T> = SmallVec<[T; 8]>;

pub(crate) fn create(init: &BackendInit) -> Result<Box<dyn Backend>> {
    if init.device != crate::contracts::placement::Device::Cpu {
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
    let tuning = Tuning::from_config(&init.options.config);
    let t = match init.take_lent_links() {
        Some(lent) => match lent.0.downcast::<links::Transport>() {
            Ok(t) if t.size() == init.size => *t,
            _ => {
                return Err(Error::invalid(
                    "new_comm",
                    format!("the links lent by shrink are not those of {} ranks", init.size),
                ))
            }
        },
        None => links::connect_all(
            init.rank,
            init.size,
            &*init.store,
            &init.options.transport,
            init.options.timeout,
        )?,
    };
    let announce = t.announcer();
    let layout = two_level::Layout::of(t.machines(), init.rank);
    // Held calls need the thread that sends a quiet rank's.
    idle_senders::start().map_err(|e| Error::Unavailable {
        backend: "cpu".into(),
        reason: format!("the thread that sends the calls of quiet ranks did not start: {e}"),
    })?;
    let abort = Arc::new(AtomicBool::new(false));
    Ok(CpuBackend {
        state: Arc::new(Mutex::new(State {
            engine: Engine::new(init.rank, init.size, t),
            scratch: Scratch::default(),
            pending: Default::default(),
            broken: false,
            frozen: false,
            watched: false,
            ops_at_last_look: None,
            aborted: abort.clone(),
        })),
        abort,
        lent: AtomicBool::new(false),
        announce,
        faults: FaultRecord::new(init.store.clone(), init.rank),
        timeout: init.options.timeout,
        tuning,
        layout,
        rank: init.rank,
        size: init.size,
        store: init.store.clone(),
        transport: init.options.transport.clone(),
    })
}

/// The call of a collective whose per-rank lengths may differ (all_to_all_v, gather and scatter
/// of objects): each message's length is checked instead of one count.
fn any_count_call(root: usize) -> Call {
    Call {
        count: ANY_COUNT,
        root: root as u32,
        algo: Algo::Direct.code(),
        seq: 0,
    }
}

/// FNV-1a over block lengths: equal on ranks that agree on every block.
fn block_digest(lens: impl Iterator<Item = usize>) -> u32 {
    lens.flat_map(|l| (l as u64).to_le_bytes())
        .fold(0x811c_9dc5u32, |h, byte| {
            (h ^ u32::from(byte)).wrapping_mul(0x0100_0193)
        })
}

/// The message of one point-to-point call of a batch.
fn p2p_xfer<'b>(e: &mut Engine, p: &'b mut P2p<'_>) -> Xfer<'b> {
    match p {
        P2p::Send { buf, peer } => e.send(*peer, tag(10, buf.dtype(), None), buf.host_bytes()),
        P2p::Recv { buf, peer } => e.recv(*peer, tag(10, buf.dtype(), None), buf.host_bytes_mut()),
    }
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
        if let Some(ordinal) = op.device_ordinal() {
            return Err(Error::invalid(
                name,
                format!("the cpu backend works on host memory; this buffer is on CUDA device {ordinal}"),
            ));
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if self.lent.load(Ordering::SeqCst) || st.frozen {
            return Err(Error::Closed { op: name, state: LENT });
        }
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
        let ctx = OpCtx::new(name, opts.timeout, &self.abort);
        let State {
            engine,
            scratch,
            pending,
            broken,
            watched,
            ..
        } = &mut *st;
        let r = match op {
            Op::AllReduceRmsNorm(f) => {
                inference::all_reduce_rmsnorm(engine, scratch, &ctx, f, opts, self.tuning.direct_max)
            }
            Op::MoeDispatch(m) => inference::moe_dispatch(engine, &ctx, pending, m),
            Op::MoeCombine(m) => inference::moe_combine(engine, &ctx, pending, m),
            _ => self.dispatch(engine, scratch, &ctx, op, opts),
        };
        engine.end_call();
        if !*watched && engine.holds_calls() {
            *watched = true;
            idle_senders::watch(Arc::downgrade(&self.state) as Weak<dyn idle_senders::QuietSender>);
        }
        let Err(e) = r else { return Ok(()) };
        // Argument errors are found before any byte moves; everything else may leave a
        // message half sent.
        // A MoE receive half that overflowed a capacity (or was misused) has taken in
        // everything that was sent: the streams are in step.
        // A refused call (engine.rs, `refuse`) moved nothing else either.
        if matches!(e, Error::InvalidArgument { .. } | Error::CapacityExceeded { .. }) {
            return Err(e);
        }
        Err(self.failed(broken, name, e))
    }

    fn refuse(&self, op: &Op<'_>, reason: &str, opts: &RunOptions) {
        if !op.refused_in_band() {
            return;
        }
        let name = op.name();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.broken || st.frozen || self.abort.load(Ordering::Acquire) || self.lent.load(Ordering::SeqCst) {
            return;
        }
        let ctx = OpCtx::new(name, opts.timeout, &self.abort);
        let r = inference::refuse_op(&mut st.engine, &ctx, op, opts, self.tuning.direct_max, reason);
        st.engine.end_call();
        if let Err(e) = r {
            tracing::debug!(rank = self.rank, error = %e, "the peers could not be told of a refused {name}");
            self.failed(&mut st.broken, name, e);
        }
    }

    fn abort(&self) {
        // SeqCst with `lend_links`' store of `lent` and load of `abort`: of an abort and a hand
        // over that race, at least one sees the other, so an abort never announces on links
        // another communicator took over.
        self.abort.store(true, Ordering::SeqCst);
        if self.lent.load(Ordering::SeqCst) {
            return;
        }
        self.faults.record(Cause::Lost {
            root: self.rank,
            noticed_by: self.rank,
            reason: "aborted".into(),
        });
        self.announce.announce(OwnerState::Aborted);
    }

    fn finalize(&self) -> Result<()> {
        if self.lent.load(Ordering::SeqCst) {
            return Ok(());
        }
        let settled = self.settle_before_close();
        self.announce.announce(OwnerState::Closed);
        // A mismatch in a call this rank had left before its peers' calls came (a streamed
        // broadcast's root, gather's senders) is reported here, its last chance; a late or
        // lost peer at close is not this call's failure.
        match settled {
            Err(e @ Error::Mismatch { .. }) => Err(e),
            _ => Ok(()),
        }
    }

    /// Busy (an operation holds the engine, such as one stuck on a silent peer) is no ledger:
    /// the shrink must not wait for it.
    fn link_ledger(&self) -> Option<LinkLedger> {
        // The thread that sends quiet ranks' held calls takes the lock for a few microseconds
        // (idle_senders.rs): a millisecond of tries tells it from an operation.
        let tries_until = std::time::Instant::now() + std::time::Duration::from_millis(1);
        let mut st = loop {
            match self.state.try_lock() {
                Ok(st) => break st,
                Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < tries_until => {
                    std::thread::yield_now()
                }
                Err(std::sync::TryLockError::WouldBlock) => return None,
            }
        };
        if st.broken || self.abort.load(Ordering::SeqCst) || self.lent.load(Ordering::SeqCst) {
            return None;
        }
        let ledger = st.engine.ledger()?;
        st.frozen = true;
        Some(ledger)
    }

    fn lend_links(&self, members: &[usize], keep_board: bool, timeout: std::time::Duration) -> Result<LentLinks> {
        let op = "shrink";
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // From here on the links are no longer this engine's, whatever happens. Stored before
        // `abort` is looked at: see `abort`.
        if self.lent.swap(true, Ordering::SeqCst) {
            return Err(Error::Closed { op, state: LENT });
        }
        if st.broken || !st.frozen || self.abort.load(Ordering::SeqCst) {
            return Err(Error::Closed {
                op,
                state: "broken, aborted or used since its ledger: its links cannot be handed on",
            });
        }
        let ctx = OpCtx::new(op, timeout, &self.abort);
        let t = st.engine.hand_over(&ctx, members, keep_board)?;
        Ok(LentLinks(Box::new(t)))
    }

    fn new_window(&self, spec: &WindowSpec) -> Result<Box<dyn WindowBackend>> {
        let setup = window::Setup {
            rank: self.rank,
            size: self.size,
            store: &self.store,
            transport: &self.transport,
            abort: self.abort.clone(),
            faults: self.faults.clone(),
        };
        Ok(Box::new(window::CpuWindow::create(spec, &setup)?))
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        // Nobody to tell: what it finds is logged.
        let _ = self.settle_before_close();
    }
}

impl CpuBackend {
    /// After a failed transfer: the communicator is broken, and the peers are told.
    fn failed(&self, broken: &mut bool, name: &'static str, e: Error) -> Error {
        *broken = true;
        if self.abort.load(Ordering::Acquire) {
            // Our own abort shut our links: what the transfer saw is its echo, not a lost peer.
            return Error::Closed {
                op: name,
                state: "aborted",
            };
        }
        // Record the cause before peers learn we failed, so that every survivor reports the
        // rank at the root rather than this one, which failed next to it.
        let e = self.faults.resolve(e);
        self.announce.announce(match &e {
            Error::PeerLost { peer, .. } | Error::Timeout { peer: Some(peer), .. } => OwnerState::Lost(*peer),
            _ => OwnerState::Aborted,
        });
        e
    }

    /// Before this rank's links close: takes in the calls that peers still owe it (see
    /// `Engine::settle_deferred`). A late peer's call must not meet a closed TCP socket, which
    /// answers with a reset that loses what this rank sent it. Bounded by the timeout; skipped
    /// on an aborted or broken communicator. Returns what went wrong, for `finalize`.
    fn settle_before_close(&self) -> Result<()> {
        if self.abort.load(Ordering::Acquire) || self.lent.load(Ordering::SeqCst) {
            return Ok(());
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.broken {
            return Ok(());
        }
        let ctx = OpCtx::new("finalize", self.timeout, &self.abort);
        let settled = st.engine.settle_deferred(&ctx);
        if let Err(e) = &settled {
            tracing::debug!(rank = self.rank, error = %e, "closing: peers' calls did not all arrive, or differ from ours");
            st.broken = true;
        }
        settled
    }

    /// The communicator's fault record, for backends that use this engine as control plane.
    pub(crate) fn faults(&self) -> FaultRecord {
        self.faults.clone()
    }

    /// A barrier over the communicator, for backends that use this engine as control plane.
    pub(crate) fn run_barrier(&self, opts: &RunOptions) -> Result<()> {
        self.run(&mut Op::Barrier, opts)
    }

    fn dispatch(&self, e: &mut Engine, s: &mut Scratch, ctx: &OpCtx, op: &mut Op<'_>, opts: &RunOptions) -> Result<()> {
        if matches!(op, Op::Scatter { .. } | Op::Gather { .. } | Op::Barrier | Op::Batch(_)) {
            // These take no hint, but a malformed one is still refused and an unknown one noted.
            Tuning::wanted(ctx.op, opts.hints, true)?;
        }
        let algo = |bytes: usize| self.tuning.choose(ctx.op, bytes, opts);
        // The largest operation of each kind (`RoundOp`; broadcast: its root's buffer) that
        // runs as a shared-memory round without a hint.
        let round_max = |e: &Engine, op: RoundOp| oneshot::round_max(e, op, self.tuning.direct_max);
        // Whether an operation of `bytes` runs as a shared-memory round (`largest`: the bytes
        // one rank's slot must hold); if so, the calls peers still owe are taken in first and
        // the round is counted as a collective.
        let round = |e: &mut Engine, bytes: usize, largest: usize, op: RoundOp| -> Result<bool> {
            let sizes = oneshot::round_sizes(e, op, self.tuning.direct_max);
            if !self
                .tuning
                .use_board_for(ctx.op, bytes, opts, oneshot::fits(e, largest), sizes)?
            {
                return Ok(false);
            }
            e.settle_deferred(ctx)?;
            e.count_call();
            Ok(true)
        };
        // Opens the collective's call (header.rs) right before its algorithm runs.
        // `writes`: this rank writes a user buffer (else it checks peers' calls as they come).
        let call_of = |count: usize, root: usize, algo: u8| Call {
            count: count as u64,
            root: root as u32,
            algo,
            seq: 0,
        };
        let begin = |e: &mut Engine, t: Tag, count: usize, root: usize, algo: u8, symmetric: bool, writes: bool| {
            e.begin_call(t, call_of(count, root, algo), symmetric, writes);
        };
        let elems = |bytes: usize, d: DType| bytes / d.size();
        match op {
            Op::AllReduce { buf, op } => {
                let (d, o, bytes) = (buf.dtype(), *op, buf.host_bytes().len());
                let t = tag(1, d, Some(o));
                if round(e, bytes, bytes, RoundOp::AllReduce)? {
                    return oneshot::all_reduce(e, ctx, t, buf.host_bytes_mut(), d, o);
                }
                if let Some(layout) = self.tuning.two_level(bytes, opts, self.layout.as_ref())? {
                    begin(e, t, elems(bytes, d), 0, two_level::CODE, true, true);
                    return two_level::all_reduce(e, s, ctx, t, buf.host_bytes_mut(), d, o, layout);
                }
                let mut a = algo(bytes)?;
                // Past the rounds on one host, where every rank has a CPU, the ring beats
                // sending the whole buffer to every peer (2 processes, 16 KiB: 3.6 us against
                // 5.7, and the round's 4.4; docs/results/cpu.md).
                if a == Algo::Direct
                    && oneshot::fits(e, bytes)
                    && bytes > round_max(e, RoundOp::AllReduce)
                    && matches!(
                        Tuning::wanted(ctx.op, opts.hints, false)?,
                        None | Some(Wanted::TwoLevel)
                    )
                {
                    a = Algo::Ring;
                }
                begin(e, t, elems(bytes, d), 0, a.code(), true, true);
                algorithms::all_reduce(e, s, ctx, t, buf.host_bytes_mut(), d, o, a)
            }
            Op::Reduce { buf, op, root } => {
                let (d, o, bytes) = (buf.dtype(), *op, buf.host_bytes().len());
                let (t, a) = (tag(2, d, Some(o)), algo(bytes)?);
                let writes = e.rank == *root || a == Algo::Ring;
                begin(e, t, elems(bytes, d), *root, a.code(), true, writes);
                algorithms::reduce(e, s, ctx, t, buf.host_bytes_mut(), d, o, *root, a)
            }
            Op::Broadcast { buf, root } => {
                let (d, bytes) = (buf.dtype(), buf.host_bytes().len());
                let t = tag(3, d, None);
                // A round takes a broadcast of any size, a slot at a time.
                if round(e, bytes, bytes.min(links::shm_board::SLOT_BYTES), RoundOp::Broadcast)? {
                    return oneshot::broadcast(e, ctx, t, buf.host_bytes_mut(), *root);
                }
                let mut a = algo(bytes)?;
                // Between the 2 ranks of one host (a board: alike on both) the direct broadcast
                // sends by reference at these sizes, which beats the chain (algorithms.rs).
                // Where the link sends nothing by reference (`FERROCOMM_SHM_PULL_BYTES`, or a
                // slow copy out of another process) it streams one message, which measured
                // level with the chain up to 512 KiB (docs/results/cpu.md, part 24).
                if a == Algo::Ring
                    && e.size == 2
                    && oneshot::fits(e, 0)
                    && algorithms::BROADCAST_BY_REFERENCE.contains(&bytes)
                    && matches!(
                        Tuning::wanted(ctx.op, opts.hints, false)?,
                        None | Some(Wanted::TwoLevel)
                    )
                {
                    a = Algo::Direct;
                    tracing::trace!(op = ctx.op, bytes, "cpu algorithm: direct by reference between 2 ranks");
                }
                // Where ranks span hosts, a tree instead of the root sending to every rank itself
                // (broadcast_tree.rs); the hosts are alike on every rank.
                if a == Algo::Direct
                    && e.size >= broadcast_tree::MIN_RANKS
                    && e.transport.spans_hosts()
                    && Tuning::wanted(ctx.op, opts.hints, false)?.is_none()
                {
                    let call = call_of(elems(bytes, d), *root, broadcast_tree::CODE);
                    return broadcast_tree::broadcast(e, ctx, t, call, buf.host_bytes_mut(), *root);
                }
                // The chain's first exchange is not symmetric (rank k forwards to k + 1 a step after
                // k + 1 first receives from it): header-only call messages go first.
                let call = call_of(elems(bytes, d), *root, a.code());
                let lands = algorithms::broadcast_lands(e.rank, e.size, *root, a);
                let feeds = algorithms::broadcast_feeds(e.rank, e.size, *root, a);
                e.begin_broadcast_call(t, call, a == Algo::Direct, lands, feeds);
                algorithms::broadcast(e, ctx, t, buf.host_bytes_mut(), *root, a, self.tuning.chunk)
            }
            Op::AllGather { input, outputs } => {
                let (d, t) = (input.dtype(), tag(4, input.dtype(), None));
                let mut outs: PerRank<&mut [u8]> = outputs.iter_mut().map(|o| o.host_bytes_mut()).collect();
                // Decided on what every rank knows alike (all_gather_v: counts differ by rank).
                let total = outs.iter().map(|o| o.len()).sum();
                let largest = outs.iter().map(|o| o.len()).max().unwrap_or(0);
                if round(e, total, largest, RoundOp::Exchange)? {
                    return oneshot::all_gather(e, ctx, t, input.host_bytes(), &mut outs);
                }
                let a = algo(total)?;
                // Blocks that differ between ranks (all_gather_v) must show in the call, before
                // a ring step lands one: see reduce_scatter below.
                let digest = block_digest(outs.iter().map(|o| o.len()));
                begin(e, t, elems(total, d), digest as usize, a.code(), true, true);
                algorithms::all_gather(e, ctx, t, input.host_bytes(), &mut outs, a)
            }
            Op::ReduceScatter { inputs, output, op } => {
                let (d, o) = (output.dtype(), *op);
                let ins: PerRank<&[u8]> = inputs.iter().map(|i| i.host_bytes()).collect();
                let total = ins.iter().map(|i| i.len()).sum();
                let t = tag(5, d, Some(o));
                if round(e, total, total, RoundOp::Exchange)? {
                    return oneshot::reduce_scatter(e, s, ctx, t, &ins, output.host_bytes_mut(), d, o);
                }
                let a = algo(total)?;
                // The ring reduces its last step straight into `output`, piece by piece, and
                // each piece is checked as a message of its own; an earlier ring step of
                // all_gather lands whole blocks. So blocks that differ between ranks
                // (reduce_scatter_v, all_gather_v) must show in the call itself, before any
                // byte lands: a digest of the block lengths rides in the root field, which
                // neither operation has a use for.
                let digest = block_digest(ins.iter().map(|i| i.len()));
                begin(e, t, elems(total, d), digest as usize, a.code(), true, true);
                algorithms::reduce_scatter(e, s, ctx, t, &ins, output.host_bytes_mut(), d, o, a)
            }
            Op::AllToAll { inputs, outputs } => {
                let t = tag(6, inputs[0].dtype(), None);
                let ins: PerRank<&[u8]> = inputs.iter().map(|i| i.host_bytes()).collect();
                let mut outs: PerRank<&mut [u8]> = outputs.iter_mut().map(|o| o.host_bytes_mut()).collect();
                // Whether the blocks fit is settled inside the round (all_to_all_v: sizes differ
                // by rank), so here only the board and the hint count; the hint lifts the limit
                // of a round without one.
                if self.tuning.use_board(ctx.op, 0, opts, oneshot::fits(e, 0))? {
                    let limit = match Tuning::wanted(ctx.op, opts.hints, false)? {
                        Some(Wanted::OneShot) => usize::MAX,
                        _ => round_max(e, RoundOp::Exchange),
                    };
                    e.settle_deferred(ctx)?;
                    e.count_call();
                    if oneshot::all_to_all(e, ctx, t, &ins, &mut outs, limit)? {
                        return Ok(());
                    }
                }
                // all_to_all_v: ranks' counts differ; each message's length is checked instead.
                e.begin_call(t, any_count_call(0), true, true);
                algorithms::all_to_all(e, ctx, t, &ins, &mut outs)
            }
            Op::Scatter { inputs, output, root } => {
                let ins: Option<Vec<&[u8]>> = inputs.as_ref().map(|v| v.iter().map(|i| i.host_bytes()).collect());
                // Per-rank lengths may differ (objects scatter their encodings): each message's
                // length is checked instead of a count.
                let t = tag(7, output.dtype(), None);
                e.begin_call(t, any_count_call(*root), true, true);
                algorithms::scatter(e, ctx, t, ins.as_deref(), output.host_bytes_mut(), *root)
            }
            Op::Gather { input, outputs, root } => {
                let mut outs: Option<Vec<&mut [u8]>> = outputs
                    .as_mut()
                    .map(|v| v.iter_mut().map(|o| o.host_bytes_mut()).collect());
                let t = tag(8, input.dtype(), None);
                e.begin_call(t, any_count_call(*root), true, e.rank == *root);
                algorithms::gather(e, ctx, t, input.host_bytes(), outs.as_deref_mut(), *root)
            }
            Op::Barrier if oneshot::fits(e, 0) => {
                e.settle_deferred(ctx)?;
                e.count_call();
                oneshot::barrier(e, ctx, tag(9, DType::U8, None))
            }
            Op::Barrier => {
                let t = tag(9, DType::U8, None);
                begin(e, t, 0, 0, Algo::Direct.code(), true, true);
                algorithms::barrier(e, ctx, t)
            }
            Op::AllReduceRmsNorm(_) | Op::MoeDispatch(_) | Op::MoeCombine(_) => {
                Err(Error::invalid(ctx.op, "run by the inference module, not the dispatch"))
            }
            // The messages are made where they stay: a batch of one or two (a send, a recv, a
            // send_recv) in an array on the stack, larger ones on the heap. (A list with inline
            // room for four is moved whole when made: 656 bytes copied per call.)
            Op::Batch(list) => match &mut list[..] {
                [a] => {
                    let mut x = [p2p_xfer(e, a)];
                    e.exchange(ctx, &mut x)
                }
                [a, b] => {
                    let mut x = [p2p_xfer(e, a), p2p_xfer(e, b)];
                    e.exchange(ctx, &mut x)
                }
                list => {
                    let mut x: Xfers = list.iter_mut().map(|p| p2p_xfer(e, p)).collect();
                    e.exchange(ctx, &mut x)
                }
            },
        }
    }
}
