//! `device_all_reduce --device host`: the device backend's one- and two-shot all_reduce on the
//! host device (its kernels on CPU threads), bf16 sum, `--world` ranks as threads of this
//! process. With `--check`, each size's last call runs on fresh inputs and every rank's result
//! must equal the reference bit for bit (f32 sums in rank order, rounded once to bf16, as the
//! kernels compute) and every other rank's. The times say how long the host device takes,
//! nothing about a GPU.

use crate::args::Args;
use ferrocomm::prelude::*;
use ferrocomm::{bf16, Error, Result};
use std::time::Instant;

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

pub fn all_reduce(a: &Args) -> Result<()> {
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
    let mut bytes = a.min_bytes.max(2) & !1;
    while bytes <= a.max_bytes {
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
        println!("{row}");
        bytes *= a.factor;
    }
    for c in &comms {
        c.finalize()?;
    }
    Ok(())
}
