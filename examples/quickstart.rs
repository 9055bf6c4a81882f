//! all_reduce, all_gather, a send/recv ring and an object broadcast.
//!
//! `cargo run --example quickstart` runs 4 ranks as threads of this process;
//! `ferrocomm-run -n 4 -- target/debug/examples/quickstart` runs the same code as 4 processes.

use ferrocomm::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Config {
    learning_rate: f64,
    layers: Vec<usize>,
}

fn demo(comm: &Comm) -> ferrocomm::Result<()> {
    let (rank, size) = (comm.rank(), comm.size());

    let mut grad = vec![rank as f32 + 1.0; 4];
    comm.all_reduce(&mut grad, ReduceOp::Sum)?;
    println!("rank {rank}: all_reduce(sum)  = {grad:?}");

    let mut everyone = vec![0i32; size];
    comm.all_gather(&mut everyone, &[rank as i32 * 10])?;
    println!("rank {rank}: all_gather       = {everyone:?}");

    // A ring: send to the right, receive from the left, batched so the order cannot deadlock.
    let token = [rank as i64];
    let mut from_left = [0i64];
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    comm.batch().send(&token, right).recv(&mut from_left, left).issue()?;
    println!("rank {rank}: ring recv        = {} (from rank {left})", from_left[0]);

    let cfg = (rank == 0).then(|| Config {
        learning_rate: 3e-4,
        layers: vec![512, 512, 10],
    });
    let cfg: Config = comm.broadcast_object(cfg.as_ref(), 0)?;
    println!("rank {rank}: broadcast_object = {cfg:?}");
    comm.finalize()
}

fn main() -> ferrocomm::Result<()> {
    // The library installs no log subscriber: FERROCOMM_LOG=debug shows its events through this one.
    ferrocomm::init_logging()?;
    let options = CommOptions::from_env()?;
    if ferrocomm::discover(|k| std::env::var(k).ok())?.is_some() {
        // Started by a launcher: this process is one rank.
        let comm = new_comm("auto", Device::Cpu, "quickstart", options)?;
        return demo(&comm);
    }
    let comms = Comm::new_group("auto", &[Device::Cpu; 4], "quickstart", options)?;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.iter().map(|c| s.spawn(move || demo(c))).collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("rank thread panicked"))
    })
}
