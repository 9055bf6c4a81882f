//! The device backend's own collective kernels (kernels/oneshot.cu: all_reduce, all_gather,
//! reduce_scatter, all_to_all) on device buffers.
//!
//! Every rank of a device communicator holds one window for them, made when the communicator
//! is (so nothing is allocated during a CUDA graph capture), and a per-block epoch counter in
//! device memory that the kernels advance themselves. A call is enqueued on the issuing
//! stream and returns; a kernel that gave up waiting for a peer (timeout, abort) recorded why
//! in the window's status, which the next call (or `finalize`) reports.

use super::route::parse_bytes;
use super::window::DeviceWindow;
use super::DeviceBackend;
use crate::cuda;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::ops::{DeviceBytes, Op};
use crate::window::{WindowBackend, WindowSpec};
use cudarc::driver::{sys, CudaFunction, CudaSlice, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::time::Duration;

/// kernels/oneshot.cu's FERROCOMM_COLL_MAX_BLOCKS: blocks per launch, and half the signal ids.
const MAX_BLOCKS: usize = 16;
const THREADS: u32 = 256;
/// Bytes of one block's share before another block helps.
const BYTES_PER_BLOCK: usize = 64 << 10;

pub(crate) struct OwnCollectives {
    window: DeviceWindow,
    counters: CudaSlice<u64>,
    /// Kernels per (dtype, reduce op) name suffix, e.g. `bf16_sum`.
    all_reduce: HashMap<&'static str, CudaFunction>,
    reduce_scatter: HashMap<&'static str, CudaFunction>,
    all_gather: CudaFunction,
    all_to_all: CudaFunction,
    /// The largest message the window takes.
    max_bytes: usize,
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

impl OwnCollectives {
    /// Collective over the communicator, like any window.
    pub(crate) fn create(b: &DeviceBackend, timeout: Duration) -> Result<OwnCollectives> {
        let max_bytes = match std::env::var("FERROCOMM_DEVICE_ONESHOT_MAX") {
            Err(_) => 1 << 20,
            Ok(v) => parse_bytes(&v).ok_or_else(|| {
                Error::Config(format!("FERROCOMM_DEVICE_ONESHOT_MAX={v:?}: expected bytes such as 1M"))
            })?,
        };
        // An id no user window reaches: it only names the window's store namespace.
        let spec = WindowSpec {
            id: u64::MAX,
            bytes: max_bytes.max(16),
            signals: 2 * MAX_BLOCKS,
            registered: None,
            timeout,
        };
        let window = DeviceWindow::create(b, &spec)?;
        let (_, stream) = window
            .device()
            .ok_or_else(|| Error::invalid("device collectives", "no device window"))?;
        let counters = stream
            .alloc_zeros::<u64>(MAX_BLOCKS)
            .map_err(|e| cuda::err("cuMemAlloc", e))?;
        stream.synchronize().map_err(|e| cuda::err("cuStreamSynchronize", e))?;
        let module = crate::device::library(b.ordinal)?;
        let load = |name: String| {
            module
                .load_function(&name)
                .map_err(|e| cuda::err(&format!("cuModuleGetFunction({name})"), e))
        };
        let (mut all_reduce, mut reduce_scatter) = (HashMap::new(), HashMap::new());
        for d in [DType::F32, DType::F16, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg] {
                let Some(s) = suffix(d, op) else { continue };
                all_reduce.insert(s, load(format!("ferrocomm_allreduce_oneshot_{s}"))?);
                reduce_scatter.insert(s, load(format!("ferrocomm_reducescatter_oneshot_{s}"))?);
            }
        }
        let all_gather = load("ferrocomm_allgather_oneshot".into())?;
        let all_to_all = load("ferrocomm_alltoall_oneshot".into())?;
        Ok(OwnCollectives {
            window,
            counters,
            all_reduce,
            reduce_scatter,
            all_gather,
            all_to_all,
            max_bytes,
        })
    }

    /// The kernel for `op` and its arguments (input, output, count, per-rank bytes), if one
    /// here runs it: all_reduce, and all_gather / reduce_scatter / all_to_all with equal,
    /// back-to-back parts, whose per-rank data fit the window.
    fn plan(&self, op: &Op<'_>) -> Option<(&CudaFunction, Launch)> {
        let fits = |bytes: usize| bytes <= self.max_bytes;
        match op {
            Op::AllReduce { buf, op } => {
                let d = buf.device_bytes()?;
                let f = self.all_reduce.get(suffix(buf.dtype(), *op)?)?;
                // One block per rank: only the pointers need 16-byte alignment for vectors.
                fits(d.len).then_some((f, Launch::new(d.ptr, d.ptr, buf.count(), d.len, false)))
            }
            Op::AllGather { input, outputs } => {
                let i = input.device_bytes()?;
                let out = back_to_back(outputs.iter().map(|o| o.device_bytes()), i.len)?;
                fits(i.len).then_some((&self.all_gather, Launch::new(i.ptr, out, i.len, i.len, true)))
            }
            Op::ReduceScatter { inputs, output, op } => {
                let o = output.device_bytes()?;
                let f = self.reduce_scatter.get(suffix(output.dtype(), *op)?)?;
                let input = back_to_back(inputs.iter().map(|i| i.device_bytes()), o.len)?;
                // Our segment holds every block of our input.
                let whole = o.len.checked_mul(inputs.len())?;
                fits(whole).then_some((f, Launch::new(input, o.ptr, output.count(), o.len, true)))
            }
            Op::AllToAll { inputs, outputs } => {
                let len = outputs.first()?.byte_len();
                let input = back_to_back(inputs.iter().map(|i| i.device_bytes()), len)?;
                let output = back_to_back(outputs.iter().map(|o| o.device_bytes()), len)?;
                // Our segment holds every block of our input.
                let whole = len.checked_mul(inputs.len())?;
                fits(whole).then_some((&self.all_to_all, Launch::new(input, output, len, len, true)))
            }
            _ => None,
        }
    }

    /// Whether a kernel here runs `op`.
    pub(crate) fn supports(&self, op: &Op<'_>) -> bool {
        self.plan(op).is_some()
    }

    /// Enqueues `op` on `stream`; `supports(op)` must hold.
    pub(crate) fn run(&self, op: &Op<'_>, stream: u64, timeout: Duration) -> Result<()> {
        let name = op.name();
        // A kernel of an earlier call that gave up: report it (and start clean).
        self.window.take_status(name, timeout)?;
        let (f, launch) = self
            .plan(op)
            .ok_or_else(|| Error::invalid(name, "no device kernel for this operation"))?;
        if launch.bytes == 0 {
            return Ok(());
        }
        let (mut handle, window_stream) = self
            .window
            .device()
            .ok_or_else(|| Error::invalid(name, "no device window"))?;
        let (counters, _sync) = self.counters.device_ptr(&window_stream);
        let (mut input, mut output, mut count, mut counters) = (launch.input, launch.output, launch.count, counters);
        let mut vectors = u32::from(launch.vectors);
        let blocks = launch.bytes.div_ceil(BYTES_PER_BLOCK).clamp(1, MAX_BLOCKS) as u32;
        let mut params: [*mut c_void; 6] = [
            (&mut handle as *mut crate::device::WindowHandle).cast(),
            (&mut input as *mut u64).cast(),
            (&mut output as *mut u64).cast(),
            (&mut count as *mut u64).cast(),
            (&mut counters as *mut u64).cast(),
            (&mut vectors as *mut u32).cast(),
        ];
        // SAFETY: the parameters match every one-shot kernel's (handle by value, input and
        // output device pointers, the count, the counters, the vector flag) and outlive the
        // launch call, which copies them.
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
                cuda::stream::raw(stream),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Reports a kernel's recorded failure.
    pub(crate) fn check(&self, op: &'static str, timeout: Duration) -> Result<()> {
        self.window.take_status(op, timeout)
    }
}

/// What one launch of a one-shot kernel takes.
struct Launch {
    input: u64,
    output: u64,
    /// Elements (bytes for all_gather).
    count: u64,
    /// This rank's bytes: the grid is sized by them.
    bytes: usize,
    /// 16-byte accesses: both pointers aligned, and, where the kernel addresses one block per
    /// rank (`per_rank_blocks`), every block a multiple of 16 bytes.
    vectors: bool,
}

impl Launch {
    fn new(input: u64, output: u64, count: usize, bytes: usize, per_rank_blocks: bool) -> Launch {
        Launch {
            input,
            output,
            count: count as u64,
            bytes,
            vectors: input % 16 == 0 && output % 16 == 0 && (!per_rank_blocks || bytes % 16 == 0),
        }
    }
}

/// The start of `parts` when they are equal blocks of `len` bytes laid out back to back.
fn back_to_back(parts: impl Iterator<Item = Option<DeviceBytes>>, len: usize) -> Option<u64> {
    let mut start = None;
    for (r, p) in parts.enumerate() {
        let p = p?;
        let first = *start.get_or_insert(p.ptr);
        if p.len != len || p.ptr != first + (r * len) as u64 {
            return None;
        }
    }
    start
}
