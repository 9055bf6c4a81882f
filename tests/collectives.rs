//! Every collective, dtype, reduce op and algorithm against a host reference, with the ranks
//! as threads of this process (world sizes 1, 2, 3, 4, 8).

mod common;
use common::*;
use std::time::Duration;

fn world(n: usize) {
    let seed = fresh_seed();
    let checks = run_group(n, &format!("suite{n}"), options(Duration::from_secs(60)), |c| {
        common::suite::run_all(c, seed)
    });
    assert!(checks.iter().all(|&k| k == checks[0] && k > 0));
    eprintln!("world {n}: {} checked calls per rank", checks[0]);
}

#[test]
fn every_collective_world_1() {
    world(1);
}
#[test]
fn every_collective_world_2() {
    world(2);
}
#[test]
fn every_collective_world_3() {
    world(3);
}
#[test]
fn every_collective_world_4() {
    world(4);
}
#[test]
fn every_collective_world_8() {
    world(8);
}

/// Small all_reduce, all_gather and barrier between ranks of one host run as shared-memory
/// rounds that reuse two slots per rank. Ranks drift apart (one sleeps now and then), sizes
/// and operations change every round, and every result is checked, so a slot rewritten while a
/// peer still reads it would show up as wrong data.
#[test]
fn back_to_back_shared_memory_rounds_keep_every_result() {
    let rounds = 3000u64;
    let ok = run_group(4, "rounds", options(Duration::from_secs(60)), |c| {
        let (n, me) = (c.size() as u64, c.rank() as u64);
        for k in 0..rounds {
            if (k + me) % 97 == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
            let len = 1 + ((k * 7919) % 4000) as usize;
            match k % 3 {
                0 => {
                    let mut x: Vec<u64> = (0..len as u64).map(|i| (me + 1) * (i + k)).collect();
                    c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    let sum_ranks = n * (n + 1) / 2;
                    assert!(
                        x.iter().enumerate().all(|(i, &v)| v == sum_ranks * (i as u64 + k)),
                        "round {k}"
                    );
                }
                1 => {
                    let mine: Vec<u64> = (0..len as u64).map(|i| me << 40 | k << 16 | i).collect();
                    let mut all = vec![0u64; len * n as usize];
                    c.all_gather(&mut all, &mine).unwrap();
                    let want = |j: usize| ((j / len) as u64) << 40 | k << 16 | (j % len) as u64;
                    assert!(all.iter().enumerate().all(|(j, &v)| v == want(j)), "round {k}");
                }
                _ => c.barrier().unwrap(),
            }
        }
        true
    });
    assert!(ok.iter().all(|&b| b));
}
