//! `device_all_reduce`: the device backend's own all_reduce kernels with `--world` ranks
//! (default 8) on GPU 0 in this process, bf16 sum, each rank replaying a CUDA graph of one
//! call; against NCCL's all_reduce at world size 1 on the same GPU, also replayed from a graph,
//! in the same run. A rank's time per call is its replay loop's wall time over the replays;
//! the slowest rank's is reported. The algorithm is the backend's choice by size, or the hint
//! given by FERROCOMM_BENCH_ALGORITHM (`oneshot` / `twoshot` / `multimem`).

use crate::args::Args;
use crate::nccl_direct::{Direct, NCCL_BFLOAT16};
use ferrocomm::device::cudarc::driver::{sys, CudaGraph, CudaStream, DevicePtr};
use ferrocomm::device::{self, DeviceSliceMut};
use ferrocomm::prelude::*;
use ferrocomm::{bf16, Error, Result};
use std::sync::{Arc, Barrier};
use std::time::Instant;

fn cuda(call: &'static str) -> impl Fn(ferrocomm::device::cudarc::driver::DriverError) -> Error {
    move |e| Error::Backend {
        backend: "cuda".into(),
        call: call.into(),
        message: format!("{e:?}"),
    }
}

/// Captures what `enqueue` puts on `s` into a graph.
fn capture(s: &Arc<CudaStream>, enqueue: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(cuda("cuStreamBeginCapture"))?;
    let r = enqueue();
    let g = s
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(cuda("cuStreamEndCapture"))?;
    r?;
    g.ok_or_else(|| Error::Config("the capture recorded nothing".into()))
}

/// Microseconds per replay of `g` over `iters` replays, after `warmup`.
fn time_replays(g: &CudaGraph, s: &CudaStream, a: &Args, start: Option<&Barrier>) -> Result<f64> {
    for _ in 0..a.warmup {
        g.launch().map_err(cuda("cuGraphLaunch"))?;
    }
    s.synchronize().map_err(cuda("cuStreamSynchronize"))?;
    if let Some(b) = start {
        b.wait();
    }
    let t0 = Instant::now();
    for _ in 0..a.iters {
        g.launch().map_err(cuda("cuGraphLaunch"))?;
    }
    s.synchronize().map_err(cuda("cuStreamSynchronize"))?;
    Ok(t0.elapsed().as_secs_f64() * 1e6 / a.iters as f64)
}

/// The slowest rank's microseconds per call at `bytes`.
fn ours(comms: &[Comm], bytes: usize, a: &Args) -> Result<f64> {
    let opts = match std::env::var("FERROCOMM_BENCH_ALGORITHM") {
        Ok(v) => OpOptions::new().hint("algorithm", v),
        Err(_) => OpOptions::new(),
    };
    let start = Barrier::new(comms.len());
    let times: Vec<Result<f64>> = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let (opts, start) = (opts.clone(), &start);
                sc.spawn(move || -> Result<f64> {
                    // Not CudaContext::new(0)?.new_stream(): its first stream synchronizes the
                    // GPU, which would wait for ranks already in their kernels.
                    let s = device::new_stream(0)?;
                    let _current = device::use_stream(&s);
                    let count = bytes / 2;
                    let buf = s.alloc_zeros::<u16>(count).map_err(cuda("cuMemAlloc"))?;
                    let (ptr, _sync) = buf.device_ptr(&s);
                    let g = capture(&s, || {
                        // SAFETY: `buf` holds `count` 16-bit elements (bf16 bits) on GPU 0 and outlives the graph.
                        let view = unsafe { DeviceSliceMut::<bf16>::from_raw(0, ptr, count) }?;
                        c.with_options(opts).all_reduce(view, ReduceOp::Sum).map(drop)
                    })?;
                    let t = time_replays(&g, &s, a, Some(start));
                    drop(g);
                    t
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a bench rank panicked"))
            .collect()
    });
    let mut worst = 0f64;
    for t in times {
        worst = worst.max(t?);
    }
    Ok(worst)
}

/// NCCL at world size 1 on GPU 0, bf16 sum in place, replayed from a graph.
fn nccl(direct: &Direct, bytes: usize, a: &Args) -> Result<f64> {
    let s = device::new_stream(0)?;
    let buf = s.alloc_zeros::<u16>(bytes / 2).map_err(cuda("cuMemAlloc"))?;
    let (ptr, _sync) = buf.device_ptr(&s);
    let g = capture(&s, || direct.all_reduce(ptr, bytes / 2, NCCL_BFLOAT16, &s))?;
    time_replays(&g, &s, a, None)
}

pub fn run(a: &Args) -> Result<()> {
    device::available(0)?;
    let world = a.world.max(2);
    let comms = Comm::new_group(
        "device",
        &vec![Device::Cuda(0); world],
        "bench-device-coll",
        CommOptions::from_env()?,
    )?;
    // NCCL is optional: without it the column says why.
    let direct = Direct::new().map_err(|e| e.to_string());
    println!(
        "# ferrocomm-bench device_all_reduce: bf16 sum, {world} ranks on GPU 0 (device backend, graph replay), \
         {} replays; NCCL world 1 on GPU 0 (graph replay){}",
        a.iters,
        direct
            .as_ref()
            .err()
            .map_or(String::new(), |e| format!(": unavailable ({e})"))
    );
    println!(
        "#{:>11} {:>16} {:>14} {:>10}",
        "size(B)", "ferrocomm(us)", "nccl w1(us)", "ours/nccl"
    );
    let mut bytes = a.min_bytes.max(2) & !1;
    while bytes <= a.max_bytes {
        let t = ours(&comms, bytes, a)?;
        let n = match &direct {
            Ok(d) => Some(nccl(d, bytes, a)?),
            Err(_) => None,
        };
        println!(
            "{:>12} {:>16.2} {:>14} {:>10}",
            bytes,
            t,
            n.map_or("-".into(), |n| format!("{n:.2}")),
            n.map_or("-".into(), |n| format!("{:.2}", t / n))
        );
        bytes *= a.factor;
    }
    for c in &comms {
        c.finalize()?;
    }
    Ok(())
}
