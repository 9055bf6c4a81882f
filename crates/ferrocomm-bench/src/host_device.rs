//! The device rows on the host device (`--device host`: the library's kernels on CPU threads,
//! through the device backend), each checked with `--check`. The times say how long the host
//! device takes, nothing about a GPU.
//!
//! `device_all_reduce`: one- and two-shot all_reduce, bf16 sum, `--world` ranks as threads;
//! each size's last call runs on fresh inputs and every rank's result must equal the reference
//! bit for bit (f32 sums in rank order, rounded once to bf16, as the kernels compute).
//! `device_put`: `ferrocomm_put_blocks` into the peer's window against a plain copy of the same
//! bytes; the peer's window must then hold them. `device_pingpong`: `ferrocomm_bench_pingpong`
//! between two ranks' kernels; both must finish.

use crate::cli::Args;
use crate::progress::Progress;
use ferrocomm::device::{host_library, HostModule};
use ferrocomm::prelude::*;
use ferrocomm::{bf16, Error, Result};
use std::time::Instant;

/// Runs a device row on the host device and prints its figures.
pub fn run(a: &Args) -> Result<()> {
    match a.op.as_str() {
        "device_all_reduce" => all_reduce(a),
        "device_put" => put(a),
        "device_pingpong" => pingpong(a),
        other => Err(Error::Config(format!("{other} has no host-device row"))),
    }
}

/// Runs `f(comm)` on each of `world` host-device ranks, a thread each.
fn on_ranks<R: Send>(world: usize, name: &str, f: impl Fn(&Comm) -> Result<R> + Sync) -> Result<Vec<R>> {
    let comms = Comm::new_group("device", &vec![Device::Host(0); world], name, CommOptions::from_env()?)?;
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Config("a rank panicked".into())))
            })
            .collect()
    })
}

fn put(a: &Args) -> Result<()> {
    let kernels = host_library()?;
    println!(
        "# ferrocomm-bench device_put --device host: put_blocks into the peer's window vs a plain copy, \
         2 ranks as threads on the host device (not GPU figures){}",
        if a.check { ", every size checked" } else { "" }
    );
    println!("#{:>11} {:>12} {:>12}", "size(B)", "put GB/s", "copy GB/s");
    on_ranks(2, "bench-host-put", |c| {
        let w = c.new_window(a.max_bytes)?;
        if c.rank() == 0 {
            measure_put(&w, &kernels, a)?;
        }
        w.barrier()
    })
    .map(drop)
}

fn measure_put(w: &Window, kernels: &HostModule, a: &Args) -> Result<()> {
    let src: Vec<u8> = (0..a.max_bytes).map(|i| (i * 131 + 7) as u8).collect();
    let (h, dst) = (
        w.device_handle()?,
        w.remote_ptr(1).expect("ranks of one process are mapped"),
    );
    let sizes = crate::size::sweep(a.min_bytes, a.max_bytes, a.factor);
    let progress = Progress::new(&a.op, sizes.len(), true);
    for bytes in sizes {
        progress.start_size(bytes);
        let blocks = (bytes / (64 << 10)).clamp(1, 16) as u32;
        let args = (h, 1i32, 0u64, src.as_ptr() as u64, bytes as u64);
        // SAFETY: ferrocomm_put_blocks takes (handle, peer, dst_offset, src, bytes); the source
        // outlives the launch, the destination range lies in the peer's window.
        let put_once = || unsafe { kernels.launch("ferrocomm_put_blocks", blocks, 64, args) };
        // SAFETY: the peer's segment is mapped and at least max_bytes long.
        let copy_once = || unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, bytes) };
        let time = |op: &dyn Fn() -> Result<()>| -> Result<f64> {
            for _ in 0..a.warmup {
                op()?;
            }
            let t0 = Instant::now();
            for _ in 0..a.iters {
                op()?;
            }
            Ok(t0.elapsed().as_secs_f64() / a.iters as f64)
        };
        let t_copy = time(&|| {
            copy_once();
            Ok(())
        })?;
        if a.check {
            let mut zero = vec![0u8; bytes];
            w.put(1, 0, &zero)?;
            put_once()?;
            w.get(1, 0, &mut zero)?;
            if zero != src[..bytes] {
                return Err(Error::Config(format!("check failed: put_blocks of {bytes} bytes")));
            }
        }
        let t_put = time(&put_once)?;
        progress.print_row(&format!(
            "{:>12} {:>12.2} {:>12.2}",
            bytes,
            bytes as f64 / t_put / 1e9,
            bytes as f64 / t_copy / 1e9
        ));
    }
    Ok(())
}

fn pingpong(a: &Args) -> Result<()> {
    let kernels = host_library()?;
    let iters = a.iters.max(100) as u32;
    let half = on_ranks(2, "bench-host-pingpong", |c| {
        let w = c.new_window(64)?;
        let mut out = [0u64; 2];
        let (peer, initiator) = (1 - c.rank() as i32, (c.rank() == 0) as u32);
        let args = (
            w.device_handle()?,
            peer,
            0u32,
            iters,
            initiator,
            0u64,
            out.as_mut_ptr() as u64,
        );
        // SAFETY: ferrocomm_bench_pingpong takes (handle, peer, id, iters, initiator, base,
        // out); `out` outlives the launch.
        unsafe { kernels.launch("ferrocomm_bench_pingpong", 1, 1, args) }?;
        w.synchronize()?;
        if out[0] != 1 {
            return Err(Error::Config(format!(
                "rank {}: the ping-pong kernel did not finish",
                c.rank()
            )));
        }
        w.barrier()?;
        Ok(out[1] as f64 / iters as f64 / 2.0 / 1e3)
    })?;
    println!(
        "# ferrocomm-bench device_pingpong --device host: put(8 B) + signal -> wait, 2 ranks' kernels on \
         the host device, {iters} round trips (not GPU figures)"
    );
    println!("half round trip: {:.3} us (rank 0's kernel clock)", half[0]);
    Ok(())
}

/// Rank `r`'s input element `i` for call `call`: small integers and halves, exact in bf16.
fn input(r: usize, call: usize, i: usize) -> bf16 {
    let x = (r * 7919 + call * 104_729 + i * 31) % 255;
    bf16::from_f32(x as f32 / 2.0 - 63.0)
}

fn reference(world: usize, call: usize, i: usize) -> bf16 {
    let mut acc = input(0, call, i).to_f32();
    for r in 1..world {
        acc += input(r, call, i).to_f32();
    }
    bf16::from_f32(acc)
}

/// One rank: warm-up and timed calls, then the checked one; returns microseconds per call.
fn rank(c: &Comm, count: usize, algo: &str, a: &Args) -> Result<f64> {
    let comm = c.with_options(OpOptions::new().hint("algorithm", algo));
    let mut buf: Vec<bf16> = (0..count).map(|i| input(c.rank(), 0, i)).collect();
    for _ in 0..a.warmup {
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    }
    c.barrier()?;
    let t0 = Instant::now();
    for _ in 0..a.iters {
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / a.iters as f64;
    if a.check {
        let call = 1 + count;
        let mut buf: Vec<bf16> = (0..count).map(|i| input(c.rank(), call, i)).collect();
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        if let Some(i) = (0..count).find(|&i| buf[i].to_bits() != reference(c.size(), call, i).to_bits()) {
            return Err(Error::Config(format!(
                "check failed: {algo}, {count} elements, rank {} element {i}: {} where the reference is {}",
                c.rank(),
                buf[i],
                reference(c.size(), call, i)
            )));
        }
    }
    Ok(us)
}

fn all_reduce(a: &Args) -> Result<()> {
    let world = a.world;
    let comms = Comm::new_group(
        "device",
        &vec![Device::Host(0); world],
        "bench-host-device",
        CommOptions::from_env()?,
    )?;
    let algos: Vec<String> = match &a.algo {
        Some(one) => vec![one.clone()],
        None => vec!["oneshot".into(), "twoshot".into()],
    };
    println!(
        "# ferrocomm-bench device_all_reduce --device host: bf16 sum, {world} ranks as threads on the host \
         device (kernels on CPU threads: not GPU figures), {} calls per size{}",
        a.iters,
        if a.check { ", each size checked bit for bit" } else { "" }
    );
    let mut header = format!("#{:>11}", "size(B)");
    for algo in &algos {
        header += &format!(" {:>13}", format!("{algo}(us)"));
    }
    println!("{header}");
    // bf16: whole elements.
    let sizes = crate::size::sweep(a.min_bytes.max(2) & !1, a.max_bytes, a.factor);
    let progress = Progress::new(&a.op, sizes.len(), true);
    for bytes in sizes {
        progress.start_size(bytes);
        let mut row = format!("{bytes:>12}");
        for algo in &algos {
            let times = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .iter()
                    .map(|c| s.spawn(move || rank(c, bytes / 2, algo, a)))
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(Error::Config("a rank panicked".into())))
                    })
                    .collect::<Result<Vec<f64>>>()
            })?;
            row += &format!(" {:>13.1}", times.iter().copied().fold(0.0, f64::max));
        }
        progress.print_row(&row);
    }
    for c in &comms {
        c.finalize()?;
    }
    Ok(())
}
