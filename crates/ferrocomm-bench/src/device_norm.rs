//! `device_rmsnorm`: the fused all_reduce + residual + RMSNorm on device buffers, `--world`
//! ranks (default 2) on GPU 0 in this process (device backend), each rank replaying a CUDA
//! graph of one call, against the same steps apart:
//!
//! - fused: the fused kernels (kernels/fused_norm.cu; one- or two-shot by size, or `--algo`);
//! - apart: the hint `unfused` with `route` = `device`: widen x to f32, the own all_reduce
//!   kernels, then the residual + norm kernel (kernels/norm_pass.cu);
//! - NCCL: the `nccl` backend at world size 1 on the same GPU (NCCL refuses two ranks on one
//!   GPU): widen, ncclAllReduce, the same norm kernel.
//!
//! A rank's time per call is its replay loop's wall time over the replays; the slowest rank's
//! is reported. The replays keep adding the all-reduced x to the residual, which only grows the
//! values. `--check` runs one call of each of the first two on fresh inputs and counts the
//! elements of rank 0's residual and out whose bits differ (the steps apart sum in the same
//! order as the fused kernels, so none should).

use crate::cli::{Args, DType, Inference, RmsNormOpts};
use crate::device_coll::{capture, cuda, on_ranks, time_replays};
use crate::inference::Act;
use crate::progress::Progress;
use ferrocomm::device::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use ferrocomm::device::{self, DeviceSlice, DeviceSliceMut};
use ferrocomm::prelude::*;
use ferrocomm::{bf16, f16, Error, Result, F8E4M3};
use std::sync::{Arc, Barrier};

/// Runs `device_rmsnorm` on GPU 0 and prints its table.
pub fn run(a: &Args) -> Result<()> {
    let Some(Inference::RmsNorm(o)) = a.inference.as_deref() else {
        return Err(Error::Config("device_rmsnorm needs its own flags".into()));
    };
    match a.dtype {
        DType::F32 => sweep::<f32>(a, o),
        DType::F16 => sweep::<f16>(a, o),
        DType::Bf16 => sweep::<bf16>(a, o),
        other => Err(Error::Config(format!(
            "device_rmsnorm takes -d f32, f16 or bf16, not {}",
            other.name()
        ))),
    }
}

fn sweep<T: Act>(a: &Args, o: &RmsNormOpts) -> Result<()> {
    device::available(0)?;
    let world = a.world.max(2);
    let comms = Comm::new_group(
        "device",
        &vec![Device::Cuda(0); world],
        "bench-device-norm",
        CommOptions::from_env()?,
    )?;
    // NCCL is optional: without it the column says why.
    let nccl = Comm::new_group("nccl", &[Device::Cuda(0)], "bench-nccl-norm", CommOptions::from_env()?)
        .map(|mut c| c.remove(0))
        .map_err(|e| e.to_string());
    let fused = match &a.algo {
        Some(name) => OpOptions::new().hint("algorithm", name),
        None => OpOptions::new(),
    };
    let apart = OpOptions::new().hint("algorithm", "unfused").hint("route", "device");
    let esize = std::mem::size_of::<T>();
    println!(
        "# ferrocomm-bench device_rmsnorm: {}, hidden {}, out {}, {world} ranks on GPU 0 (device backend, \
         graph replay, {} replays): fused kernels{} vs the steps apart (widen + own all_reduce + norm \
         kernel); NCCL world 1 on GPU 0 (nccl backend: widen + ncclAllReduce + norm kernel){}",
        a.dtype.name(),
        o.hidden,
        if o.fp8 { "fp8 e4m3" } else { a.dtype.name() },
        a.iters,
        a.algo.as_ref().map_or(String::new(), |n| format!(" ({n})")),
        nccl.as_ref()
            .err()
            .map_or(String::new(), |e| format!(": unavailable ({e})"))
    );
    println!(
        "#{:>8} {:>12} {:>10} {:>10} {:>11} {:>11} {:>12} {:>7}",
        "tokens", "size(B)", "fused(us)", "apart(us)", "apart/fused", "nccl w1(us)", "nccl/fused", "#diff"
    );
    let tokens = crate::inference::token_rows(a, o, esize);
    let progress = Progress::new(&a.op, tokens.len(), true);
    for t in tokens {
        progress.start_row(format!("{t} tokens"));
        let call = Call::<T> {
            tokens: t,
            hidden: o.hidden,
            fp8: o.fp8,
            eps: o.eps,
            _t: std::marker::PhantomData,
        };
        let f = call.time(&comms, &fused, a)?;
        let p = call.time(&comms, &apart, a)?;
        let n = match &nccl {
            Ok(c) => Some(call.time(std::slice::from_ref(c), &OpOptions::new(), a)?),
            Err(_) => None,
        };
        let diff = if a.check {
            let (x, y) = (call.once(&comms, &fused)?, call.once(&comms, &apart)?);
            x.iter().zip(&y).filter(|(u, v)| u != v).count().to_string()
        } else {
            "-".into()
        };
        progress.print_row(&format!(
            "{t:>9} {:>12} {f:>10.2} {p:>10.2} {:>11.2} {:>11} {:>12} {diff:>7}",
            t * o.hidden * esize,
            p / f,
            n.map_or("-".into(), |n| format!("{n:.2}")),
            n.map_or("-".into(), |n| format!("{:.2}", n / f)),
        ));
    }
    for c in comms.iter().chain(nccl.as_ref().ok()) {
        c.finalize()?;
    }
    Ok(())
}

/// One shape of the call.
struct Call<T> {
    tokens: usize,
    hidden: usize,
    fp8: bool,
    eps: f32,
    _t: std::marker::PhantomData<T>,
}

/// One rank's device buffers: x, residual, gamma, out and (fp8) scales, as bytes.
struct Buffers {
    x: CudaSlice<u8>,
    residual: CudaSlice<u8>,
    gamma: CudaSlice<u8>,
    out: CudaSlice<u8>,
    scales: CudaSlice<u8>,
}

fn bytes_of<T: Element>(v: &[T]) -> &[u8] {
    // SAFETY: ferrocomm's element types are plain numbers.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

impl<T: Act> Call<T> {
    /// Rank `rank`'s inputs (the same residual and gamma on every rank, as a tensor-parallel
    /// layer has them), uploaded on `s`.
    fn buffers(&self, s: &Arc<CudaStream>, rank: usize) -> Result<Buffers> {
        let n = self.tokens * self.hidden;
        let value = |i: usize, salt: usize| T::from_f32(((i * 7919 + salt * 104_729) % 2001) as f32 / 1000.0 - 1.0);
        let x: Vec<T> = (0..n).map(|i| value(i, rank + 1)).collect();
        let residual: Vec<T> = (0..n).map(|i| value(i, 0)).collect();
        let gamma: Vec<T> = (0..self.hidden).map(|i| value(i, 99)).collect();
        let out_bytes = n * if self.fp8 { 1 } else { std::mem::size_of::<T>() };
        let up = |b: &[u8]| s.clone_htod(b).map_err(cuda("cuMemcpyHtoD"));
        Ok(Buffers {
            x: up(bytes_of(&x))?,
            residual: up(bytes_of(&residual))?,
            gamma: up(bytes_of(&gamma))?,
            out: up(&vec![0u8; out_bytes])?,
            scales: up(&vec![0u8; 4 * self.tokens.max(1)])?,
        })
    }

    /// Enqueues one call of `c` on the buffers.
    fn enqueue(&self, c: &Comm, opts: &OpOptions, b: &Buffers, s: &Arc<CudaStream>) -> Result<()> {
        let n = self.tokens * self.hidden;
        let ptr = |m: &CudaSlice<u8>| m.device_ptr(s).0;
        // SAFETY: each buffer holds the elements named here on GPU 0 and outlives the call
        // (and every graph replay of it: the caller keeps them).
        let (x, residual, gamma) = unsafe {
            (
                DeviceSlice::<T>::from_raw(0, ptr(&b.x), n)?,
                DeviceSliceMut::<T>::from_raw(0, ptr(&b.residual), n)?,
                DeviceSlice::<T>::from_raw(0, ptr(&b.gamma), self.hidden)?,
            )
        };
        let c = c.with_options(opts.clone());
        if self.fp8 {
            // SAFETY: as above.
            let (out, scales) = unsafe {
                (
                    DeviceSliceMut::<F8E4M3>::from_raw(0, ptr(&b.out), n)?,
                    DeviceSliceMut::<f32>::from_raw(0, ptr(&b.scales), self.tokens)?,
                )
            };
            c.all_reduce_residual_rmsnorm_fp8(x, residual, gamma, out, scales, self.eps)
                .map(drop)
        } else {
            // SAFETY: as above.
            let out = unsafe { DeviceSliceMut::<T>::from_raw(0, ptr(&b.out), n)? };
            c.all_reduce_residual_rmsnorm(x, residual, gamma, out, self.eps)
                .map(drop)
        }
    }

    /// The slowest rank's microseconds per call with `opts`, replayed from graphs.
    fn time(&self, comms: &[Comm], opts: &OpOptions, a: &Args) -> Result<f64> {
        let start = Barrier::new(comms.len());
        let times: Vec<Result<f64>> = on_ranks(comms, |c, s| {
            let b = self.buffers(s, c.rank())?;
            let g = capture(s, || self.enqueue(c, opts, &b, s))?;
            let t = time_replays(&g, s, a, Some(&start));
            drop(g);
            t
        });
        times.into_iter().try_fold(0f64, |worst, t| Ok(worst.max(t?)))
    }

    /// Rank 0's residual, out and scales after one call with `opts` on fresh inputs.
    fn once(&self, comms: &[Comm], opts: &OpOptions) -> Result<Vec<u8>> {
        let mut got = on_ranks(comms, |c, s| {
            let b = self.buffers(s, c.rank())?;
            self.enqueue(c, opts, &b, s)?;
            let down = |m: &CudaSlice<u8>| s.clone_dtoh(m).map_err(cuda("cuMemcpyDtoH"));
            let mut all = down(&b.residual)?;
            all.extend(down(&b.out)?);
            all.extend(down(&b.scales)?);
            s.synchronize().map_err(cuda("cuStreamSynchronize"))?;
            Ok(all)
        });
        got.swap_remove(0)
    }
}
