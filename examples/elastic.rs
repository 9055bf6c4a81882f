//! Going on after losing a rank: 4 ranks loop over checked all_reduces; rank 3 leaves on
//! purpose halfway (its process exits with status 3, or its thread aborts its communicator);
//! the others get `Error::PeerLost` naming it, agree on a communicator of the 3 still alive
//! with `Comm::shrink`, and finish the loop, checking every result.
//!
//! `cargo run --example elastic` runs the 4 ranks as threads of this process;
//! `ferrocomm-run -n 4 --tolerate-failures 1 -- target/debug/examples/elastic` runs them as
//! processes (add `FERROCOMM_TRANSPORT=tcp` for TCP links): the launcher tolerates the one
//! rank that leaves and exits 0.

use ferrocomm::prelude::*;
use ferrocomm::Error;

const STEPS: u64 = 10;
const LEAVER: usize = 3;
const LEAVES_AT: u64 = 5;
/// Under a launcher the leaving process exits with this status.
const LEFT_ON_PURPOSE: i32 = 3;

/// The value every rank contributes at `step`: its original rank and the step, so the sum
/// says exactly which ranks took part.
fn contribution(rank: usize, step: u64) -> Vec<u64> {
    (0..1024).map(|i| rank as u64 * 1000 + step * 10 + i).collect()
}

fn expected(ranks: &[usize], step: u64) -> Vec<u64> {
    (0..1024)
        .map(|i| ranks.iter().map(|&r| r as u64 * 1000 + step * 10 + i).sum())
        .collect()
}

/// One rank's loop; `leave` ends the rank the way the mode allows. Returns the final size.
fn run(world: &Comm, leave: impl Fn(&Comm)) -> ferrocomm::Result<usize> {
    let me = world.rank();
    let mut comm = world.clone();
    let mut members: Vec<usize> = (0..world.size()).collect();
    let mut step = 0;
    while step < STEPS {
        if me == LEAVER && step == LEAVES_AT {
            println!("elastic: rank {me} leaves at step {step}");
            leave(world);
            return Ok(0);
        }
        let mut x = contribution(me, step);
        match comm.all_reduce(&mut x, ReduceOp::Sum) {
            Ok(()) => {
                assert_eq!(x, expected(&members, step), "rank {me}, step {step}");
                step += 1;
            }
            Err(Error::PeerLost { peer, .. }) => {
                // `peer` is a rank of `comm`; the survivors agree on who is left (`kept`:
                // ranks of `comm`), and redo this step.
                let (smaller, kept) = comm.shrink(&[peer])?;
                println!(
                    "elastic: rank {me} lost rank {} at step {step}; going on with {}",
                    members[peer],
                    smaller.size()
                );
                members = kept.iter().map(|&r| members[r]).collect();
                comm = smaller;
            }
            Err(e) => return Err(e),
        }
    }
    println!("elastic: finished with {} ranks", comm.size());
    Ok(comm.size())
}

fn main() -> ferrocomm::Result<()> {
    let options = CommOptions::from_env()?;
    if ferrocomm::discover(|k| std::env::var(k).ok())?.is_some() {
        // One rank per process: the leaver's process exits, its links close.
        let comm = new_comm("auto", Device::Cpu, "elastic", options)?;
        run(&comm, |_| std::process::exit(LEFT_ON_PURPOSE))?;
        return Ok(());
    }
    let comms = Comm::new_group("auto", &[Device::Cpu; 4], "elastic", options)?;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            // A thread cannot exit alone: the leaver aborts its rank, as a dead process would.
            .map(|c| s.spawn(move || run(c, Comm::abort)))
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("rank thread panicked").map(|_| ()))
    })
}
