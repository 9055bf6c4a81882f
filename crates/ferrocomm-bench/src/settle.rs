//! A settling phase before the first timed size: the ranks run small all_reduces until rank 0
//! has seen the time pass, and all stop together (rank 0's verdict rides in the reduction).
//! Where ranks outnumber the cores, the scheduler can start them three on one core and one on
//! the other and take 100-200 ms to even that out; sizes timed meanwhile measure the placement
//! (docs/results/cpu.md, "Ranks placed three to one"). The MPI and Gloo harnesses
//! (benches/peers) settle the same way, so that every tool is timed once placed.

use ferrocomm::prelude::*;
use ferrocomm::Result;
use std::time::{Duration, Instant};

/// Runs 4-byte all_reduces (max) on `comm` until rank 0 has seen `ms` milliseconds pass.
pub fn settle(comm: &Comm, ms: u64) -> Result<()> {
    if ms == 0 {
        return Ok(());
    }
    let until = Instant::now() + Duration::from_millis(ms);
    loop {
        let mut done = [u32::from(comm.rank() == 0 && Instant::now() >= until)];
        comm.all_reduce(&mut done[..], ReduceOp::Max)?;
        if done[0] == 1 {
            return Ok(());
        }
    }
}
