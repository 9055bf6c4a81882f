//! Integrity under load: 8 ranks run 10,000 mixed collectives and window operations with random
//! sizes; every result is checked against values each rank can compute on its own. Zero
//! mismatches allowed. `FERROCOMM_INTEGRITY_OPS` changes the count.

mod common;
use common::*;

const RANKS: usize = 8;

/// The value rank `r` contributes at element `i` of operation `k` (cheap, varied, exact).
fn v(k: u64, r: usize, i: usize) -> i64 {
    ((k as i64).wrapping_mul(1_000_003) ^ (r as i64 * 7919) ^ (i as i64 * 104_729)) % 100_000
}

/// Runs `ops` mixed operations on this rank; returns (operations, mismatching elements).
fn load(c: &Comm, w: &Window, seed: u64, ops: u64) -> (u64, u64) {
    let (n, me) = (c.size(), c.rank());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let mut bad = 0u64;
    let mut ring_epoch = 0u64;
    let mut tickets = 0u64;
    for k in 0..ops {
        let mut r = rng(seed, k);
        // Mostly small, sometimes large enough for the ring algorithms.
        let count = if r.gen_ratio(1, 20) {
            r.gen_range(20_000..120_000)
        } else {
            r.gen_range(0..2_000)
        };
        match r.gen_range(0..8) {
            0 => {
                let mut a: Vec<i64> = (0..count).map(|i| v(k, me, i)).collect();
                c.all_reduce(&mut a, ReduceOp::Sum).unwrap();
                bad += a
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != (0..n).map(|q| v(k, q, *i)).sum::<i64>())
                    .count() as u64;
            }
            1 => {
                let mine: Vec<u8> = (0..count).map(|i| v(k, me, i) as u8).collect();
                let mut all = vec![0u8; count * n];
                c.all_gather(&mut all, &mine).unwrap();
                bad += all
                    .iter()
                    .enumerate()
                    .filter(|(j, x)| **x != v(k, j / count.max(1), j % count.max(1)) as u8)
                    .count() as u64;
            }
            2 => {
                // sizes[src][dst] elements from src to dst, drawn identically on every rank.
                let sizes: Vec<Vec<usize>> = (0..n)
                    .map(|_| (0..n).map(|_| r.gen_range(0..count / 8 + 1)).collect())
                    .collect();
                let input: Vec<f32> = (0..n)
                    .flat_map(|d| (0..sizes[me][d]).map(move |i| v(k, me, d * 1000 + i) as f32))
                    .collect();
                let recv: Vec<usize> = (0..n).map(|s| sizes[s][me]).collect();
                let mut out = vec![-1f32; recv.iter().sum()];
                c.all_to_all_v(&mut out, &input, &recv, &sizes[me]).unwrap();
                let want: Vec<f32> = (0..n)
                    .flat_map(|s| (0..sizes[s][me]).map(move |i| v(k, s, me * 1000 + i) as f32))
                    .collect();
                bad += out.iter().zip(&want).filter(|(a, b)| a != b).count() as u64;
            }
            3 => {
                let root = r.gen_range(0..n);
                let mut a: Vec<f64> = (0..count)
                    .map(|i| if me == root { v(k, root, i) as f64 } else { f64::NAN })
                    .collect();
                c.broadcast(&mut a, root).unwrap();
                bad += a
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != v(k, root, *i) as f64)
                    .count() as u64;
            }
            4 => {
                let per = count / n;
                let input: Vec<i32> = (0..per * n).map(|i| v(k, me, i) as i32).collect();
                let mut out = vec![0i32; per];
                c.reduce_scatter(&mut out, &input, ReduceOp::Sum).unwrap();
                bad += out
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != (0..n).map(|q| v(k, q, me * per + i) as i32).sum::<i32>())
                    .count() as u64;
            }
            5 => {
                let mine: Vec<u8> = (0..count).map(|i| v(k, me, i) as u8).collect();
                let mut got = vec![0u8; count];
                c.batch().recv(&mut got, left).send(&mine, right).issue().unwrap();
                bad += got
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != v(k, left, *i) as u8)
                    .count() as u64;
            }
            6 => {
                // Window ring: put + signal right, wait for the left's, check its bytes, then a
                // barrier so no one overwrites a slot that is still being read.
                let len = count.min(w.bytes() / 8);
                let mine: Vec<i64> = (0..len).map(|i| v(k, me, i)).collect();
                ring_epoch += 1;
                w.put_signal(right, 0, &mine, 0, SignalOp::Add, 1).unwrap();
                w.wait_signal(0, SignalSource::Rank(left), Cmp::Ge, ring_epoch).unwrap();
                let mut got = vec![0i64; len];
                w.read_local(0, &mut got).unwrap();
                bad += got.iter().enumerate().filter(|(i, x)| **x != v(k, left, *i)).count() as u64;
                w.barrier().unwrap();
            }
            _ => {
                // Everyone takes a ticket from a counter on a random rank; checked at the end.
                let owner = r.gen_range(0..n);
                w.fetch_add(owner, w.bytes() - 8 - 8 * owner, 1).unwrap();
                tickets += 1;
            }
        }
    }
    // Every counter on every rank must hold exactly the tickets drawn against it.
    w.barrier().unwrap();
    let mut total = 0u64;
    for owner in 0..n {
        total += w.fetch_add(owner, w.bytes() - 8 - 8 * owner, 0).unwrap();
    }
    let mut drawn = [tickets];
    c.all_reduce(&mut drawn, ReduceOp::Sum).unwrap();
    if total != drawn[0] {
        bad += 1;
    }
    (ops, bad)
}

#[test]
fn ten_thousand_mixed_operations_on_eight_ranks_without_a_mismatch() {
    let seed = fresh_seed();
    let ops = std::env::var("FERROCOMM_INTEGRITY_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000u64);
    let t0 = std::time::Instant::now();
    let r = run_group(RANKS, "integrity", options(Duration::from_secs(120)), |c| {
        let w = c.new_window(1 << 20).unwrap();
        load(c, &w, seed, ops)
    });
    let mismatches: u64 = r.iter().map(|x| x.1).sum();
    println!(
        "INTEGRITY {RANKS} ranks x {ops} mixed operations in {:?}: {mismatches} mismatching elements",
        t0.elapsed()
    );
    assert_eq!(mismatches, 0);
}
