//! The device backend's own collective kernels on device buffers: one- and two-shot
//! all_reduce (kernels/oneshot.cu, twoshot.cu), multimem all_reduce where the window has a
//! multicast object (kernels/multimem.cu), one-shot all_gather and reduce_scatter,
//! all_to_all with any sizes (kernels/alltoall.cu), and the fused all_reduce + residual +
//! RMSNorm (kernels/fused_norm.cu, planned in `norm`).
//!
//! Every rank of a device communicator holds one window for them, made when the communicator
//! is (so nothing is allocated during a CUDA graph capture): a region for the one- and
//! two-shot kernels and one for all_to_all's slots, plus per-block counters in device memory
//! that the kernels advance themselves. A message larger than the first region (1 MiB per rank
//! unless FERROCOMM_DEVICE_ONESHOT_MAX says otherwise) runs as consecutive launches over
//! chunks of it, each a call of its own to the kernels' protocol; all_to_all chunks through
//! its slots inside one launch. A call is enqueued on the issuing stream and returns;
//! a kernel that gave up (timeout, abort, a peer's mismatched part) recorded why in the
//! window's status, which the next call (or `finalize`) reports.
//!
//! Whether a kernel runs an operation must not depend on anything that differs between ranks
//! (buffer addresses, alignment, the v-form sizes of all_to_all), or one rank would launch a
//! kernel that its peers never join: plans depend only on the operation, the element counts
//! every rank shares, and the world size. Addresses and alignment only pick the access width.

mod norm;

use super::call_order::CallOrder;
use super::rank::DeviceRank;
use super::window::DeviceWindow;
use crate::contracts::backend::hint_ignored;
use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::{Error, Result};
use crate::contracts::inference::RmsNormFusion;
use crate::contracts::ops::{Buf, BufMut, DeviceBytes, Op};
use crate::contracts::options::CommOptions;
use crate::contracts::window::WindowSpec;
use crate::gpu::cuda;
use crate::gpu::kernels::{self, reach, reach_mut, AllToAllArgs, Function, Parts, Queue, MAX_RANKS};
use crate::gpu::memory::Pinned;
use crate::gpu::target::{Gpu, Stream};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// kernels/collective.cuh's MAX_BLOCKS, MAX_RANKS and signal id groups.
use crate::gpu::kernels::MAX_BLOCKS;
const SIGNAL_IDS: usize = 5 * MAX_BLOCKS;
/// Bytes of one block's share before another block helps.
const BYTES_PER_BLOCK: usize = 64 << 10;
/// kernels/alltoall.cu's per-slot headers.
const SLOT_HEADER_BYTES: usize = 16 * MAX_BLOCKS;
/// u64 counters: one- and two-shot epochs (the fused norm's too), then all_to_all's calls, sent
/// and received chunks.
const SHOT_COUNTERS: usize = MAX_BLOCKS;
const ALL_TO_ALL_COUNTERS: usize = MAX_BLOCKS + 2 * MAX_BLOCKS * MAX_RANKS;
/// Then the fused norm's count of blocks that found a mismatched call, and whether the current
/// call's first launch found one.
const NORM_COUNTERS: usize = 2;

/// The all_reduce algorithm (hint `algorithm` = `oneshot` / `twoshot` / `multimem`, else by
/// size: multimem replaces two-shot where the window has a multicast object and the switch
/// reduces the dtype and op).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AllReduceAlgo {
    OneShot,
    TwoShot,
    Multimem,
}

pub(crate) struct OwnCollectives {
    window: DeviceWindow,
    /// Calls on different streams run one after another (they share the window). The host
    /// device runs each call to completion on the window's stream: no other order needed.
    order: Option<CallOrder>,
    counters: Counters,
    /// On the host device, buffers in host memory are the kernels' memory.
    host_device: bool,
    /// Kernels per (dtype, reduce op) name suffix, e.g. `bf16_sum`.
    one_shot: HashMap<&'static str, Function>,
    two_shot: HashMap<&'static str, Function>,
    /// Only the pairs of `multimem_suffix`.
    multimem: HashMap<&'static str, Function>,
    /// The window has a multicast object (the ranks agreed, so all or none have one).
    multicast: bool,
    reduce_scatter: HashMap<&'static str, Function>,
    all_gather: Function,
    all_to_all: Function,
    norm: norm::NormKernels,
    /// The most bytes per rank one launch of the one- and two-shot kernels takes (the first
    /// region); larger messages run as several launches.
    max_bytes: usize,
    /// all_reduce messages from this size take the two-shot kernel.
    two_shot_min: usize,
    /// The communicator's timeout: the bound of the wait for running kernels on drop.
    timeout: Duration,
    size: usize,
}

fn suffix(dtype: DType, op: ReduceOp) -> Option<&'static str> {
    Some(match (dtype, op) {
        (DType::F32, ReduceOp::Sum) => "f32_sum",
        (DType::F32, ReduceOp::Min) => "f32_min",
        (DType::F32, ReduceOp::Max) => "f32_max",
        (DType::F32, ReduceOp::Avg) => "f32_avg",
        (DType::F16, ReduceOp::Sum) => "f16_sum",
        (DType::F16, ReduceOp::Min) => "f16_min",
        (DType::F16, ReduceOp::Max) => "f16_max",
        (DType::F16, ReduceOp::Avg) => "f16_avg",
        (DType::BF16, ReduceOp::Sum) => "bf16_sum",
        (DType::BF16, ReduceOp::Min) => "bf16_min",
        (DType::BF16, ReduceOp::Max) => "bf16_max",
        (DType::BF16, ReduceOp::Avg) => "bf16_avg",
        // 16-bit integers (the types NCCL cannot reduce): exact in f32, wrapping like the CPU's.
        (DType::I16, ReduceOp::Sum) => "i16_sum",
        (DType::I16, ReduceOp::Min) => "i16_min",
        (DType::I16, ReduceOp::Max) => "i16_max",
        (DType::I16, ReduceOp::Avg) => "i16_avg",
        (DType::U16, ReduceOp::Sum) => "u16_sum",
        (DType::U16, ReduceOp::Min) => "u16_min",
        (DType::U16, ReduceOp::Max) => "u16_max",
        (DType::U16, ReduceOp::Avg) => "u16_avg",
        _ => return None,
    })
}

/// The (dtype, op) pairs the switch reduces (kernels/multimem.cu): no f32 min / max in
/// hardware, and 16-bit averages would round twice.
fn multimem_suffix(dtype: DType, op: ReduceOp) -> Option<&'static str> {
    match (dtype, op) {
        (DType::F32, ReduceOp::Sum | ReduceOp::Avg)
        | (DType::F16 | DType::BF16, ReduceOp::Sum | ReduceOp::Min | ReduceOp::Max) => suffix(dtype, op),
        _ => None,
    }
}

impl OwnCollectives {
    /// Collective over the communicator, like any window.
    pub(crate) fn create(b: &DeviceRank, options: &CommOptions) -> Result<OwnCollectives> {
        let timeout = options.timeout;
        // The kernels load and store to every peer: ranks on other hosts are out of reach.
        if let Err(why) = &b.one_host {
            return Err(Error::Unavailable {
                backend: "device".into(),
                reason: format!("own collective kernels need every rank on one host: {why}"),
            });
        }
        let max_bytes = options.config.device_oneshot_max.max(16).next_multiple_of(16);
        let two_shot_min = options.config.device_twoshot_min;
        // An id no user window reaches: it only names the window's store namespace. The
        // second region (all_to_all's slots) is as large as the first.
        let spec = WindowSpec {
            id: u64::MAX,
            bytes: 2 * max_bytes,
            signals: SIGNAL_IDS,
            registered: None,
            timeout,
        };
        let window = DeviceWindow::create(b, &spec)?;
        let counters = Counters::new(b.gpu, window.handle_and_stream().1)?;
        let load = |name: String| b.gpu.function(&name);
        let (mut one_shot, mut two_shot, mut reduce_scatter) = (HashMap::new(), HashMap::new(), HashMap::new());
        let mut multimem = HashMap::new();
        for d in [DType::F32, DType::F16, DType::BF16, DType::I16, DType::U16] {
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg] {
                let Some(s) = suffix(d, op) else { continue };
                one_shot.insert(s, load(format!("{}{s}", kernels::ALL_REDUCE_ONESHOT.name))?);
                two_shot.insert(s, load(format!("{}{s}", kernels::ALL_REDUCE_TWOSHOT.name))?);
                reduce_scatter.insert(s, load(format!("{}{s}", kernels::REDUCE_SCATTER.name))?);
                if multimem_suffix(d, op).is_some() {
                    multimem.insert(s, load(format!("{}{s}", kernels::ALL_REDUCE_MULTIMEM.name))?);
                }
            }
        }
        let multicast = window.handle_and_stream().0.multicast != 0;
        Ok(OwnCollectives {
            window,
            order: (b.gpu != Gpu::Host).then(CallOrder::new).transpose()?,
            counters,
            host_device: b.gpu == Gpu::Host,
            one_shot,
            two_shot,
            multimem,
            multicast,
            reduce_scatter,
            all_gather: load(kernels::ALL_GATHER.name.into())?,
            all_to_all: load(kernels::ALL_TO_ALL.name.into())?,
            norm: norm::NormKernels::load(load)?,
            max_bytes,
            two_shot_min,
            timeout,
            size: b.size,
        })
    }

    /// The algorithm of an all_reduce of `bytes` of `dtype` with `op`; `explain`: note a hint
    /// that cannot be honoured (once per call: `supports` plans quietly before `run` does).
    fn all_reduce_algo(
        &self,
        bytes: usize,
        dtype: DType,
        op: ReduceOp,
        hints: &BTreeMap<String, String>,
        explain: bool,
    ) -> AllReduceAlgo {
        let switch_reduces = self.multicast && multimem_suffix(dtype, op).is_some();
        let hint = hints.get("algorithm").map(String::as_str);
        let (algo, ignored) = pick_all_reduce(hint, bytes, self.two_shot_min, self.multicast, switch_reduces);
        if let (Some(why), Some(value), true) = (ignored, hint, explain) {
            let why = format!("{why} ({dtype:?} with {op})");
            hint_ignored("device", "all_reduce", "algorithm", value, &why);
        }
        algo
    }

    /// The kernel for `op` and its launch, if one here runs it (see the module doc).
    fn plan(
        &self,
        op: &mut Op<'_>,
        hints: &BTreeMap<String, String>,
        explain: bool,
    ) -> Result<Option<(&Function, Launch)>> {
        let few_ranks = self.size <= MAX_RANKS;
        let hd = self.host_device;
        if explain && !matches!(op, Op::AllReduce { .. } | Op::AllReduceRmsNorm(_)) {
            if let Some(a) = hints.get("algorithm").filter(|a| *a != "oneshot") {
                hint_ignored(
                    "device",
                    op.name(),
                    "algorithm",
                    a,
                    "this operation's kernel has one algorithm",
                );
            }
        }
        let plan = match op {
            Op::AllReduce { buf, op } => {
                let (Some(d), Some(s)) = (reach_mut(buf, hd), suffix(buf.dtype(), *op)) else {
                    return Ok(None);
                };
                let kernels = match self.all_reduce_algo(d.len, buf.dtype(), *op, hints, explain) {
                    AllReduceAlgo::OneShot => &self.one_shot,
                    AllReduceAlgo::TwoShot => &self.two_shot,
                    AllReduceAlgo::Multimem => &self.multimem,
                };
                // Shares are whole 16-byte groups of the message: only the pointers need alignment.
                let vectors = d.ptr % 16 == 0;
                let args = Args::shot(Param::Ptr(d.ptr), Param::Ptr(d.ptr), buf.count(), vectors);
                Some((
                    &kernels[s],
                    Launch::shot(d.len, args, buf.dtype().size(), self.max_bytes),
                ))
            }
            Op::AllGather { input, outputs } => {
                let (Some(i), Some(parts)) = (reach(input, hd), parts_mut(outputs, hd)) else {
                    return Ok(None);
                };
                let equal = outputs.iter().all(|o| o.byte_len() == i.len);
                let vectors = i.len % 16 == 0 && i.ptr % 16 == 0 && aligned(&parts);
                (equal && few_ranks).then(|| {
                    let args = Args::shot(Param::Ptr(i.ptr), Param::Table(Box::new(parts)), i.len, vectors);
                    (&self.all_gather, Launch::shot(i.len, args, 1, self.max_bytes))
                })
            }
            Op::ReduceScatter { inputs, output, op } => {
                let (Some(o), Some(parts), Some(s)) =
                    (reach_mut(output, hd), parts(inputs, hd), suffix(output.dtype(), *op))
                else {
                    return Ok(None);
                };
                let equal = inputs.iter().all(|i| i.byte_len() == o.len);
                let vectors = o.len % 16 == 0 && o.ptr % 16 == 0 && aligned(&parts);
                // Our segment holds every block of our input: a launch takes 1/size of it.
                let per_launch = (self.max_bytes / self.size.max(1)) & !15;
                (equal && few_ranks && per_launch > 0).then(|| {
                    let args = Args::shot(
                        Param::Table(Box::new(parts)),
                        Param::Ptr(o.ptr),
                        output.count(),
                        vectors,
                    );
                    let launch = Launch::shot(o.len, args, output.dtype().size(), per_launch);
                    (&self.reduce_scatter[s], launch)
                })
            }
            Op::AllToAll { inputs, outputs } => {
                let (Some(send), Some(recv)) = (parts(inputs, hd), parts_mut(outputs, hd)) else {
                    return Ok(None);
                };
                let mut a = AllToAllArgs {
                    send: send.ptr,
                    recv: recv.ptr,
                    region: self.max_bytes as u64,
                    slot: ((self.max_bytes / self.size.max(1)) & !15) as u64,
                    ..Default::default()
                };
                for (r, (i, o)) in inputs.iter().zip(outputs.iter()).enumerate() {
                    a.send_len[r] = i.byte_len() as u64;
                    a.recv_len[r] = o.byte_len() as u64;
                }
                // A slot must carry its headers and some payload.
                let usable = a.slot as usize > SLOT_HEADER_BYTES + 16;
                let bytes = inputs.iter().map(Buf::byte_len).sum::<usize>();
                (few_ranks && usable).then(|| (&self.all_to_all, Launch::all_to_all(bytes, a)))
            }
            Op::AllReduceRmsNorm(f) => self.plan_norm(f, hints, explain),
            _ => None,
        };
        Ok(plan)
    }

    /// Whether a kernel here runs `op` (the hints were checked: see `route::check_hints`).
    pub(crate) fn supports(&self, op: &mut Op<'_>, hints: &BTreeMap<String, String>) -> bool {
        self.plan(op, hints, false).is_ok_and(|p| p.is_some())
    }

    /// Enqueues `op` on `stream`; `supports(op)` must hold.
    pub(crate) fn run(
        &self,
        op: &mut Op<'_>,
        hints: &BTreeMap<String, String>,
        stream: u64,
        timeout: Duration,
    ) -> Result<()> {
        let name = op.name();
        // A kernel of an earlier call that gave up: report it (and start clean).
        self.window.take_status(name, timeout)?;
        let (f, launch) = self
            .plan(op, hints, true)?
            .ok_or_else(|| Error::invalid(name, "no device kernel for this operation"))?;
        if launch.bytes == 0 && !matches!(launch.args, Args::AllToAll(_)) {
            return Ok(());
        }
        let (handle, window_stream) = self.window.handle_and_stream();
        let counters = self.counters.addr();
        match window_stream {
            // Host buffers belong to the call: the host device runs it on the window's stream
            // and returns only once every launch has ended, even after a timeout (a kernel still
            // running would write a buffer its caller may free). Each launch's waits end by the
            // call's own deadline, so the wait for all of them is bounded.
            Stream::Host(_) => {
                let mut handle = handle;
                handle.timeout_ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
                let launches = launch.count();
                self.enqueue(f, launch, handle, counters, window_stream.queue())?;
                self.window.finish(name, (timeout + Duration::from_secs(1)) * launches)
            }
            Stream::Cuda(_) => {
                let order = self
                    .order
                    .as_ref()
                    .ok_or_else(|| Error::invalid(name, "no call order"))?;
                order.run(stream, || {
                    self.enqueue(f, launch, handle, counters, Queue::Cuda(cuda::stream::raw(stream)))
                })
            }
        }
    }

    /// Puts the kernel launches of one call on `queue`.
    fn enqueue(
        &self,
        f: &Function,
        launch: Launch,
        handle: crate::contracts::window_handle::WindowHandle,
        counters: u64,
        queue: Queue<'_>,
    ) -> Result<()> {
        match launch.args {
            Args::AllToAll(a) => {
                // The sizes differ between ranks, so the grid is fixed.
                let counters = counters + (SHOT_COUNTERS * 8) as u64;
                kernels::ALL_TO_ALL.launch(f, queue, MAX_BLOCKS as u32, (handle, *a, counters))
            }
            // The fused norm's counters are the one- and two-shot kernels': one protocol.
            Args::Norm(call) => {
                let mismatches = counters + ((SHOT_COUNTERS + ALL_TO_ALL_COUNTERS) * 8) as u64;
                call.enqueue(f, queue, handle, counters, mismatches)
            }
            // Messages larger than the window's region run as consecutive launches, one per
            // chunk (the same cut on every rank: it depends on the counts and the region).
            Args::Shot {
                input,
                output,
                n,
                vectors,
            } => {
                for (offset, count) in chunks(n, launch.unit, launch.chunk) {
                    let (input, output) = (input.offset(offset, self.size), output.offset(offset, self.size));
                    let blocks = Launch::blocks(count as usize * launch.unit);
                    match (input, output) {
                        (Param::Ptr(i), Param::Ptr(o)) => {
                            // One- two-shot and multimem all_reduce share a parameter list.
                            kernels::ALL_REDUCE_ONESHOT.launch(
                                f,
                                queue,
                                blocks,
                                (handle, i, o, count, counters, vectors),
                            )?
                        }
                        (Param::Ptr(i), Param::Table(o)) => {
                            kernels::ALL_GATHER.launch(f, queue, blocks, (handle, i, *o, count, counters, vectors))?
                        }
                        (Param::Table(i), Param::Ptr(o)) => kernels::REDUCE_SCATTER.launch(
                            f,
                            queue,
                            blocks,
                            (handle, *i, o, count, counters, vectors),
                        )?,
                        (Param::Table(_), Param::Table(_)) => {
                            return Err(Error::invalid("device collectives", "no kernel takes two tables"))
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// Whether the fused kernels would run a fused norm like `f` with these hints, as `plan_norm`
    /// decides it, from what does not depend on the buffers' lengths: the element types, the
    /// row length and where the buffers are. A rank that refuses its call (`refuse_norm`) asks,
    /// its lengths being the reason it refuses: the peers' calls have the same row length and
    /// types, so they took the kernels exactly when this says so.
    pub(crate) fn takes_norm(&self, f: &RmsNormFusion<'_>, hints: &BTreeMap<String, String>) -> bool {
        let reachable = self.host_device
            || (f.x.device_bytes().is_some()
                && f.gamma.device_bytes().is_some()
                && f.residual.device_bytes().is_some()
                && f.out.device_bytes().is_some()
                && f.scales.as_ref().map_or(true, |s| s.device_bytes().is_some()));
        if !reachable || norm::suffix(f.x.dtype(), f.quantised()).is_none() {
            return false;
        }
        let hint = hints.get("algorithm").map(String::as_str);
        let (two_shot, _) = norm::pick(hint, f.x.byte_len(), f.tokens(), self.size, self.two_shot_min);
        let (in_size, out_size) = (f.x.dtype().size(), f.out.dtype().size());
        norm::segment_bytes(1, f.hidden, in_size, out_size, self.size, two_shot) <= self.max_bytes
    }

    /// Takes part in a fused norm this rank refuses (an argument error found on its host), far
    /// enough for the peers' kernels to fail at once naming this rank (`Backend::refuse`): one
    /// launch without rows whose headers say "refused" (kernels/fused_norm.cu). The peers' first
    /// launch finds it and their later ones end at once, so every rank's epochs stay in step.
    /// On a GPU every rank, this one included, reports the refusal from its next call (and
    /// skips that call, as all do: kernels/fused_norm.cu `report`); on the host device the
    /// peers report it inside this call.
    pub(crate) fn refuse_norm(&self, call: &RmsNormFusion<'_>, stream: u64, timeout: Duration) -> Result<()> {
        const OP: &str = norm::OP;
        // A failure an earlier call's kernels recorded ends this call before it launches, as
        // `run` does on every rank that has it (cleared, so that the next call runs, as theirs).
        if let Err(e) = self.window.take_status(OP, timeout) {
            return Err(Error::invalid(
                OP,
                format!("an earlier call failed ({e}): the peers were not told"),
            ));
        }
        // An empty call launches nothing on the peers (`run`): nothing to tell them.
        if call.x.byte_len() == 0 {
            return Ok(());
        }
        let f = self
            .norm
            .one_shot
            .get("f32")
            .ok_or_else(|| Error::invalid(OP, "no fused norm kernel"))?;
        let mismatches = self.counters.addr() + ((SHOT_COUNTERS + ALL_TO_ALL_COUNTERS) * 8) as u64;
        let args = kernels::NormArgs {
            mismatches,
            refused: 1,
            ..Default::default()
        };
        let (mut handle, window_stream) = self.window.handle_and_stream();
        let counters = self.counters.addr();
        match window_stream {
            Stream::Host(_) => {
                handle.timeout_ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
                kernels::RMSNORM_ONESHOT.launch(
                    f,
                    window_stream.queue(),
                    MAX_BLOCKS as u32,
                    (handle, args, counters),
                )?;
                // The peers report the refusal inside their calls here: this rank's own record
                // of it is not reported again.
                match self.window.finish(OP, timeout + Duration::from_secs(1)) {
                    Ok(()) | Err(Error::InvalidArgument { .. }) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            Stream::Cuda(_) => {
                let order = self.order.as_ref().ok_or_else(|| Error::invalid(OP, "no call order"))?;
                order.run(stream, || {
                    let q = Queue::Cuda(cuda::stream::raw(stream));
                    kernels::RMSNORM_ONESHOT.launch(f, q, MAX_BLOCKS as u32, (handle, args, counters))
                })
            }
        }
    }

    /// Reports a kernel's recorded failure.
    pub(crate) fn check(&self, op: &'static str, timeout: Duration) -> Result<()> {
        self.window.take_status(op, timeout)
    }
}

impl Drop for OwnCollectives {
    /// The kernels of the last calls ran on the users' streams, not the window's: the window
    /// (dropped right after this) must not be unmapped under them. Bounded: their own waits end
    /// by the communicator's timeout.
    fn drop(&mut self) {
        if let Some(order) = &self.order {
            let _ = self.window.enter_gpu();
            if let Err(e) = order.wait_last(self.timeout + Duration::from_secs(1)) {
                tracing::warn!("device collectives still running when their window is released: {e}");
            }
        }
    }
}

/// A kernel's arguments besides the window handle and the counters.
enum Args {
    /// The one- and two-shot kernels: input, output, count (elements; bytes for all_gather),
    /// vector flag. The side with one part per rank (all_gather's output, reduce_scatter's
    /// input) is a table.
    Shot {
        input: Param,
        output: Param,
        n: u64,
        vectors: u32,
    },
    /// Boxed, like `Param::Table`: these are hundreds of bytes, moved once per call.
    AllToAll(Box<AllToAllArgs>),
    /// The fused norm: launches of whole rows.
    Norm(Box<norm::NormCall>),
}

impl Args {
    fn shot(input: Param, output: Param, count: usize, vectors: bool) -> Args {
        Args::Shot {
            input,
            output,
            n: count as u64,
            vectors: vectors.into(),
        }
    }
}

/// A buffer parameter: one device pointer, or one per rank.
enum Param {
    Ptr(u64),
    Table(Box<Parts>),
}

impl Param {
    /// The same buffer(s) `bytes` further on (the first `ranks` entries of a table).
    fn offset(&self, bytes: u64, ranks: usize) -> Param {
        match self {
            Param::Ptr(p) => Param::Ptr(p + bytes),
            Param::Table(t) => {
                let mut t = **t;
                for p in t.ptr.iter_mut().take(ranks) {
                    *p += bytes;
                }
                Param::Table(Box::new(t))
            }
        }
    }
}

struct Launch {
    /// This rank's bytes (nothing to do when 0, except for all_to_all, whose peers may send).
    bytes: usize,
    args: Args,
    /// Bytes per unit of the shot kernels' count `n` (the element size; 1 for all_gather).
    unit: usize,
    /// The most bytes of the message one launch takes (what the window's region holds).
    chunk: usize,
}

impl Launch {
    /// A one- or two-shot kernel over `bytes` in launches of at most `chunk` bytes (a multiple
    /// of 16 and of `unit`).
    fn shot(bytes: usize, args: Args, unit: usize, chunk: usize) -> Launch {
        Launch {
            bytes,
            args,
            unit,
            chunk,
        }
    }

    /// The grid of a shot launch follows its chunk, which every rank shares.
    fn blocks(bytes: usize) -> u32 {
        bytes.div_ceil(BYTES_PER_BLOCK).clamp(1, MAX_BLOCKS) as u32
    }

    /// How many kernel launches the call makes.
    fn count(&self) -> u32 {
        match &self.args {
            Args::AllToAll(_) => 1,
            Args::Norm(call) => call.count(),
            Args::Shot { n, .. } => chunks(*n, self.unit, self.chunk).count().max(1) as u32,
        }
    }

    /// all_to_all chunks by itself, in one launch.
    fn all_to_all(bytes: usize, args: AllToAllArgs) -> Launch {
        Launch {
            bytes,
            args: Args::AllToAll(Box::new(args)),
            unit: 1,
            chunk: usize::MAX,
        }
    }
}

/// (byte offset, count) of each launch over `n` units of `unit` bytes, at most `chunk` bytes
/// each (at least one unit).
fn chunks(n: u64, unit: usize, chunk: usize) -> impl Iterator<Item = (u64, u64)> {
    let per_launch = (chunk / unit.max(1)).max(1) as u64;
    (0..n.div_ceil(per_launch)).map(move |k| {
        let first = k * per_launch;
        (first * unit as u64, per_launch.min(n - first))
    })
}

/// One device pointer per rank, if every part is in device memory and ranks fit the table.
fn table(parts: impl ExactSizeIterator<Item = Option<DeviceBytes>>) -> Option<Parts> {
    if parts.len() > MAX_RANKS {
        return None;
    }
    let mut t = Parts::default();
    for (r, p) in parts.enumerate() {
        t.ptr[r] = p?.ptr;
    }
    Some(t)
}

fn parts(bufs: &[Buf<'_>], host_device: bool) -> Option<Parts> {
    table(bufs.iter().map(|b| reach(b, host_device)))
}

fn parts_mut(bufs: &mut [BufMut<'_>], host_device: bool) -> Option<Parts> {
    table(bufs.iter_mut().map(|b| reach_mut(b, host_device)))
}

/// The kernels' per-block counters: device memory on a GPU, host memory on the host device.
enum Counters {
    Cuda(CudaSlice<u64>),
    Host(Pinned<u64>),
}

impl Counters {
    fn new(gpu: Gpu, stream: &Stream) -> Result<Counters> {
        let n = SHOT_COUNTERS + ALL_TO_ALL_COUNTERS + NORM_COUNTERS;
        match (gpu, stream) {
            (Gpu::Cuda(_), Stream::Cuda(s)) => {
                let c = s.alloc_zeros::<u64>(n).map_err(|e| cuda::err("cuMemAlloc", e))?;
                s.synchronize().map_err(|e| cuda::err("cuStreamSynchronize", e))?;
                Ok(Counters::Cuda(c))
            }
            _ => Ok(Counters::Host(gpu.records(n)?)),
        }
    }

    /// Their device address. CUDA counters were allocated on the window's stream, which
    /// orders their first use.
    fn addr(&self) -> u64 {
        match self {
            Counters::Cuda(c) => c.device_ptr(c.stream()).0,
            Counters::Host(p) => p.device_addr(),
        }
    }
}

/// The all_reduce algorithm: the hint's where the kernels can honour it, else by size
/// (multimem replaces two-shot where the switch reduces the pair); with why a hint was not
/// honoured. Values outside `route::check_hints`' list do not reach here.
fn pick_all_reduce(
    hint: Option<&str>,
    bytes: usize,
    two_shot_min: usize,
    multicast: bool,
    switch_reduces: bool,
) -> (AllReduceAlgo, Option<&'static str>) {
    let by_size = match bytes >= two_shot_min {
        true if switch_reduces => AllReduceAlgo::Multimem,
        true => AllReduceAlgo::TwoShot,
        false => AllReduceAlgo::OneShot,
    };
    match hint {
        None => (by_size, None),
        Some("oneshot") => (AllReduceAlgo::OneShot, None),
        Some("twoshot") => (AllReduceAlgo::TwoShot, None),
        Some("multimem") if switch_reduces => (AllReduceAlgo::Multimem, None),
        Some("multimem") if !multicast => (
            by_size,
            Some(
                "this communicator's windows have no multicast object (that needs every rank on a GPU \
                 of its own that supports multicast; FERROCOMM_LOG=debug says why not)",
            ),
        ),
        Some("multimem") => (by_size, Some("the switch does not reduce this pair")),
        Some(_) => (by_size, Some("the device kernels run oneshot, twoshot or multimem")),
    }
}

fn aligned(p: &Parts) -> bool {
    p.ptr.iter().all(|a| a % 16 == 0)
}

// The fused norm's plan (its kernels and shapes are in collectives/norm.rs).
impl OwnCollectives {
    /// The kernel and launches for the fused norm `f`, if a kernel here runs it (see the
    /// module doc); `explain`: note a hint that cannot be honoured.
    fn plan_norm(
        &self,
        f: &mut RmsNormFusion<'_>,
        hints: &BTreeMap<String, String>,
        explain: bool,
    ) -> Option<(&Function, Launch)> {
        let hd = self.host_device;
        let (d, hidden, tokens) = (f.x.dtype(), f.hidden, f.tokens());
        let s = norm::suffix(d, f.quantised())?;
        let x = reach(&f.x, hd)?;
        let gamma = reach(&f.gamma, hd)?;
        let residual = reach_mut(&mut f.residual, hd)?;
        let out = reach_mut(&mut f.out, hd)?;
        let scales = match f.scales.as_mut() {
            Some(sc) => reach_mut(sc, hd)?.ptr,
            None => 0,
        };
        let hint = hints.get("algorithm").map(String::as_str);
        let (two_shot, ignored) = norm::pick(hint, x.len, tokens, self.size, self.two_shot_min);
        if let (Some(why), Some(value), true) = (ignored, hint, explain) {
            hint_ignored("device", norm::OP, "algorithm", value, why);
        }
        let (in_size, out_size) = (d.size(), f.out.dtype().size());
        let per_launch = norm::rows_per_launch(tokens, self.max_bytes, |rows| {
            norm::segment_bytes(rows, hidden, in_size, out_size, self.size, two_shot)
        });
        if per_launch == 0 {
            return None;
        }
        // 16-byte groups of a row: every row starts aligned where the buffers do.
        let group = 16 / in_size;
        let vectors = hidden % group == 0 && [x.ptr, residual.ptr, gamma.ptr, out.ptr].iter().all(|p| p % 16 == 0);
        let args = kernels::NormArgs {
            x: x.ptr,
            residual: residual.ptr,
            gamma: gamma.ptr,
            out: out.ptr,
            scales,
            rows: tokens as u64,
            hidden: hidden as u64,
            eps: f.eps,
            vectors: vectors.into(),
            // The counters' address is the launch's (`enqueue`).
            mismatches: 0,
            // Each launch's own (`NormCall::launches`).
            call_rows: tokens as u64,
            launch: 0,
            refused: 0,
        };
        let call = norm::NormCall {
            args,
            two_shot,
            row_in: (hidden * in_size) as u64,
            row_out: (hidden * out_size) as u64,
            per_launch: per_launch as u64,
        };
        let kernels = if two_shot {
            &self.norm.two_shot
        } else {
            &self.norm.one_shot
        };
        Some((&kernels[s], Launch::norm(x.len, call)))
    }
}

impl Launch {
    /// The fused norm chunks by rows itself.
    fn norm(bytes: usize, call: norm::NormCall) -> Launch {
        Launch {
            bytes,
            args: Args::Norm(Box::new(call)),
            unit: 1,
            chunk: usize::MAX,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{chunks, pick_all_reduce, AllReduceAlgo};

    #[test]
    fn all_reduce_hints_are_honoured_where_the_kernels_can_and_ignored_where_not() {
        use AllReduceAlgo::*;
        let pick = |hint, bytes, multicast, switch| pick_all_reduce(hint, bytes, 1024, multicast, switch);
        // By size: one-shot below the two-shot threshold, multimem instead of two-shot where
        // the switch reduces.
        assert_eq!(pick(None, 1023, false, false), (OneShot, None));
        assert_eq!(pick(None, 1024, false, false), (TwoShot, None));
        assert_eq!(pick(None, 1024, true, true), (Multimem, None));
        assert_eq!(pick(None, 1024, true, false), (TwoShot, None));
        // Honoured at any size.
        assert_eq!(pick(Some("twoshot"), 8, false, false), (TwoShot, None));
        assert_eq!(pick(Some("oneshot"), 1 << 20, true, true), (OneShot, None));
        assert_eq!(pick(Some("multimem"), 8, true, true), (Multimem, None));
        // Not honourable: the size rule, and why.
        let (algo, why) = pick(Some("multimem"), 8, false, false);
        assert_eq!(algo, OneShot);
        assert!(why.unwrap().contains("multicast"));
        let (algo, why) = pick(Some("multimem"), 4096, true, false);
        assert_eq!(algo, TwoShot);
        assert!(why.unwrap().contains("does not reduce"));
        // The CPU engine's algorithms are no kernel's.
        let (algo, why) = pick(Some("ring"), 8, false, false);
        assert_eq!((algo, why.is_some()), (OneShot, true));
    }

    #[test]
    fn chunks_cover_the_message_once_in_region_sized_launches() {
        assert_eq!(chunks(0, 4, 1 << 20).count(), 0);
        assert_eq!(chunks(10, 4, 1 << 20).collect::<Vec<_>>(), vec![(0, 10)]);
        // 1 MiB of f32 exactly is one launch; one more element is a second.
        assert_eq!(chunks(1 << 18, 4, 1 << 20).count(), 1);
        assert_eq!(
            chunks((1 << 18) + 1, 4, 1 << 20).collect::<Vec<_>>(),
            vec![(0, 1 << 18), (1 << 20, 1)]
        );
        for (n, unit, chunk) in [
            (16u64 << 20, 2usize, 1usize << 20),
            (1_000_003, 4, 4096),
            (300_001, 1, 1 << 20),
        ] {
            let parts: Vec<_> = chunks(n, unit, chunk).collect();
            let mut next = 0u64;
            for &(offset, count) in &parts {
                assert_eq!(offset, next * unit as u64, "launches are contiguous");
                assert!(count >= 1 && count as usize * unit <= chunk);
                assert_eq!(
                    offset % 16,
                    0,
                    "every launch starts 16-byte aligned relative to the message"
                );
                next += count;
            }
            assert_eq!(next, n);
        }
    }
}
