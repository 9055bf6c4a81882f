//! The device backend's own collective kernels (kernels/oneshot.cu) on device buffers.
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
use crate::ops::Op;
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
    /// Kernel per (dtype, reduce op) name suffix, e.g. `bf16_sum`.
    all_reduce: HashMap<&'static str, CudaFunction>,
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
        let mut all_reduce = HashMap::new();
        for d in [DType::F32, DType::F16, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg] {
                let Some(s) = suffix(d, op) else { continue };
                let name = format!("ferrocomm_allreduce_oneshot_{s}");
                let f = module
                    .load_function(&name)
                    .map_err(|e| cuda::err(&format!("cuModuleGetFunction({name})"), e))?;
                all_reduce.insert(s, f);
            }
        }
        Ok(OwnCollectives {
            window,
            counters,
            all_reduce,
            max_bytes,
        })
    }

    /// Whether a kernel here runs `op`.
    pub(crate) fn supports(&self, op: &Op<'_>) -> bool {
        match op {
            Op::AllReduce { buf, op } => suffix(buf.dtype(), *op).is_some() && buf.byte_len() <= self.max_bytes,
            _ => false,
        }
    }

    /// Enqueues `op` on `stream`; `supports(op)` must hold.
    pub(crate) fn run(&self, op: &Op<'_>, stream: u64, timeout: Duration) -> Result<()> {
        let name = op.name();
        // A kernel of an earlier call that gave up: report it (and start clean).
        self.window.take_status(name, timeout)?;
        let Op::AllReduce { buf, op } = op else {
            return Err(Error::invalid(name, "no device kernel for this operation"));
        };
        let f = suffix(buf.dtype(), *op)
            .and_then(|s| self.all_reduce.get(s))
            .ok_or_else(|| Error::invalid(name, "no device kernel for this dtype and reduce op"))?;
        let Some(data) = buf.device_bytes() else {
            return Err(Error::invalid(name, "device kernels take device buffers"));
        };
        if data.len == 0 {
            return Ok(());
        }
        let (mut handle, window_stream) = self
            .window
            .device()
            .ok_or_else(|| Error::invalid(name, "no device window"))?;
        let (counters, _sync) = self.counters.device_ptr(&window_stream);
        let (mut ptr, mut n, mut counters) = (data.ptr, buf.count() as u64, counters);
        let mut vectors = u32::from(data.ptr % 16 == 0);
        let blocks = data.len.div_ceil(BYTES_PER_BLOCK).clamp(1, MAX_BLOCKS) as u32;
        // In place: the same pointer is the input and the output.
        let mut out = ptr;
        let mut params: [*mut c_void; 6] = [
            (&mut handle as *mut crate::device::WindowHandle).cast(),
            (&mut ptr as *mut u64).cast(),
            (&mut out as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut counters as *mut u64).cast(),
            (&mut vectors as *mut u32).cast(),
        ];
        // SAFETY: the parameters match the kernel's (handle by value, two device pointers, the
        // count, the counters, the vector flag) and outlive the launch call, which copies them.
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
