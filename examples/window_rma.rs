//! A pipeline over one-sided window operations. Rank 0 produces chunks; each rank waits for a
//! chunk from its left neighbour (`wait_signal`), adds its rank to every element, and passes it
//! right (`put` + `signal`); the last rank checks the sums. Two slots per rank double-buffer the
//! stream, and an acknowledgement signal back tells the sender a slot is free again.
//!
//! `cargo run --example window_rma` runs 4 ranks as threads;
//! `ferrocomm-run -n 4 -- target/debug/examples/window_rma` runs them as processes.

use ferrocomm::prelude::*;

const CHUNKS: u64 = 64;
const ELEMS: usize = 1024;
const SLOT_BYTES: usize = ELEMS * 4;
const DATA: usize = 0; // signal id: "chunk c is in your slot c % 2"
const ACK: usize = 1; // signal id: "I have read chunk c"

fn pipeline(comm: &Comm) -> ferrocomm::Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let win = comm.new_window(2 * SLOT_BYTES)?;
    let (left, right) = (rank.wrapping_sub(1), rank + 1);
    let mut chunk = vec![0f32; ELEMS];
    for c in 0..CHUNKS {
        let slot = (c % 2) as usize * SLOT_BYTES;
        if rank == 0 {
            chunk.fill(c as f32);
        } else {
            win.wait_signal(DATA, SignalSource::Rank(left), Cmp::Ge, c + 1)?;
            win.read_local(slot, &mut chunk)?;
            win.signal(left, ACK, SignalOp::Add, 1)?;
            chunk.iter_mut().for_each(|x| *x += rank as f32);
        }
        if right < size {
            // The right neighbour's slot c % 2 held chunk c - 2: wait until it has read it.
            if c >= 2 {
                win.wait_signal(ACK, SignalSource::Rank(right), Cmp::Ge, c - 1)?;
            }
            win.put_signal(right, slot, &chunk, DATA, SignalOp::Add, 1)?;
        } else {
            let want = c as f32 + (size * (size - 1) / 2) as f32;
            assert!(
                chunk.iter().all(|&x| x == want),
                "chunk {c}: got {}, want {want}",
                chunk[0]
            );
        }
    }
    win.barrier()?;
    if rank == size - 1 {
        println!("rank {rank}: {CHUNKS} chunks of {ELEMS} f32 passed through {size} ranks, all sums correct");
    }
    Ok(())
}

fn main() -> ferrocomm::Result<()> {
    // The library installs no log subscriber: FERROCOMM_LOG=debug shows its events through this one.
    ferrocomm::init_logging()?;
    let options = CommOptions::from_env()?;
    if ferrocomm::discover(|k| std::env::var(k).ok())?.is_some() {
        return pipeline(&new_comm("cpu", Device::Cpu, "window_rma", options)?);
    }
    let comms = Comm::new_group("cpu", &[Device::Cpu; 4], "window_rma", options)?;
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(move || pipeline(c))).collect();
        hs.into_iter().try_for_each(|h| h.join().expect("rank thread panicked"))
    })
}
