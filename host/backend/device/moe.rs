//! The device backend's own MoE dispatch and combine (kernels/moe.cu), on device buffers and
//! on the host device: peers on this host by loads and stores into their mapped segments, peers
//! on other hosts through the window's proxy queue (a send builds their slot in an outbox of
//! its own segment, puts it and signals). The protocol is described at the top of
//! kernels/moe.cu.
//!
//! Whether the kernels run an operation depends only on its shape, the world size and whether
//! some rank is on another host (the team agreed on that when the communicator was made), which
//! every rank shares, so the send and receive halves of one dispatch or combine always take the
//! same path (the kernels' staging or the CPU engine's pending rows): see [`OwnMoe::supports`].
//! Elsewhere (more ranks or a larger `topk` than the kernels take, a shape whose staging would
//! not fit [`WINDOW_MAX`], outboxes included) the backend keeps its other path.
//!
//! The window is made at the first call that needs it (collectively: every rank makes the same
//! call with the same shape), sized for that shape; a later call with a larger shape makes a
//! larger one. So the first call of a shape must not be captured into a CUDA graph; later ones
//! may be (the kernels advance their own epochs). With ranks on other hosts, a window is
//! replaced only once every rank's proxy queue has delivered the last call's signals (then a
//! barrier): see `Live::retire`.
//!
//! A source's staging holds local experts x capacity rows, so a dispatch never needs more: a
//! source that sends more tokens to one rank has necessarily overflowed one of its experts
//! (`Error::CapacityExceeded`, with exact counts; in that case the rows of that rank's other
//! experts are unspecified too).
//!
//! Errors of the data (capacity exceeded, a bad expert id, a bad `src`, a missing row) are
//! recorded by the kernels in a record of this module and reported as the CPU engine reports
//! them: on the host device by the call itself, on a GPU by the next MoE call on the
//! communicator (the kernels run asynchronously), which still runs: such an error may be one
//! rank's alone, and a rank that skipped the call would leave its peers waiting. The kernels
//! finish their protocol even then, so the next call runs normally. A receive half whose own
//! send half failed reads nothing and fails too.
//!
//! The ranks agree as on the CPU engine: a send half that finds a bad expert id (dispatch) or a
//! bad count or source (combine) refuses the call in band (its slot headers say why and carry
//! no rows), and a rank whose host refused the call (`OwnMoe::refuse`) sends such headers too;
//! every slot header carries the sender's shape. So every rank's receive half fails with
//! `Error::InvalidArgument` naming the refusing rank, or `Error::Mismatch` naming a rank of
//! another shape, writes nothing, and the next call runs in step. Unlike on the CPU engine,
//! whose send half exchanges the rows, a send half called alone succeeds on the peers: their
//! receive half reports it. A shape that needs a larger window is first announced on the old
//! one (`OwnMoe::announce_growth`: header-only halves carrying the shape), so ranks that call
//! with different shapes there get `Error::Mismatch` too, at once, instead of one side making
//! a window the other never makes.

use super::call_order::CallOrder;
use super::rank::DeviceRank;
use super::window::DeviceWindow;
use crate::contracts::backend::RunOptions;
use crate::contracts::dtype::DType;
use crate::contracts::error::{Error, Result};
use crate::contracts::inference::{MoeCombine, MoeDispatch, MoeShape, FP8_BLOCK};
use crate::contracts::ops::{Buf, BufMut, Op};
use crate::contracts::window::WindowSpec;
use crate::contracts::window_handle::{DeviceStatus, STATUS_MISMATCH, STATUS_OK};
use crate::gpu::cuda;
use crate::gpu::kernels::{self, Function, MoeArgs, Queue};
use crate::gpu::memory::Pinned;
use crate::gpu::target::{Gpu, Stream};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

/// kernels/moe.cu's MOE_BLOCKS, MOE_MAX_RANKS, MOE_MAX_TOPK, signal ids, counters and error ops.
const MOE_BLOCKS: u32 = 8;
const MAX_RANKS: usize = 16;
const MAX_TOPK: usize = 32;
const SIGNAL_IDS: usize = 2 + 2 * MOE_BLOCKS as usize;
const COUNTERS: usize = 2 * MAX_RANKS + 2 * MOE_BLOCKS as usize + 1;
/// kernels/moe.cu's C_MISSING: the first lost row of a combine, complemented (0: none).
const C_MISSING: usize = COUNTERS - 1;
const OP_CAPACITY: u32 = 0x4d01;
const OP_EXPERT: u32 = 0x4d02;
const OP_SRC: u32 = 0x4d03;
const OP_MISSING: u32 = 0x4d04;
const OP_STEP: u32 = 0x4d05;
const OP_STRAY: u32 = 0x4d06;
const OP_OUTBOX: u32 = 0x4d07;
const OP_REFUSED_EXPERT: u32 = 0x4d08;
const OP_REFUSED_SRC: u32 = 0x4d09;
const OP_REFUSED_HOST: u32 = 0x4d0a;
const OP_SHAPE: u32 = 0x4d0b;
const OP_GROW: u32 = 0x4d0c;
/// kernels/moe.cu's `Header` without its per-expert counts: the sender's epoch, shape and refusal.
const HEADER_FIXED: usize = 64;

/// The most bytes of one rank's MoE window; larger shapes keep the backend's other path.
pub(crate) const WINDOW_MAX: usize = 1 << 30;

/// The window ids of MoE windows count down from here (only their store namespace uses them).
const WINDOW_ID: u64 = u64::MAX - (1 << 32);

/// Where each op's staging lies in a segment: both sized for the largest record of the shape
/// (4-byte elements), so the layout depends only on the shape, the world and whether some rank
/// is on another host (which every rank knows alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    /// Records per source slot: local experts x capacity.
    rows: usize,
    header: usize,
    dispatch_slot: usize,
    combine_slot: usize,
    bytes: usize,
}

/// A segment's bytes for slots of these sizes: the dispatch region, the combine region, and
/// with `outboxes` one outbox per destination, as large as the larger slot (dispatch and
/// combine share them: a rank's MoE kernels run one after another, and a put toward the proxy
/// returns only once its source was copied out).
fn segment_bytes(world: usize, dispatch_slot: usize, combine_slot: usize, outboxes: bool) -> Option<usize> {
    let regions = dispatch_slot.checked_add(combine_slot)?;
    let outbox = if outboxes { dispatch_slot.max(combine_slot) } else { 0 };
    world.checked_mul(regions.checked_add(outbox)?)
}

fn align16(n: usize) -> Option<usize> {
    n.checked_next_multiple_of(16)
}

impl Layout {
    fn of(s: &MoeShape, world: usize, outboxes: bool) -> Option<Layout> {
        let local = s.local_experts(world);
        let rows = local.checked_mul(s.capacity)?;
        let header = align16(HEADER_FIXED + 4 * local)?;
        let data = align16(s.hidden.checked_mul(4)?)?;
        let dispatch_record = align16(4 + 4 * s.topk)?.checked_add(data)?;
        let combine_record = 16 + data;
        let dispatch_slot = rows.checked_mul(dispatch_record)?.checked_add(header)?;
        let combine_slot = rows.checked_mul(combine_record)?.checked_add(header)?;
        let bytes = segment_bytes(world, dispatch_slot, combine_slot, outboxes)?;
        Some(Layout {
            rows,
            header,
            dispatch_slot,
            combine_slot,
            bytes,
        })
    }
}

/// The kernels' own path for MoE dispatch and combine of one rank.
pub(crate) struct OwnMoe {
    dispatch_send: Function,
    dispatch_recv: Function,
    combine_send: Function,
    combine_recv: Function,
    host_device: bool,
    rank: usize,
    size: usize,
    /// Some rank is on another host: sends toward it build their slots in outboxes.
    outboxes: bool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    live: Option<Live>,
    /// Windows made so far (each gets an id of its own).
    made: u64,
    /// The shape and dtype of a send half whose receive half has not run.
    dispatch: Option<(MoeShape, DType)>,
    combine: Option<(MoeShape, DType)>,
    /// That send half's call returned an error (its kernels refused the call in band).
    dispatch_failed: bool,
    combine_failed: bool,
}

/// A window with its counters and error record.
struct Live {
    window: DeviceWindow,
    counters: Pinned<u64>,
    errors: Pinned<DeviceStatus>,
    /// Bytes per source slot of each op: dispatch's region is at 0, combine's after it, the
    /// outboxes (if any) after both.
    dispatch_slot: usize,
    combine_slot: usize,
    order: Option<CallOrder>,
    timeout: Duration,
}

impl Live {
    /// Whether this window's slots hold a shape of layout `need`.
    fn holds(&self, need: Layout) -> bool {
        self.dispatch_slot >= need.dispatch_slot && self.combine_slot >= need.combine_slot
    }

    /// Ends this window for a larger one: collective, every rank calls in the same MoE call.
    /// Toward other hosts the last call's DONE signals may still be queued when its kernels
    /// end: every rank's proxy completes them, and only then (a barrier) does any rank stop the
    /// window's servers, which would otherwise refuse them and break the peers' proxy links.
    fn retire(self, b: &DeviceRank, net: bool) -> Result<()> {
        if !net {
            return Ok(());
        }
        let limit = self.timeout + Duration::from_secs(1);
        // Failures of the old window's last signals concern a window nobody will wait on
        // again: they are logged, and every rank still reaches the barrier.
        let ended = match &self.order {
            Some(order) => self.window.enter_gpu().and_then(|()| order.wait_last(limit)),
            None => Ok(()),
        };
        if let Err(e) = ended.and_then(|()| self.window.drain_proxy(limit)) {
            tracing::warn!("MoE window replaced before its queued signals completed: {e}");
        }
        let hints = BTreeMap::new();
        b.host.run_barrier(&RunOptions::new(self.timeout, &hints))
    }
}

impl Drop for Live {
    /// Kernels of the last calls may still run on the users' streams: the window must not be
    /// unmapped under them (bounded by their own deadlines).
    fn drop(&mut self) {
        if let Some(order) = &self.order {
            let _ = self.window.enter_gpu();
            if let Err(e) = order.wait_last(self.timeout + Duration::from_secs(1)) {
                tracing::warn!("MoE kernels still running when their window is released: {e}");
            }
        }
    }
}

/// The kernels' code of a combine's element type.
fn act_code(d: DType) -> Option<u64> {
    match d {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}

impl OwnMoe {
    /// On every device communicator: peers on this host are reached by loads and stores,
    /// peers on other hosts through the window's proxy queue.
    pub(crate) fn create(b: &DeviceRank) -> Result<OwnMoe> {
        let f = |name: &str| b.gpu.function(name);
        Ok(OwnMoe {
            dispatch_send: f(kernels::MOE_DISPATCH_SEND.name)?,
            dispatch_recv: f(kernels::MOE_DISPATCH_RECV.name)?,
            combine_send: f(kernels::MOE_COMBINE_SEND.name)?,
            combine_recv: f(kernels::MOE_COMBINE_RECV.name)?,
            host_device: b.gpu == Gpu::Host,
            rank: b.rank,
            size: b.size,
            outboxes: b.one_host.is_err(),
            state: Mutex::new(State::default()),
        })
    }

    /// Whether the kernels run `op`: a MoE dispatch or combine of a shape they take. Depends
    /// only on the shape and the world size, never on the buffers or the halves given, so both
    /// halves of one operation go the same way on every rank.
    pub(crate) fn supports(&self, op: &Op<'_>) -> bool {
        let shape = match op {
            Op::MoeDispatch(m) => m.shape,
            Op::MoeCombine(m) => m.shape,
            _ => return false,
        };
        Self::takes(&shape, self.size, self.outboxes)
    }

    fn takes(s: &MoeShape, world: usize, outboxes: bool) -> bool {
        // The slot headers carry the shape in u32s.
        world <= MAX_RANKS
            && s.topk <= MAX_TOPK
            && s.capacity <= i32::MAX as usize
            && s.experts <= u32::MAX as usize
            && s.hidden <= u32::MAX as usize
            && Layout::of(s, world, outboxes).is_some_and(|l| l.bytes <= WINDOW_MAX)
    }

    /// Runs `op` (`supports(op)` holds) on `stream`: to completion on the host device,
    /// enqueued on a GPU.
    pub(crate) fn run(&self, b: &DeviceRank, op: &mut Op<'_>, stream: u64, timeout: Duration) -> Result<()> {
        let name = op.name();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // Failures of an earlier call's kernels (on a GPU, they end after their call returned).
        // A data error is reported by this call, which still runs: the error may be this rank's
        // alone (a capacity, a stray row), and a rank that skipped the call would leave its
        // peers waiting for it. A failed wait or a broken proxy link ends the call here.
        let mut earlier = Ok(());
        if let Some(live) = &st.live {
            live.window.take_status(name, timeout)?;
            live.window.take_proxy_error()?;
            earlier = self.take_errors(live, name);
        }
        let hd = self.host_device;
        let planned = match op {
            Op::MoeDispatch(m) => self.plan_dispatch(&mut st, m, hd).map(|p| (m.shape, p)),
            Op::MoeCombine(m) => self.plan_combine(&mut st, m, hd).map(|p| (m.shape, p)),
            _ => return Err(Error::invalid(name, "not a MoE operation")),
        };
        let (shape, plan) = match planned {
            Ok(planned) => planned,
            // The peers' kernels wait for this rank's send half: it refuses in band.
            Err(why) => {
                if op.refused_in_band() {
                    if let Err(e) = self.run_refusal(b, &mut st, op, stream, timeout) {
                        tracing::debug!(error = %e, "the peers could not be told of this rank's refused {name}");
                    }
                }
                return with_earlier(earlier, Err(why));
            }
        };
        let layout = Layout::of(&shape, self.size, self.outboxes)
            .filter(|l| l.bytes <= WINDOW_MAX)
            .ok_or_else(|| Error::invalid(name, "the shape's staging does not fit the MoE window"));
        let made = layout.and_then(|layout| {
            if st.live.as_ref().is_some_and(|l| !l.holds(layout)) {
                let first = plan
                    .launches
                    .first()
                    .ok_or_else(|| Error::invalid(name, "a MoE call without halves"))?;
                let dispatch = matches!(first.step, Step::DispatchSend | Step::DispatchRecv);
                let announce = Plan::header_only(&shape, self.size, first.args.elem, dispatch, OP_GROW);
                self.announce_growth(&st, name, layout, &announce, stream, timeout, &mut earlier)?;
            }
            self.ensure_window(b, &mut st, layout, timeout).map(|()| layout)
        });
        let layout = match made {
            Ok(layout) => layout,
            Err(e) => return with_earlier(earlier, Err(e)),
        };
        let mut result = self.launch(&st, name, layout, &plan, stream, timeout, true);
        // The halves ran (their protocol completes even when the data was wrong): a send half
        // alone leaves its rows waiting for the receive half.
        let st = &mut *st;
        let (pending, failed) = match op {
            Op::MoeDispatch(_) => (&mut st.dispatch, &mut st.dispatch_failed),
            _ => (&mut st.combine, &mut st.combine_failed),
        };
        if plan.received {
            // A receive half whose own send half failed reads nothing of its own slots (they
            // say refused): it must not pass for one that received.
            if pending.is_some() && *failed && result.is_ok() {
                result = Err(Error::invalid(
                    name,
                    "this rank's send half of the call failed (that call returned the error): nothing was received",
                ));
            }
            *pending = None;
            *failed = false;
        } else {
            *pending = plan.sent;
            *failed = result.is_err();
        }
        with_earlier(earlier, result)
    }

    /// Takes part in `op`, which this rank refuses (an argument error found on the host), far
    /// enough for its peers to fail at once with an error naming it (`Backend::refuse`), as the
    /// CPU engine's peers do: a send that publishes only a header flagged refused to every
    /// destination, and a receive that reads nothing and releases every source's slot, so the
    /// next call runs in step. Whatever halves `op` had: the peers' send halves of this call
    /// fill this rank's slots either way. Nothing is recorded on this rank (its caller has its
    /// own error). Not where a send half of this op still waits for its receive half (the
    /// slots are taken) or the kernels would not run `op`.
    pub(crate) fn refuse(&self, b: &DeviceRank, op: &Op<'_>, stream: u64, timeout: Duration) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.run_refusal(b, &mut st, op, stream, timeout)
    }

    /// Before a window is replaced by a larger one (collectively: the peers must make it too),
    /// the ranks check on the old window that they all call with this shape: `announce`, a
    /// call of header-only send and receive halves whose headers announce it (`OP_GROW`, with
    /// the shape). Peers that run a call of another shape instead find the announcement's shape
    /// differs, and this rank theirs: every rank gets `Error::Mismatch` naming a rank of the
    /// other shape, at once, and the windows stay as they were (in step). Waits for the
    /// kernels (a larger window is never made inside a CUDA graph capture). On a GPU the last
    /// call's kernels may still run: they end first, and a data error they record joins
    /// `earlier` (reported by this call, which goes on), not the announcement's verdict.
    #[allow(clippy::too_many_arguments)]
    fn announce_growth(
        &self,
        st: &State,
        name: &'static str,
        layout: Layout,
        announce: &Plan,
        stream: u64,
        timeout: Duration,
        earlier: &mut Result<()>,
    ) -> Result<()> {
        let live = st.live.as_ref().ok_or_else(|| Error::invalid(name, "no MoE window"))?;
        if let Some(order) = &live.order {
            live.window.enter_gpu()?;
            order.wait_last(timeout + Duration::from_secs(1))?;
            live.window.take_status(name, timeout)?;
            live.window.take_proxy_error()?;
            let late = self.take_errors(live, name);
            *earlier = with_earlier(late, std::mem::replace(earlier, Ok(())));
        }
        if st.dispatch.is_some() || st.combine.is_some() {
            return Err(Error::invalid(
                name,
                "a larger MoE shape while a send half waits for its receive half",
            ));
        }
        self.launch(st, name, layout, announce, stream, timeout, true)?;
        // On a GPU the kernels were enqueued: their verdict is known once they end.
        if let Some(order) = &live.order {
            live.window.enter_gpu()?;
            order.wait_last(timeout + Duration::from_secs(1))?;
            live.window.take_status(name, timeout)?;
            live.window.take_proxy_error()?;
            self.take_errors(live, name)?;
        }
        Ok(())
    }

    fn run_refusal(&self, b: &DeviceRank, st: &mut State, op: &Op<'_>, stream: u64, timeout: Duration) -> Result<()> {
        let name = op.name();
        let (shape, elem, dispatch) = match op {
            Op::MoeDispatch(m) => (m.shape, m.send.as_ref().map(|s| s.tokens.dtype()), true),
            Op::MoeCombine(m) => (m.shape, m.send.as_ref().map(|s| s.expert_out.dtype()), false),
            _ => return Ok(()),
        };
        let waiting = if dispatch { &st.dispatch } else { &st.combine };
        if elem.is_none() || waiting.is_some() || !self.supports(op) {
            return Ok(());
        }
        let layout = Layout::of(&shape, self.size, self.outboxes)
            .filter(|l| l.bytes <= WINDOW_MAX)
            .ok_or_else(|| Error::invalid(name, "the shape's staging does not fit the MoE window"))?;
        // Only headers move: any window there is holds them (the first call makes one, with
        // the peers, collectively).
        if st.live.is_none() {
            self.ensure_window(b, st, layout, timeout)?;
        }
        let plan = Plan::header_only(
            &shape,
            self.size,
            elem.map_or(0, |d| d as u64),
            dispatch,
            OP_REFUSED_HOST,
        );
        self.launch(st, name, layout, &plan, stream, timeout, false)
    }

    /// Launches `plan`'s kernels on the window: to completion on the host device (then its
    /// data errors are this call's, with `errors`), enqueued on `stream` on a GPU. Without
    /// `errors` the kernels record nothing (a refusal's).
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        st: &State,
        name: &'static str,
        layout: Layout,
        plan: &Plan,
        stream: u64,
        timeout: Duration,
        errors: bool,
    ) -> Result<()> {
        let live = st.live.as_ref().ok_or_else(|| Error::invalid(name, "no MoE window"))?;
        let counters = live.counters.device_addr();
        let launches: Vec<(&Function, &kernels::Kernel<_>, u32, MoeArgs)> = plan
            .launches
            .iter()
            .map(|l| {
                let mut a = l.args;
                let (region, slot) = match l.step {
                    Step::DispatchSend | Step::DispatchRecv => (0, live.dispatch_slot),
                    Step::CombineSend | Step::CombineRecv => (self.size * live.dispatch_slot, live.combine_slot),
                };
                a.region = region as u64;
                a.slot = slot as u64;
                a.header = layout.header as u64;
                a.rows = layout.rows as u64;
                a.errors = if errors { live.errors.device_addr() } else { 0 };
                a.outbox = if self.outboxes {
                    (self.size * (live.dispatch_slot + live.combine_slot)) as u64
                } else {
                    0
                };
                let (f, k, blocks) = match l.step {
                    Step::DispatchSend => (&self.dispatch_send, &kernels::MOE_DISPATCH_SEND, self.size as u32),
                    Step::DispatchRecv => (&self.dispatch_recv, &kernels::MOE_DISPATCH_RECV, MOE_BLOCKS),
                    Step::CombineSend => (&self.combine_send, &kernels::MOE_COMBINE_SEND, self.size as u32),
                    Step::CombineRecv => (&self.combine_recv, &kernels::MOE_COMBINE_RECV, MOE_BLOCKS),
                };
                (f, k, blocks, a)
            })
            .collect();
        let (mut handle, window_stream) = live.window.handle_and_stream();
        match window_stream {
            // Host buffers belong to the call: it returns once every launch has ended.
            Stream::Host(_) => {
                handle.timeout_ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
                let enqueued = launches.iter().try_for_each(|(f, k, blocks, a)| {
                    k.launch(f, window_stream.queue(), *blocks, (handle, *a, counters))
                });
                let n = launches.len() as u32;
                let ended = enqueued.and_then(|()| live.window.finish(name, (timeout + Duration::from_secs(1)) * n));
                if errors {
                    ended.and_then(|()| self.take_errors(live, name))
                } else {
                    ended
                }
            }
            Stream::Cuda(_) => {
                let order = live
                    .order
                    .as_ref()
                    .ok_or_else(|| Error::invalid(name, "no call order"))?;
                order.run(stream, || {
                    let q = Queue::Cuda(cuda::stream::raw(stream));
                    launches
                        .iter()
                        .try_for_each(|(f, k, blocks, a)| k.launch(f, q, *blocks, (handle, *a, counters)))
                })
            }
        }
    }

    /// Reports a failure the kernels of the last call recorded (on a GPU they end after their
    /// call returned): `finalize` asks.
    pub(crate) fn check(&self, op: &'static str, timeout: Duration) -> Result<()> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match &st.live {
            Some(live) => {
                live.window.take_status(op, timeout)?;
                live.window.take_proxy_error()?;
                self.take_errors(live, op)
            }
            None => Ok(()),
        }
    }

    /// Makes (or grows) the window so that its slots hold `need`'s: collective, every rank
    /// calls with the same shape. A window stays while its slots are large enough: each op's
    /// region keeps its place across shapes, so a send half of one shape waiting for its
    /// receive half is never overwritten by the other op of another shape.
    fn ensure_window(&self, b: &DeviceRank, st: &mut State, need: Layout, timeout: Duration) -> Result<()> {
        let (mut dispatch_slot, mut combine_slot) = (need.dispatch_slot, need.combine_slot);
        if let Some(l) = &st.live {
            if l.holds(need) {
                return Ok(());
            }
            // Grown to hold every shape seen so far, where that fits.
            let both = (dispatch_slot.max(l.dispatch_slot), combine_slot.max(l.combine_slot));
            if segment_bytes(self.size, both.0, both.1, self.outboxes).is_some_and(|n| n <= WINDOW_MAX) {
                (dispatch_slot, combine_slot) = both;
            }
        }
        if st.dispatch.is_some() || st.combine.is_some() {
            return Err(Error::invalid(
                "moe",
                "a larger MoE shape while a send half waits for its receive half",
            ));
        }
        if let Some(old) = st.live.take() {
            old.retire(b, self.outboxes)?;
        }
        let bytes = segment_bytes(self.size, dispatch_slot, combine_slot, self.outboxes)
            .ok_or_else(|| Error::invalid("moe", "the MoE window's size overflows"))?;
        let spec = WindowSpec {
            id: WINDOW_ID - st.made,
            bytes,
            signals: SIGNAL_IDS,
            registered: None,
            timeout,
        };
        st.made += 1;
        let window = DeviceWindow::create(b, &spec)?;
        st.live = Some(Live {
            counters: b.gpu.records(COUNTERS)?,
            errors: b.gpu.records(1)?,
            window,
            dispatch_slot,
            combine_slot,
            order: (b.gpu != Gpu::Host).then(CallOrder::new).transpose()?,
            timeout,
        });
        Ok(())
    }

    /// Reports (and clears) the first data error the kernels recorded, as the CPU engine words it.
    fn take_errors(&self, live: &Live, op: &'static str) -> Result<()> {
        let s = live.errors.read(0);
        if s.code == STATUS_OK {
            return Ok(());
        }
        live.errors.write(0, DeviceStatus::default());
        let missing = !live.counters.read(C_MISSING);
        live.counters.write(C_MISSING, 0);
        // Which call's shape the record belongs to is not kept: say what the record says.
        let peer = usize::try_from(s.peer).unwrap_or(usize::MAX);
        let expert = |i: u64, x: u64, experts: u32| {
            format!("topk_idx[{i}] = {} is not an expert (0..{experts}) or -1", x as i64)
        };
        let refused = |call: &str, why: String| {
            Error::invalid(
                op,
                format!("rank {peer} refused its call of {call} ({why}); nothing moved"),
            )
        };
        Err(match (s.code, s.op) {
            (STATUS_MISMATCH, OP_SHAPE) => {
                let (field, ours, theirs) = match s.signal_id {
                    0 => ("experts", s.expected.to_string(), s.observed.to_string()),
                    1 => ("topk", s.expected.to_string(), s.observed.to_string()),
                    2 => ("hidden", s.expected.to_string(), s.observed.to_string()),
                    3 => ("capacity", s.expected.to_string(), s.observed.to_string()),
                    // kernels/moe.cu FIELD_WINDOW: one side announced a larger window.
                    5 => {
                        let says = |grows: u64| {
                            if grows != 0 {
                                "a larger window"
                            } else {
                                "the window there is"
                            }
                        };
                        ("window", says(s.expected).to_string(), says(s.observed).to_string())
                    }
                    _ => {
                        let name = |c: u64| {
                            u8::try_from(c)
                                .ok()
                                .and_then(DType::from_code)
                                .map_or("-", |d| d.name())
                        };
                        ("dtype", name(s.expected).to_string(), name(s.observed).to_string())
                    }
                };
                Error::Mismatch {
                    op,
                    peer,
                    detail: format!("MoE shape, {field}: this rank has {ours}, rank {peer} has {theirs}"),
                }
            }
            (_, OP_REFUSED_EXPERT) => refused("moe_dispatch", expert(s.expected, s.observed, s.signal_id)),
            (_, OP_REFUSED_SRC) if s.expected == u64::MAX => refused(
                "moe_combine",
                format!("counts[{}] = {} is negative", s.signal_id, s.observed as u32 as i32),
            ),
            (_, OP_REFUSED_SRC) => refused(
                "moe_combine",
                format!(
                    "src[{}, {}] = (rank {}, k {}) is not a dispatched row's source",
                    s.signal_id,
                    s.expected,
                    (s.observed >> 32) as u32 as i32,
                    s.observed as u32 as i32
                ),
            ),
            (_, OP_REFUSED_HOST) => refused(op, "an argument failed that rank's checks; it has the error".into()),
            (STATUS_MISMATCH, _) | (_, OP_STEP) => Error::Mismatch {
                op,
                peer: usize::try_from(s.peer).unwrap_or(usize::MAX),
                detail: format!(
                    "its MoE staging holds epoch {} where this rank expected {}: the ranks' calls are out of step",
                    s.observed, s.expected
                ),
            },
            (_, OP_CAPACITY) => {
                let el = s.peer.max(0) as usize;
                Error::CapacityExceeded {
                    op,
                    what: format!("local expert {el} (expert {}) of rank {}", s.signal_id, self.rank),
                    count: s.observed as usize,
                    capacity: s.expected as usize,
                }
            }
            (_, OP_EXPERT) => Error::invalid(op, expert(s.expected, s.observed, s.signal_id)),
            (_, OP_SRC) if s.expected == u64::MAX => Error::invalid(
                op,
                format!("counts[{}] = {} is negative", s.peer, s.observed as u32 as i32),
            ),
            (_, OP_SRC) => Error::invalid(
                op,
                format!(
                    "src[{}, {}] = (rank {}, k {}) is not a dispatched row's source",
                    s.peer,
                    s.expected,
                    (s.observed >> 32) as u32 as i32,
                    s.observed as u32 as i32
                ),
            ),
            (_, OP_STRAY) => Error::invalid(
                op,
                format!(
                    "rank {} returned a row for token {}, k = {}, which it was not sent",
                    s.peer, s.expected as u32 as i32, s.observed as u32 as i32
                ),
            ),
            (_, OP_OUTBOX) => Error::invalid(
                op,
                format!(
                    "rank {} is behind the proxy queue and the MoE window has no outboxes",
                    s.peer
                ),
            ),
            (_, OP_MISSING) => Error::invalid(
                op,
                format!(
                    "no row came back for token {}, k = {} (from rank {}): its dispatch exceeded that \
                     expert's capacity, or the expert rank's counts were cut",
                    missing >> 32,
                    (missing >> 16) & 0xffff,
                    missing & 0xffff
                ),
            ),
            (code, other) => Error::invalid(op, format!("MoE kernel error {code} (op {other:#x})")),
        })
    }

    fn plan_dispatch(&self, st: &mut State, m: &mut MoeDispatch<'_>, hd: bool) -> Result<Plan> {
        const OP: &str = "moe_dispatch";
        let s = m.shape;
        let local = s.local_experts(self.size);
        let mut plan = Plan::default();
        let common = |d: DType| MoeArgs {
            hidden: s.hidden as u64,
            topk: s.topk as u64,
            experts: s.experts as u64,
            local: local as u64,
            capacity: s.capacity as u64,
            row_bytes: (s.hidden * d.size()) as u64,
            scale_bytes: if d == DType::F8E4M3 {
                4 * (s.hidden / FP8_BLOCK) as u64
            } else {
                0
            },
            elem: d as u64,
            ..Default::default()
        };
        let record = |a: &MoeArgs| -> u64 {
            let ids = (4 + 4 * s.topk as u64).next_multiple_of(16);
            ids + a.row_bytes.next_multiple_of(16) + a.scale_bytes.next_multiple_of(16)
        };
        if let Some(send) = &m.send {
            if st.dispatch.is_some() {
                return Err(Error::invalid(
                    OP,
                    "the receive half of the previous dispatch has not run: send halves cannot overlap",
                ));
            }
            let d = send.tokens.dtype();
            let mut a = common(d);
            a.tokens = addr(&send.tokens, hd)?;
            a.scales = send.scales.as_ref().map(|b| addr(b, hd)).transpose()?.unwrap_or(0);
            a.idx = addr(&send.topk_idx, hd)?;
            a.idx64 = (send.topk_idx.dtype() == DType::I64).into();
            a.n_tokens = send.tokens_count(s.hidden) as u64;
            a.record = record(&a);
            plan.launches.push(Launch {
                step: Step::DispatchSend,
                args: a,
            });
            plan.sent = Some((s, d));
        }
        if let Some(recv) = &mut m.recv {
            let d = recv.tokens.dtype();
            if m.send.is_none() {
                match st.dispatch {
                    None => return Err(Error::invalid(OP, "a receive half without a send half before it")),
                    Some((ss, sd)) if ss != s || sd != d => {
                        return Err(Error::invalid(
                            OP,
                            format!("the receive half ({s:?}, {d}) does not match its send half ({ss:?}, {sd})"),
                        ))
                    }
                    _ => {}
                }
            }
            let mut a = common(d);
            a.tokens = addr_mut(&mut recv.tokens, hd)?;
            a.scales = recv.scales.as_mut().map(|b| addr_mut(b, hd)).transpose()?.unwrap_or(0);
            a.counts = addr_mut(&mut recv.counts, hd)?;
            a.src = addr_mut(&mut recv.src, hd)?;
            a.record = record(&a);
            plan.launches.push(Launch {
                step: Step::DispatchRecv,
                args: a,
            });
            plan.received = true;
        }
        Ok(plan)
    }

    fn plan_combine(&self, st: &mut State, m: &mut MoeCombine<'_>, hd: bool) -> Result<Plan> {
        const OP: &str = "moe_combine";
        let s = m.shape;
        let local = s.local_experts(self.size);
        let mut plan = Plan::default();
        let common = |d: DType| -> Result<MoeArgs> {
            let row_bytes = (s.hidden * d.size()) as u64;
            Ok(MoeArgs {
                hidden: s.hidden as u64,
                topk: s.topk as u64,
                experts: s.experts as u64,
                local: local as u64,
                capacity: s.capacity as u64,
                row_bytes,
                dtype: act_code(d).ok_or_else(|| Error::invalid(OP, format!("rows of {d}")))?,
                elem: d as u64,
                record: 16 + row_bytes.next_multiple_of(16),
                ..Default::default()
            })
        };
        if let Some(send) = &m.send {
            if st.combine.is_some() {
                return Err(Error::invalid(
                    OP,
                    "the receive half of the previous combine has not run: send halves cannot overlap",
                ));
            }
            let d = send.expert_out.dtype();
            let mut a = common(d)?;
            a.tokens = addr(&send.expert_out, hd)?;
            a.src = addr(&send.src, hd)?;
            a.counts = addr(&send.counts, hd)?;
            plan.launches.push(Launch {
                step: Step::CombineSend,
                args: a,
            });
            plan.sent = Some((s, d));
        }
        if let Some(recv) = &mut m.recv {
            let d = recv.out.dtype();
            if m.send.is_none() {
                match st.combine {
                    None => return Err(Error::invalid(OP, "a receive half without a send half before it")),
                    Some((ss, sd)) if ss != s || sd != d => {
                        return Err(Error::invalid(
                            OP,
                            format!("the receive half ({s:?}, {d}) does not match its send half ({ss:?}, {sd})"),
                        ))
                    }
                    _ => {}
                }
            }
            let mut a = common(d)?;
            a.idx = addr(&recv.topk_idx, hd)?;
            a.idx64 = (recv.topk_idx.dtype() == DType::I64).into();
            a.weights = addr(&recv.topk_weights, hd)?;
            a.out = addr_mut(&mut recv.out, hd)?;
            a.n_tokens = (recv.out.count() / s.hidden) as u64;
            plan.launches.push(Launch {
                step: Step::CombineRecv,
                args: a,
            });
            plan.received = true;
        }
        Ok(plan)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    DispatchSend,
    DispatchRecv,
    CombineSend,
    CombineRecv,
}

struct Launch {
    step: Step,
    /// Without the layout's fields (filled in once the window is there).
    args: MoeArgs,
}

#[derive(Default)]
struct Plan {
    launches: Vec<Launch>,
    /// The send half's shape and dtype.
    sent: Option<(MoeShape, DType)>,
    /// The receive half runs.
    received: bool,
}

impl Plan {
    /// Send and receive halves of a dispatch (or a combine) that move only their slot headers,
    /// which carry `shape`, the element type `elem` and `refuse` (kernels/moe.cu): a refusal,
    /// or an announcement of a larger shape. No buffers: the receive reads and writes nothing.
    fn header_only(shape: &MoeShape, world: usize, elem: u64, dispatch: bool, refuse: u32) -> Plan {
        let args = MoeArgs {
            hidden: shape.hidden as u64,
            topk: shape.topk as u64,
            experts: shape.experts as u64,
            local: shape.local_experts(world) as u64,
            capacity: shape.capacity as u64,
            elem,
            refuse: refuse.into(),
            ..Default::default()
        };
        let (send, recv) = if dispatch {
            (Step::DispatchSend, Step::DispatchRecv)
        } else {
            (Step::CombineSend, Step::CombineRecv)
        };
        Plan {
            launches: vec![Launch { step: send, args }, Launch { step: recv, args }],
            sent: None,
            received: true,
        }
    }
}

/// A call's outcome with an earlier call's error that this call reports: this call's own error
/// first (the earlier one is logged), else the earlier one.
fn with_earlier(earlier: Result<()>, now: Result<()>) -> Result<()> {
    match (earlier, now) {
        (Err(old), Err(new)) => {
            tracing::warn!(error = %old, "an earlier MoE call's error, not returned: this call has its own");
            Err(new)
        }
        (Err(old), Ok(())) => Err(old),
        (Ok(()), now) => now,
    }
}

/// The address kernels use for a buffer: its device memory, or on the host device its host
/// memory.
fn addr(b: &Buf<'_>, host_device: bool) -> Result<u64> {
    match b.device_bytes() {
        Some(d) => Ok(d.ptr),
        None if host_device => Ok(b.host_bytes().as_ptr() as u64),
        None => Err(mixed()),
    }
}

fn addr_mut(b: &mut BufMut<'_>, host_device: bool) -> Result<u64> {
    match b.device_bytes() {
        Some(d) => Ok(d.ptr),
        None if host_device => Ok(b.host_bytes_mut().as_mut_ptr() as u64),
        None => Err(mixed()),
    }
}

fn mixed() -> Error {
    Error::invalid("moe", "a host buffer among device buffers")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_depends_on_the_shape_and_the_world_only_and_bounds_the_window() {
        let s = MoeShape {
            experts: 8,
            topk: 2,
            hidden: 128,
            capacity: 4,
        };
        let l = Layout::of(&s, 2, false).unwrap();
        assert_eq!(l.rows, 16);
        // The fixed header (epoch, shape, refusal), then a count per local expert.
        assert_eq!(l.header, 80);
        assert_eq!(l.dispatch_slot, 80 + 16 * (16 + 512));
        assert_eq!(l.combine_slot, 80 + 16 * (16 + 512));
        assert_eq!(l.bytes, 2 * (l.dispatch_slot + l.combine_slot));
        // With ranks on other hosts: one outbox per destination, as large as the larger slot.
        let k8 = MoeShape { topk: 8, ..s };
        let o = Layout::of(&k8, 4, true).unwrap();
        assert!(o.dispatch_slot > o.combine_slot);
        assert_eq!(o.bytes, 4 * (2 * o.dispatch_slot + o.combine_slot));
        assert_eq!(o.bytes - Layout::of(&k8, 4, false).unwrap().bytes, 4 * o.dispatch_slot);
        assert!(OwnMoe::takes(&s, 2, false) && OwnMoe::takes(&s, 2, true));
        assert!(
            !OwnMoe::takes(
                &MoeShape {
                    topk: 33,
                    experts: 64,
                    ..s
                },
                2,
                false
            ),
            "topk beyond the kernels'"
        );
        assert!(!OwnMoe::takes(&s, 17, false), "more ranks than the kernels take");
        let huge = MoeShape {
            experts: 1024,
            topk: 8,
            hidden: 1 << 16,
            capacity: 1 << 16,
        };
        assert!(!OwnMoe::takes(&huge, 8, false), "staging beyond WINDOW_MAX");
        // Outboxes count against WINDOW_MAX: a shape that fits without them may not with them.
        let near = MoeShape {
            experts: 8,
            topk: 1,
            hidden: 1 << 14,
            capacity: 768,
        };
        assert!(OwnMoe::takes(&near, 8, false) && !OwnMoe::takes(&near, 8, true));
        assert!(Layout::of(
            &MoeShape {
                capacity: usize::MAX,
                ..s
            },
            2,
            false
        )
        .is_none());
    }
}
