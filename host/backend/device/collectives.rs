//! The device backend's own collective kernels on device buffers: one- and two-shot
//! all_reduce (kernels/oneshot.cu, twoshot.cu), multimem all_reduce where the window has a
//! multicast object (kernels/multimem.cu), one-shot all_gather and reduce_scatter, and
//! all_to_all with any sizes (kernels/alltoall.cu).
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

use super::call_order::CallOrder;
use super::route::parse_bytes;
use super::window::DeviceWindow;
use super::DeviceBackend;
use crate::cuda;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::ops::{Buf, BufMut, DeviceBytes, Op};
use crate::window::{WindowBackend, WindowSpec};
use cudarc::driver::{sys, CudaFunction, CudaSlice, DevicePtr};
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::time::Duration;

/// kernels/collective.cuh's MAX_BLOCKS, MAX_RANKS and signal id groups.
const MAX_BLOCKS: usize = 16;
const MAX_RANKS: usize = 16;
const SIGNAL_IDS: usize = 5 * MAX_BLOCKS;
const THREADS: u32 = 256;
/// Bytes of one block's share before another block helps.
const BYTES_PER_BLOCK: usize = 64 << 10;
/// kernels/alltoall.cu's per-slot headers.
const SLOT_HEADER_BYTES: usize = 16 * MAX_BLOCKS;
/// u64 counters: one- and two-shot epochs, then all_to_all's calls, sent and received chunks.
const SHOT_COUNTERS: usize = MAX_BLOCKS;
const ALL_TO_ALL_COUNTERS: usize = MAX_BLOCKS + 2 * MAX_BLOCKS * MAX_RANKS;

/// kernels/collective.cuh's `Parts`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Parts {
    ptr: [u64; MAX_RANKS],
}

/// kernels/alltoall.cu's `AllToAll`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AllToAllArgs {
    send: [u64; MAX_RANKS],
    send_len: [u64; MAX_RANKS],
    recv: [u64; MAX_RANKS],
    recv_len: [u64; MAX_RANKS],
    region: u64,
    slot: u64,
}

const _: () = assert!(std::mem::size_of::<Parts>() == 8 * MAX_RANKS);
const _: () = assert!(std::mem::size_of::<AllToAllArgs>() == 8 * (4 * MAX_RANKS + 2));

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
    /// Calls on different streams run one after another (they share the window).
    order: CallOrder,
    counters: CudaSlice<u64>,
    /// Kernels per (dtype, reduce op) name suffix, e.g. `bf16_sum`.
    one_shot: HashMap<&'static str, CudaFunction>,
    two_shot: HashMap<&'static str, CudaFunction>,
    /// Only the pairs of `multimem_suffix`.
    multimem: HashMap<&'static str, CudaFunction>,
    /// The window has a multicast object (the ranks agreed, so all or none have one).
    multicast: bool,
    reduce_scatter: HashMap<&'static str, CudaFunction>,
    all_gather: CudaFunction,
    all_to_all: CudaFunction,
    /// The most bytes per rank one launch of the one- and two-shot kernels takes (the first
    /// region); larger messages run as several launches.
    max_bytes: usize,
    /// all_reduce messages from this size take the two-shot kernel.
    two_shot_min: usize,
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

fn env_bytes(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => parse_bytes(&v).ok_or_else(|| Error::Config(format!("{name}={v:?}: expected bytes such as 1M"))),
    }
}

impl OwnCollectives {
    /// Collective over the communicator, like any window.
    pub(crate) fn create(b: &DeviceBackend, timeout: Duration) -> Result<OwnCollectives> {
        // The kernels load and store to every peer: ranks on other hosts are out of reach.
        if let Err(why) = &b.one_host {
            return Err(Error::Unavailable {
                backend: "device".into(),
                reason: format!("own collective kernels need every rank on one host: {why}"),
            });
        }
        let max_bytes = env_bytes("FERROCOMM_DEVICE_ONESHOT_MAX", 1 << 20)?
            .max(16)
            .next_multiple_of(16);
        let two_shot_min = env_bytes("FERROCOMM_DEVICE_TWOSHOT_MIN", 128 << 10)?;
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
        let (_, stream) = window
            .device()
            .ok_or_else(|| Error::invalid("device collectives", "no device window"))?;
        let counters = stream
            .alloc_zeros::<u64>(SHOT_COUNTERS + ALL_TO_ALL_COUNTERS)
            .map_err(|e| cuda::err("cuMemAlloc", e))?;
        stream.synchronize().map_err(|e| cuda::err("cuStreamSynchronize", e))?;
        let module = crate::device::library(b.ordinal)?;
        let load = |name: String| {
            module
                .load_function(&name)
                .map_err(|e| cuda::err(&format!("cuModuleGetFunction({name})"), e))
        };
        let (mut one_shot, mut two_shot, mut reduce_scatter) = (HashMap::new(), HashMap::new(), HashMap::new());
        let mut multimem = HashMap::new();
        for d in [DType::F32, DType::F16, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg] {
                let Some(s) = suffix(d, op) else { continue };
                one_shot.insert(s, load(format!("ferrocomm_allreduce_oneshot_{s}"))?);
                two_shot.insert(s, load(format!("ferrocomm_allreduce_twoshot_{s}"))?);
                reduce_scatter.insert(s, load(format!("ferrocomm_reducescatter_oneshot_{s}"))?);
                if multimem_suffix(d, op).is_some() {
                    multimem.insert(s, load(format!("ferrocomm_allreduce_multimem_{s}"))?);
                }
            }
        }
        let multicast = window.device().is_some_and(|(h, _)| h.multicast != 0);
        Ok(OwnCollectives {
            window,
            order: CallOrder::new()?,
            counters,
            one_shot,
            two_shot,
            multimem,
            multicast,
            reduce_scatter,
            all_gather: load("ferrocomm_allgather_oneshot".into())?,
            all_to_all: load("ferrocomm_alltoall".into())?,
            max_bytes,
            two_shot_min,
            size: b.size,
        })
    }

    /// The algorithm and its kernel name suffix for an all_reduce of `bytes` of `dtype`.
    fn all_reduce_algo(
        &self,
        bytes: usize,
        dtype: DType,
        op: ReduceOp,
        hints: &BTreeMap<String, String>,
    ) -> Result<AllReduceAlgo> {
        let switch_reduces = self.multicast && multimem_suffix(dtype, op).is_some();
        Ok(match hints.get("algorithm").map(String::as_str) {
            Some("oneshot") => AllReduceAlgo::OneShot,
            Some("twoshot") => AllReduceAlgo::TwoShot,
            Some("multimem") if switch_reduces => AllReduceAlgo::Multimem,
            Some("multimem") if !self.multicast => {
                return Err(Error::invalid(
                    "all_reduce",
                    "hint algorithm=\"multimem\": this communicator's windows have no multicast object (that needs \
                     every rank on a GPU of its own that supports multicast; FERROCOMM_LOG=debug says why not)",
                ))
            }
            Some("multimem") => {
                return Err(Error::invalid(
                    "all_reduce",
                    format!("hint algorithm=\"multimem\": the switch does not reduce {dtype:?} with {op}"),
                ))
            }
            Some(other) => {
                return Err(Error::invalid(
                    "all_reduce",
                    format!(
                        "hint algorithm={other:?}: the device backend has \"oneshot\", \"twoshot\" and \"multimem\""
                    ),
                ))
            }
            None if bytes >= self.two_shot_min && switch_reduces => AllReduceAlgo::Multimem,
            None if bytes >= self.two_shot_min => AllReduceAlgo::TwoShot,
            None => AllReduceAlgo::OneShot,
        })
    }

    /// The kernel for `op` and its launch, if one here runs it (see the module doc).
    fn plan(&self, op: &Op<'_>, hints: &BTreeMap<String, String>) -> Result<Option<(&CudaFunction, Launch)>> {
        let few_ranks = self.size <= MAX_RANKS;
        let plan = match op {
            Op::AllReduce { buf, op } => {
                let (Some(d), Some(s)) = (buf.device_bytes(), suffix(buf.dtype(), *op)) else {
                    return Ok(None);
                };
                let kernels = match self.all_reduce_algo(d.len, buf.dtype(), *op, hints)? {
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
                let (Some(i), Some(parts)) = (input.device_bytes(), parts_mut(outputs)) else {
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
                    (output.device_bytes(), parts(inputs), suffix(output.dtype(), *op))
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
                let (Some(send), Some(recv)) = (parts(inputs), parts_mut(outputs)) else {
                    return Ok(None);
                };
                let mut a = AllToAllArgs {
                    send: send.ptr,
                    recv: recv.ptr,
                    region: self.max_bytes as u64,
                    slot: ((self.max_bytes / self.size.max(1)) & !15) as u64,
                    ..Default::default()
                };
                for (r, (i, o)) in inputs.iter().zip(outputs).enumerate() {
                    a.send_len[r] = i.byte_len() as u64;
                    a.recv_len[r] = o.byte_len() as u64;
                }
                // A slot must carry its headers and some payload.
                let usable = a.slot as usize > SLOT_HEADER_BYTES + 16;
                let bytes = inputs.iter().map(Buf::byte_len).sum::<usize>();
                (few_ranks && usable).then(|| (&self.all_to_all, Launch::all_to_all(bytes, a)))
            }
            _ => None,
        };
        Ok(plan)
    }

    /// Whether a kernel here runs `op` (an unknown hint counts as no).
    pub(crate) fn supports(&self, op: &Op<'_>, hints: &BTreeMap<String, String>) -> bool {
        self.plan(op, hints).is_ok_and(|p| p.is_some())
    }

    /// Enqueues `op` on `stream`; `supports(op)` must hold.
    pub(crate) fn run(
        &self,
        op: &Op<'_>,
        hints: &BTreeMap<String, String>,
        stream: u64,
        timeout: Duration,
    ) -> Result<()> {
        let name = op.name();
        // A kernel of an earlier call that gave up: report it (and start clean).
        self.window.take_status(name, timeout)?;
        let (f, launch) = self
            .plan(op, hints)?
            .ok_or_else(|| Error::invalid(name, "no device kernel for this operation"))?;
        if launch.bytes == 0 && !matches!(launch.args, Args::AllToAll(_)) {
            return Ok(());
        }
        let (handle, window_stream) = self
            .window
            .device()
            .ok_or_else(|| Error::invalid(name, "no device window"))?;
        let (counters, _sync) = self.counters.device_ptr(&window_stream);
        self.order.run(stream, || {
            self.enqueue(f, launch, handle, counters, cuda::stream::raw(stream))
        })
    }

    /// Puts the kernel launches of one call on `stream`.
    fn enqueue(
        &self,
        f: &CudaFunction,
        launch: Launch,
        handle: crate::device::WindowHandle,
        counters: u64,
        stream: sys::CUstream,
    ) -> Result<()> {
        match launch.args {
            Args::AllToAll(mut a) => {
                let mut params = Params::new(handle, counters + (SHOT_COUNTERS * 8) as u64);
                // The sizes differ between ranks, so the grid is fixed.
                let blocks = MAX_BLOCKS as u32;
                params.launch(f, blocks, &[(&mut *a as *mut AllToAllArgs).cast()], &[], stream)
            }
            // Messages larger than the window's region run as consecutive launches, one per
            // chunk (the same cut on every rank: it depends on the counts and the region).
            Args::Shot {
                input,
                output,
                n,
                mut vectors,
            } => {
                for (offset, mut count) in chunks(n, launch.unit, launch.chunk) {
                    let (mut input, mut output) = (input.offset(offset, self.size), output.offset(offset, self.size));
                    let mut params = Params::new(handle, counters);
                    let args = [input.as_param(), output.as_param(), (&mut count as *mut u64).cast()];
                    let blocks = Launch::blocks(count as usize * launch.unit);
                    params.launch(f, blocks, &args, &[(&mut vectors as *mut u32).cast()], stream)?;
                }
                Ok(())
            }
        }
    }

    /// Reports a kernel's recorded failure.
    pub(crate) fn check(&self, op: &'static str, timeout: Duration) -> Result<()> {
        self.window.take_status(op, timeout)
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

    /// What cuLaunchKernel reads the parameter's value from.
    fn as_param(&mut self) -> *mut c_void {
        match self {
            Param::Ptr(p) => (p as *mut u64).cast(),
            Param::Table(t) => (&mut **t as *mut Parts).cast(),
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

/// The parameters every collective kernel shares: the window handle first, the counters last
/// (kernels/*.cu), with the kernel's own arguments between them.
struct Params {
    handle: crate::device::WindowHandle,
    counters: u64,
}

impl Params {
    fn new(handle: crate::device::WindowHandle, counters: u64) -> Params {
        Params { handle, counters }
    }

    /// Launches `f` with the parameters (handle, `args`..., counters, `trailing`...).
    fn launch(
        &mut self,
        f: &CudaFunction,
        blocks: u32,
        args: &[*mut c_void],
        trailing: &[*mut c_void],
        stream: sys::CUstream,
    ) -> Result<()> {
        let mut params = vec![(&mut self.handle as *mut crate::device::WindowHandle).cast::<c_void>()];
        params.extend_from_slice(args);
        params.push((&mut self.counters as *mut u64).cast());
        params.extend_from_slice(trailing);
        // SAFETY: `params` matches the kernel's parameter list (kernels/*.cu: shot kernels take
        // handle, input, output, n, counters, vectors; all_to_all takes handle, args,
        // counters) and points at values that outlive this call, which copies them.
        cuda::check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f.cu_function(),
                blocks,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
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

fn parts(bufs: &[Buf<'_>]) -> Option<Parts> {
    table(bufs.iter().map(Buf::device_bytes))
}

fn parts_mut(bufs: &[BufMut<'_>]) -> Option<Parts> {
    table(bufs.iter().map(BufMut::device_bytes))
}

fn aligned(p: &Parts) -> bool {
    p.ptr.iter().all(|a| a % 16 == 0)
}

#[cfg(test)]
mod tests {
    use super::chunks;

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
