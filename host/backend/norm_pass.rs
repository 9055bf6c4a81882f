//! The fused norm unfused (`Op::AllReduceRmsNorm` as separate steps, kernels/norm_pass.cu):
//! widen `x` to f32 into a scratch buffer, all_reduce the scratch (the caller's route: NCCL,
//! the own kernels or the CPU engine), then one kernel adds the residual and normalises each
//! row. It is the NCCL fallback where the fused kernels cannot run (ranks on several hosts; the
//! `nccl` backend), the hint `algorithm` = `unfused` (the baseline the fused kernels are
//! measured against), and runs on the host device like every kernel.
//!
//! Every rank gets the same bits when the all_reduce gives every rank the same sum (NCCL's and
//! ferrocomm's do); they are the fused kernels' and the CPU engine's bits when it sums in rank
//! order in f32 (ferrocomm's kernels and the CPU engine do, NCCL does not promise an order).
//! On a GPU the scratch is stream-ordered memory (cuMemAllocAsync on the issuing stream, freed
//! the same way), so nothing waits on the host and a CUDA graph can capture the call.

use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::{Error, Result};
use crate::contracts::inference::RmsNormFusion;
use crate::contracts::ops::{BufMut, DeviceBytes, Op};
use crate::gpu::cuda;
use crate::gpu::kernels::{self, reach, reach_mut, Function, PassArgs, Queue, COLLECTIVE_THREADS, MAX_BLOCKS};
use crate::gpu::target::{Gpu, Stream};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::time::Duration;

const OP: &str = "all_reduce_residual_rmsnorm";

/// The norm pass's kernels on one device.
pub(crate) struct NormPass {
    gpu: Gpu,
    /// The widening copy per activation dtype.
    widen: HashMap<DType, Function>,
    /// The residual + norm kernel per (activation dtype, fp8 out).
    norm: HashMap<(DType, bool), Function>,
    /// The host device runs the kernels on a stream of its own and waits for them.
    host_stream: Option<Stream>,
}

impl NormPass {
    pub(crate) fn load(gpu: Gpu) -> Result<NormPass> {
        let (mut widen, mut norm) = (HashMap::new(), HashMap::new());
        for (d, fp8, s) in kernels::NORM_SUFFIXES {
            if !fp8 {
                widen.insert(d, gpu.function(&format!("{}{s}", kernels::WIDEN.name))?);
            }
            norm.insert(
                (d, fp8),
                gpu.function(&format!("{}{s}", kernels::RESIDUAL_RMSNORM.name))?,
            );
        }
        let host_stream = (gpu == Gpu::Host).then(|| gpu.stream()).transpose()?;
        Ok(NormPass {
            gpu,
            widen,
            norm,
            host_stream,
        })
    }

    /// Runs `f` on `stream` (a CUDA stream; ignored on the host device, which waits for each
    /// step): widen, `all_reduce` (an `Op::AllReduce` sum of the f32 scratch, which it must
    /// enqueue on `stream` and run to the same sum on every rank), residual + norm.
    pub(crate) fn run(
        &self,
        f: &mut RmsNormFusion<'_>,
        stream: u64,
        timeout: Duration,
        all_reduce: impl FnOnce(&mut Op<'_>) -> Result<()>,
    ) -> Result<()> {
        f.validate()?;
        let host_device = self.gpu == Gpu::Host;
        let unreachable = || {
            Error::invalid(
                OP,
                "the norm pass runs on device buffers (host memory on the host device)",
            )
        };
        let (d, hidden, tokens) = (f.x.dtype(), f.hidden, f.tokens());
        let x = reach(&f.x, host_device).ok_or_else(unreachable)?;
        let gamma = reach(&f.gamma, host_device).ok_or_else(unreachable)?;
        let residual = reach_mut(&mut f.residual, host_device).ok_or_else(unreachable)?;
        let out = reach_mut(&mut f.out, host_device).ok_or_else(unreachable)?;
        let scales = match f.scales.as_mut() {
            Some(s) => reach_mut(s, host_device).ok_or_else(unreachable)?.ptr,
            None => 0,
        };
        let widen = self
            .widen
            .get(&d)
            .ok_or_else(|| Error::invalid(OP, format!("no norm pass for {d}")))?;
        let norm = &self.norm[&(d, f.quantised())];
        let n = tokens * hidden;
        if n == 0 {
            // Every rank agrees on the shape (else the all_reduce below refuses): nothing to do.
            return Ok(());
        }
        let mut scratch = Scratch::new(self.gpu, x.ordinal, n, stream)?;
        // 16-byte groups of a row: every row starts aligned where the buffers do (the scratch
        // always is).
        let group = 16 / d.size();
        let vectors = hidden % group == 0 && [residual.ptr, gamma.ptr, out.ptr].iter().all(|p| p % 16 == 0);
        let args = PassArgs {
            sum: scratch.addr(),
            residual: residual.ptr,
            gamma: gamma.ptr,
            out: out.ptr,
            scales,
            rows: tokens as u64,
            hidden: hidden as u64,
            eps: f.eps,
            vectors: vectors.into(),
        };
        let widen_blocks = n.div_ceil(COLLECTIVE_THREADS as usize).clamp(1, MAX_BLOCKS) as u32;
        let norm_blocks = tokens.clamp(1, MAX_BLOCKS) as u32;
        let queue = match &self.host_stream {
            Some(s) => s.queue(),
            None => Queue::Cuda(cuda::stream::raw(stream)),
        };
        kernels::WIDEN.launch(widen, queue, widen_blocks, (x.ptr, scratch.addr(), n as u64))?;
        self.settle(timeout)?;
        let mut sum = Op::AllReduce {
            buf: scratch.buf(),
            op: ReduceOp::Sum,
        };
        all_reduce(&mut sum)?;
        kernels::RESIDUAL_RMSNORM.launch(norm, queue, norm_blocks, (args,))?;
        self.settle(timeout)
    }

    /// On the host device: waits until the stream has run what was enqueued (the next step
    /// reads it from another stream, or the caller from the host). These kernels wait for
    /// nothing, so they end: past the timeout the wait goes on (they write the caller's
    /// buffers and the scratch, which must outlive them), and then reports the timeout.
    fn settle(&self, timeout: Duration) -> Result<()> {
        let Some(s) = &self.host_stream else { return Ok(()) };
        let first = s.wait_idle(OP, timeout);
        if matches!(first, Err(Error::Timeout { .. })) {
            while let Err(Error::Timeout { .. }) = s.wait_idle(OP, timeout) {}
        }
        first
    }
}

/// The f32 sums: stream-ordered device memory on a GPU (freed on the stream when dropped,
/// after the stream's work on it), a vector on the host device.
enum Scratch {
    Cuda {
        ordinal: usize,
        ptr: u64,
        len: usize,
        stream: u64,
    },
    Host(Vec<f32>),
}

impl Scratch {
    fn new(gpu: Gpu, ordinal: usize, n: usize, stream: u64) -> Result<Scratch> {
        match gpu {
            Gpu::Host => Ok(Scratch::Host(vec![0.0; n])),
            Gpu::Cuda(_) => {
                let mut ptr = 0;
                let len = n * 4;
                // SAFETY: `ptr` receives a new allocation of `len` bytes, ordered on `stream`.
                cuda::check("cuMemAllocAsync", unsafe {
                    sys::cuMemAllocAsync(&mut ptr, len, cuda::stream::raw(stream))
                })?;
                Ok(Scratch::Cuda {
                    ordinal,
                    ptr,
                    len,
                    stream,
                })
            }
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Scratch::Cuda { ptr, .. } => *ptr,
            Scratch::Host(v) => v.as_ptr() as u64,
        }
    }

    /// The scratch as the all_reduce's buffer: device memory, or on the host device host
    /// memory (the host device's memory, which the CPU engine also takes).
    fn buf(&mut self) -> BufMut<'_> {
        match self {
            Scratch::Cuda { ordinal, ptr, len, .. } => BufMut::device(
                DeviceBytes {
                    ordinal: *ordinal,
                    ptr: *ptr,
                    len: *len,
                },
                DType::F32,
            ),
            Scratch::Host(v) => BufMut::new(&mut v[..]),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Scratch::Cuda { ptr, stream, .. } = *self {
            // SAFETY: allocated on this stream by `new`; the stream's later work is done with it.
            let r = cuda::check("cuMemFreeAsync", unsafe {
                sys::cuMemFreeAsync(ptr, cuda::stream::raw(stream))
            });
            if let Err(e) = r {
                tracing::warn!("the norm pass's scratch was not freed: {e}");
            }
        }
    }
}
