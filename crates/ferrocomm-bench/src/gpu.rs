//! Device rows of ferrocomm-bench, two ranks on GPU 0 in this process (device backend):
//! `device_put`: bandwidth of a put issued by SMs (kernel ferrocomm_put_blocks) into the peer's
//! window, against cuMemcpyDtoDAsync of the same bytes between the same buffers, in one run;
//! `device_pingpong`: put(8 B) + signal, then wait, between the two ranks' kernels
//! (ferrocomm_bench_pingpong); the half round trip is the latency.

use crate::cli::Args;
use crate::progress::Progress;
use ferrocomm::device::cudarc::driver::{sys, LaunchConfig, PushKernelArg};
use ferrocomm::device::{self};
use ferrocomm::prelude::*;
use ferrocomm::{Error, Result};
use std::time::Instant;

fn cuda(call: &str) -> impl Fn(ferrocomm::device::cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Backend {
        backend: "cuda".into(),
        call: call.into(),
        message: format!("{e:?}"),
    }
}

/// Runs `device_put` or `device_pingpong` on GPU 0 and prints its figures.
pub fn run(a: &Args) -> Result<()> {
    device::available(0)?;
    let comms = Comm::new_group("device", &[Device::Cuda(0); 2], "bench-gpu", CommOptions::from_env()?)?;
    match a.op.as_str() {
        "device_put" => put(&comms, a),
        "device_pingpong" => pingpong(&comms, a),
        other => Err(Error::Config(format!("unknown device op {other}"))),
    }
}

/// Rank 0 alone moves data into rank 1's segment. Window creation is collective: both ranks
/// make the window (each on a thread of its own), then rank 1 waits at the barrier that ends
/// the measurement.
fn put(comms: &[Comm], a: &Args) -> Result<()> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || -> Result<()> {
                    let w = c.new_window(a.max_bytes)?;
                    let r = if c.rank() == 0 { measure_put(&w, a) } else { Ok(()) };
                    w.barrier()?;
                    r
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Config("rank panicked".into()))))
            .collect::<Result<Vec<()>>>()
            .map(drop)
    })
}

fn measure_put(w: &Window, a: &Args) -> Result<()> {
    let max = a.max_bytes;
    let stream = w.stream()?;
    let h = w.device_handle()?;
    let src = stream.alloc_zeros::<u8>(max).map_err(cuda("alloc"))?;
    let f = device::library_function(0, "ferrocomm_put_blocks")?;
    let dst = w.remote_ptr(1).expect("device windows map every peer") as u64;
    println!("# ferrocomm-bench device_put: SM put into the peer's window vs cuMemcpyDtoDAsync, GPU 0");
    println!(
        "#{:>11} {:>12} {:>12} {:>7}",
        "size(B)", "put GB/s", "memcpy GB/s", "ratio"
    );
    let sizes = crate::size::sweep(a.min_bytes, max, a.factor);
    let progress = Progress::new(&a.op, sizes.len(), true);
    for bytes in sizes {
        progress.start_size(bytes);
        let (n, peer) = (bytes as u64, 1i32);
        let blocks = (bytes / (64 << 10)).clamp(1, 1024) as u32;
        let put_once = || -> Result<()> {
            let mut b = stream.launch_builder(&f);
            b.arg(&h).arg(&peer).arg(&0u64).arg(&src).arg(&n);
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (512, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match ferrocomm_put_blocks's parameters.
            unsafe { b.launch(cfg) }.map_err(cuda("cuLaunchKernel")).map(drop)
        };
        let memcpy_once = || -> Result<()> {
            let (s, _g) = ferrocomm::device::cudarc::driver::DevicePtr::device_ptr(&src, &stream);
            // SAFETY: both ranges are `bytes` long and live; the stream orders the copy.
            let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, s, bytes, stream.cu_stream()) };
            r.result().map_err(cuda("cuMemcpyDtoDAsync"))
        };
        let time = |op: &dyn Fn() -> Result<()>| -> Result<f64> {
            for _ in 0..a.warmup {
                op()?;
            }
            stream.synchronize().map_err(cuda("sync"))?;
            let t0 = Instant::now();
            for _ in 0..a.iters {
                op()?;
            }
            stream.synchronize().map_err(cuda("sync"))?;
            Ok(t0.elapsed().as_secs_f64() / a.iters as f64)
        };
        // Interleave so clock and temperature drift hit both alike.
        let (t_put, t_copy) = (time(&put_once)?, time(&memcpy_once)?);
        let (gput, gcopy) = (bytes as f64 / t_put / 1e9, bytes as f64 / t_copy / 1e9);
        progress.print_row(&format!(
            "{:>12} {:>12.1} {:>12.1} {:>7.3}",
            bytes,
            gput,
            gcopy,
            gput / gcopy
        ));
    }
    Ok(())
}

fn pingpong(comms: &[Comm], a: &Args) -> Result<()> {
    let iters = a.iters.max(1000) as u32;
    let half = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || -> Result<f64> {
                    let w = c.new_window(64)?;
                    let stream = w.stream()?;
                    let h = w.device_handle()?;
                    let f = device::library_function(0, "ferrocomm_bench_pingpong")?;
                    let out = stream.alloc_zeros::<u64>(2).map_err(cuda("alloc"))?;
                    let (peer, id, init, base) = (1 - c.rank() as i32, 0u32, (c.rank() == 0) as u32, 0u64);
                    let mut b = stream.launch_builder(&f);
                    b.arg(&h)
                        .arg(&peer)
                        .arg(&id)
                        .arg(&iters)
                        .arg(&init)
                        .arg(&base)
                        .arg(&out);
                    let cfg = LaunchConfig {
                        grid_dim: (1, 1, 1),
                        block_dim: (1, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: the arguments match ferrocomm_bench_pingpong's parameters.
                    unsafe { b.launch(cfg) }.map_err(cuda("cuLaunchKernel"))?;
                    w.synchronize()?;
                    let o = stream.clone_dtoh(&out).map_err(cuda("copy"))?;
                    if o[0] != 1 {
                        return Err(Error::Config("ping-pong kernel did not finish".into()));
                    }
                    w.barrier()?;
                    Ok(o[1] as f64 / iters as f64 / 2.0 / 1e3)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Config("rank panicked".into()))))
            .collect::<Result<Vec<f64>>>()
    })?;
    println!("# ferrocomm-bench device_pingpong: put(8 B) + signal -> wait, 2 ranks on GPU 0, {iters} round trips");
    println!("half round trip: {:.3} us (rank 0's kernel clock)", half[0]);
    Ok(())
}
