//! `device_all_reduce`: the device backend's own all_reduce kernels with `--world` ranks
//! (default 8) on GPU 0 in this process, bf16 sum, each rank replaying a CUDA graph of one
//! call; in the same run, NCCL's all_reduce at world size 1 on the same GPU and a
//! cuMemcpyDtoDAsync of the message, both also replayed from graphs. A rank's time per call is
//! its replay loop's wall time over the replays; the slowest rank's is reported. Each row
//! times the one- and the two-shot kernel (or only the algorithm `--algo` names).
//!
//! The roofline columns divide the memory bandwidth an algorithm reaches by the copy's: the
//! algorithm's bytes are the reads and writes its kernels make (`bytes_moved`), summed over the
//! ranks, since all of them share this GPU's memory; the copy's are its read and its write.
//! Caches may serve some of the algorithm's reads of small messages, so the ratio means most
//! where the ranks' buffers are far larger than the L2 (from 64 MiB).

use crate::cli::Args;
use crate::nccl_direct::{Direct, NCCL_BFLOAT16};
use crate::progress::Progress;
use ferrocomm::device::cudarc::driver::{sys, CudaGraph, CudaStream, DevicePtr, DevicePtrMut};
use ferrocomm::device::{self, DeviceSliceMut};
use ferrocomm::prelude::*;
use ferrocomm::{bf16, Error, Result};
use std::sync::{Arc, Barrier};
use std::time::Instant;

pub(crate) fn cuda(call: &'static str) -> impl Fn(ferrocomm::device::cudarc::driver::DriverError) -> Error {
    move |e| Error::Backend {
        backend: "cuda".into(),
        call: call.into(),
        message: format!("{e:?}"),
    }
}

/// Captures what `enqueue` puts on `s` into a graph.
pub(crate) fn capture(s: &Arc<CudaStream>, enqueue: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
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
pub(crate) fn time_replays(g: &CudaGraph, s: &CudaStream, a: &Args, start: Option<&Barrier>) -> Result<f64> {
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

/// The slowest rank's microseconds per call of `algorithm` at `bytes`.
fn ours(comms: &[Comm], bytes: usize, algorithm: &str, a: &Args) -> Result<f64> {
    let opts = OpOptions::new().hint("algorithm", algorithm);
    let start = Barrier::new(comms.len());
    let times = on_ranks(comms, |c, s| {
        let count = bytes / 2;
        let buf = s.alloc_zeros::<u16>(count).map_err(cuda("cuMemAlloc"))?;
        let (ptr, _sync) = buf.device_ptr(s);
        let g = capture(s, || {
            // SAFETY: `buf` holds `count` 16-bit elements (bf16 bits) on GPU 0 and outlives the graph.
            let view = unsafe { DeviceSliceMut::<bf16>::from_raw(0, ptr, count) }?;
            c.with_options(opts.clone()).all_reduce(view, ReduceOp::Sum).map(drop)
        })?;
        let t = time_replays(&g, s, a, Some(&start));
        drop(g);
        t
    });
    times.into_iter().try_fold(0f64, |worst, t| Ok(worst.max(t?)))
}

/// `f` on every rank of `comms` at once, each on a thread with a stream of its own (current
/// on that thread).
pub(crate) fn on_ranks<R: Send>(
    comms: &[Comm],
    f: impl Fn(&Comm, &Arc<CudaStream>) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let f = &f;
                sc.spawn(move || {
                    // Not CudaContext::new(0)?.new_stream(): its first stream synchronizes the
                    // GPU, which would wait for ranks already in their kernels.
                    let s = device::new_stream(0)?;
                    let _current = device::use_stream(&s);
                    f(c, &s)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Config("a bench rank panicked".into())))
            })
            .collect()
    })
}

/// NCCL at world size 1 on GPU 0, bf16 sum in place, replayed from a graph.
fn nccl(direct: &Direct, bytes: usize, a: &Args) -> Result<f64> {
    let s = device::new_stream(0)?;
    let buf = s.alloc_zeros::<u16>(bytes / 2).map_err(cuda("cuMemAlloc"))?;
    let (ptr, _sync) = buf.device_ptr(&s);
    let g = capture(&s, || direct.all_reduce(ptr, bytes / 2, NCCL_BFLOAT16, &s))?;
    time_replays(&g, &s, a, None)
}

/// Microseconds per cuMemcpyDtoDAsync of `bytes` between two buffers on GPU 0, replayed
/// from a graph.
fn copy(bytes: usize, a: &Args) -> Result<f64> {
    let s = device::new_stream(0)?;
    let src = s.alloc_zeros::<u8>(bytes).map_err(cuda("cuMemAlloc"))?;
    let mut dst = s.alloc_zeros::<u8>(bytes).map_err(cuda("cuMemAlloc"))?;
    let (from, _r) = src.device_ptr(&s);
    let (to, _w) = dst.device_ptr_mut(&s);
    let g = capture(&s, || {
        // SAFETY: both buffers hold `bytes` on GPU 0 and outlive the graph; the stream orders
        // the copy after their allocation.
        let r = unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, bytes, s.cu_stream()) };
        r.result().map_err(cuda("cuMemcpyDtoDAsync"))
    })?;
    time_replays(&g, &s, a, None)
}

/// Bytes one rank's kernels read and write for an all_reduce of `bytes` over `world` ranks
/// (kernels/oneshot.cu, twoshot.cu); none for multimem, whose reductions happen in the switch.
fn bytes_moved(algorithm: &str, bytes: usize, world: usize) -> Option<f64> {
    let (s, n) = (bytes as f64, world as f64);
    match algorithm {
        // Copy in (read + write), read every rank's segment, write the result.
        "oneshot" => Some((n + 3.0) * s),
        // Copy in; read our slice of every segment and write it twice (the output and our
        // segment); read and write every other rank's slice: 2s + s + 2s/n + 2s(n-1)/n.
        "twoshot" => Some(5.0 * s),
        _ => None,
    }
}

/// The algorithms each row times.
fn algorithms(a: &Args) -> Vec<String> {
    match &a.algo {
        Some(one) => vec![one.clone()],
        None => vec!["oneshot".into(), "twoshot".into()],
    }
}

/// Runs `device_all_reduce` on GPU 0 and prints its table.
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
    let algos = algorithms(a);
    println!(
        "# ferrocomm-bench device_all_reduce: bf16 sum, {world} ranks on GPU 0 (device backend, graph replay), \
         {} replays; NCCL world 1 on GPU 0 (graph replay){}; copy = cuMemcpyDtoDAsync (graph replay), \
         GB/s counting its read and write; roof = the algorithm's bytes read and written by all ranks \
         per second over the copy's",
        a.iters,
        direct
            .as_ref()
            .err()
            .map_or(String::new(), |e| format!(": unavailable ({e})"))
    );
    let mut header = format!("#{:>11}", "size(B)");
    for algo in &algos {
        header += &format!(" {:>13}", format!("{algo}(us)"));
    }
    header += &format!(" {:>12} {:>10} {:>10}", "nccl w1(us)", "best/nccl", "copy GB/s");
    for algo in &algos {
        header += &format!(" {:>13}", format!("{algo} roof"));
    }
    println!("{header}");
    // bf16: whole elements.
    let sizes = crate::size::sweep(a.min_bytes.max(2) & !1, a.max_bytes, a.factor);
    let progress = Progress::new(&a.op, sizes.len(), true);
    for bytes in sizes {
        progress.start_size(bytes);
        let times = algos
            .iter()
            .map(|algo| ours(&comms, bytes, algo, a))
            .collect::<Result<Vec<f64>>>()?;
        let n = match &direct {
            Ok(d) => Some(nccl(d, bytes, a)?),
            Err(_) => None,
        };
        let copy_gbs = 2.0 * bytes as f64 / copy(bytes, a)? / 1e3;
        let best = times.iter().copied().fold(f64::INFINITY, f64::min);
        let mut row = format!("{bytes:>12}");
        for t in &times {
            row += &format!(" {t:>13.2}");
        }
        row += &format!(
            " {:>12} {:>10} {:>10.1}",
            n.map_or("-".into(), |n| format!("{n:.2}")),
            n.map_or("-".into(), |n| format!("{:.2}", best / n)),
            copy_gbs
        );
        for (algo, t) in algos.iter().zip(&times) {
            let roof = bytes_moved(algo, bytes, world).map(|m| world as f64 * m / t / 1e3 / copy_gbs);
            row += &format!(" {:>13}", roof.map_or("-".into(), |r| format!("{r:.3}")));
        }
        progress.print_row(&row);
    }
    for c in &comms {
        c.finalize()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::bytes_moved;

    #[test]
    fn two_shot_moves_five_messages_and_one_shot_grows_with_the_world() {
        assert_eq!(bytes_moved("twoshot", 1 << 20, 8), Some(5.0 * (1 << 20) as f64));
        assert_eq!(bytes_moved("oneshot", 100, 8), Some(1100.0));
        assert_eq!(bytes_moved("multimem", 100, 8), None);
    }
}
