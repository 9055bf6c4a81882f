//! Every collective, dtype, reduce op and algorithm against a host reference, with the ranks
//! as threads of this process (world sizes 1, 2, 3, 4, 8).

mod common;
use common::*;
use ferrocomm::Error;
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

/// The whole suite over TCP links that seal every record (AES-256-GCM), as links between
/// machines do by default.
#[test]
fn every_collective_over_sealed_tcp_links() {
    let seed = fresh_seed();
    let mut o = tcp_options(Duration::from_secs(60));
    o.transport.encrypt = ferrocomm::Encrypt::On;
    let checks = run_group(3, "suite-sealed", o, |c| common::suite::run_all(c, seed));
    assert!(checks.iter().all(|&k| k == checks[0] && k > 0));
}

/// Where the ranks span hosts (over TCP every rank is a host of its own here) a broadcast the
/// direct algorithm would take goes down a tree (broadcast_tree.rs): at 4, 5 and 8 ranks, from
/// every root, sizes from one element past a second TCP connection's threshold, back to back
/// with a sum between roots, every element checked on every rank.
#[test]
fn broadcasts_down_a_tree_between_hosts_reach_every_rank_from_every_root() {
    for n in [4, 5, 8] {
        let mut o = tcp_options(Duration::from_secs(60));
        o.transport.tcp_bulk_bytes = Some(4096);
        let calls = run_group(n, &format!("tree{n}"), o, |c| {
            let (n, me) = (c.size(), c.rank());
            let val = |root: usize, i: usize| (root * 1_000_003 + i * 7) as i32;
            let mut calls = 0;
            for root in 0..n {
                for len in [1usize, 7, 1000, 5000] {
                    let mut x: Vec<i32> = (0..len).map(|i| if me == root { val(root, i) } else { -1 }).collect();
                    c.broadcast(&mut x, root).expect("broadcast");
                    let wrong = (0..len).filter(|&i| x[i] != val(root, i)).count();
                    assert_eq!(wrong, 0, "n {n}, root {root}, {len} elements, rank {me}");
                    calls += 1;
                }
                let mut sum = [1i32];
                c.all_reduce(&mut sum, ferrocomm::ReduceOp::Sum).expect("all_reduce");
                assert_eq!(sum[0], n as i32);
            }
            calls
        });
        assert!(calls.iter().all(|&k| k == 4 * n), "{calls:?}");
    }
}

/// Over TCP links whose large payloads go on a second connection (from 4 KiB here; tcp.rs):
/// every collective at sizes on both sides of that threshold with small calls in between, and
/// a batch that sends both ways on every pair at once, each element checked. Three ranks, so
/// each is the dialler of one link and the listener of another.
#[test]
fn large_payloads_on_second_tcp_connections_arrive_whole_and_in_order() {
    let mut o = tcp_options(Duration::from_secs(60));
    o.transport.tcp_bulk_bytes = Some(4096);
    let calls = run_group(3, "bulk", o, |c| {
        let (n, me) = (c.size(), c.rank());
        let val = |r: usize, i: usize| ((r * 1_000_003 + i * 7) % 100_003) as i32;
        let mut calls = 0;
        for count in [1023usize, 1024, 1500, 3, 70_000, 1, 300_000] {
            let mine: Vec<i32> = (0..count).map(|i| val(me, i)).collect();
            let mut sum = mine.clone();
            c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
            assert!(
                (0..count).all(|i| sum[i] == (0..n).map(|r| val(r, i)).sum::<i32>()),
                "all_reduce {count}"
            );
            let mut all = vec![-1i32; count * n];
            c.all_gather(&mut all, &mine).unwrap();
            assert!(
                (0..count * n).all(|k| all[k] == val(k / count, k % count)),
                "all_gather {count}"
            );
            for root in 0..n {
                let mut b = if me == root { mine.clone() } else { vec![-1; count] };
                c.broadcast(&mut b, root).unwrap();
                assert!(
                    (0..count).all(|i| b[i] == val(root, i)),
                    "broadcast {count} from {root}"
                );
            }
            // all_to_all: rank r's block for d holds val(r * n + d, i).
            let input: Vec<i32> = (0..count * n).map(|k| val(me * n + k / count, k % count)).collect();
            let mut out = vec![-1i32; count * n];
            c.all_to_all(&mut out, &input).unwrap();
            assert!(
                (0..count * n).all(|k| out[k] == val((k / count) * n + me, k % count)),
                "all_to_all {count}"
            );
            let (left, right) = ((me + n - 1) % n, (me + 1) % n);
            let (mut from_left, mut from_right) = (vec![-1i32; count], vec![-1i32; count]);
            c.batch()
                .recv(&mut from_left, left)
                .recv(&mut from_right, right)
                .send(&mine, right)
                .send(&mine, left)
                .issue()
                .unwrap();
            assert!(
                (0..count).all(|i| from_left[i] == val(left, i)),
                "batch from the left, {count}"
            );
            assert!(
                (0..count).all(|i| from_right[i] == val(right, i)),
                "batch from the right, {count}"
            );
            calls += 4 + n;
        }
        calls
    });
    assert!(calls.iter().all(|&k| k == calls[0] && k > 0));
}

/// Small all_reduce, all_gather, broadcast and barrier between ranks of one host run as
/// shared-memory rounds that reuse two slots per rank. Ranks drift apart (one sleeps now and
/// then), sizes, roots and operations change every round, and every result is checked, so a
/// slot rewritten while a peer still reads it would show up as wrong data.
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
            match k % 5 {
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
                2 | 3 => {
                    // Runs of broadcasts from one root, then from another.
                    let root = (k / 5) as usize % c.size();
                    let value = |i: u64| (root as u64) << 40 | k << 16 | i;
                    let mut x: Vec<u64> = (0..len as u64)
                        .map(|i| if c.rank() == root { value(i) } else { u64::MAX })
                        .collect();
                    c.broadcast(&mut x, root).unwrap();
                    assert!(x.iter().enumerate().all(|(i, &v)| v == value(i as u64)), "round {k}");
                }
                _ => c.barrier().unwrap(),
            }
        }
        true
    });
    assert!(ok.iter().all(|&b| b));
}

/// A broadcast larger than a slot runs as shared-memory rounds a slot at a time (the `oneshot`
/// hint here; by default where ranks outnumber CPUs), the root filling one slot while the
/// receivers copy from the other. Ranks drift apart, lengths cross the slot's size (one piece,
/// one piece and a byte, many and a part), roots change and small rounds come in between, and
/// every result is checked, so a piece rewritten while a peer still reads it would show up as
/// wrong data.
#[test]
fn broadcasts_larger_than_a_slot_go_in_pieces_and_keep_every_result() {
    let mut o = options(Duration::from_secs(60)).with_hint("algorithm", "oneshot");
    o.transport.force_tcp = false;
    let slot = 64 << 10;
    let lens = [slot, slot + 1, 3 * slot + 4100, slot - 1, 1 << 20, 2 * slot + 8];
    for world in [2, 4] {
        let ok = run_group(world, "pieces", o.clone(), |c| {
            let me = c.rank();
            for k in 0..60usize {
                if (k + me) % 7 == 0 {
                    std::thread::sleep(Duration::from_micros(300));
                }
                let (root, len) = (k % c.size(), lens[k % lens.len()]);
                let value = |i: usize| (i.wrapping_mul(2654435761) >> 7) as u8 ^ (k * 31 + root) as u8;
                let mut x: Vec<u8> = (0..len).map(|i| if me == root { value(i) } else { 0xa5 }).collect();
                c.broadcast(&mut x, root).unwrap();
                assert!(
                    x.iter().enumerate().all(|(i, &v)| v == value(i)),
                    "rank {me}, call {k}: {len} bytes from {root}"
                );
                let mut y = [me as u64 + k as u64];
                c.all_reduce(&mut y[..], ReduceOp::Sum).unwrap();
                let n = c.size() as u64;
                assert_eq!(y[0], n * (n - 1) / 2 + n * k as u64, "rank {me}, call {k}");
            }
            true
        });
        assert!(ok.iter().all(|&b| b));
    }
}

/// all_to_all_v goes through one shared-memory round only when every rank's blocks fit its
/// slot, which only that rank knows: here rank 0 sends more than a slot holds, so every rank
/// must fall back to messages together, and the data must still arrive. Then the same call
/// with small blocks (the round), and a block size that disagrees across ranks (a mismatch).
#[test]
fn all_to_all_v_falls_back_together_when_one_rank_does_not_fit() {
    let n = 3;
    let r = run_group(n, "a2a-fit", options(Duration::from_secs(20)), |c| {
        let me = c.rank();
        // Rank s sends `len(s, d)` u32 to rank d.
        let len = |s: usize, d: usize, big: bool| if big && s == 0 { 12_000 + d } else { 3 + s + 2 * d };
        for big in [true, false] {
            let ins: Vec<usize> = (0..n).map(|d| len(me, d, big)).collect();
            let outs: Vec<usize> = (0..n).map(|s| len(s, me, big)).collect();
            let input: Vec<u32> = (0..n)
                .flat_map(|d| (0..ins[d]).map(move |i| (me * 1_000_000 + d * 100_000 + i) as u32))
                .collect();
            let mut output = vec![u32::MAX; outs.iter().sum()];
            c.all_to_all_v(&mut output, &input, &outs, &ins).unwrap();
            let want: Vec<u32> = (0..n)
                .flat_map(|s| (0..outs[s]).map(move |i| (s * 1_000_000 + me * 100_000 + i) as u32))
                .collect();
            assert!(output == want, "rank {me}, big {big}");
        }
        // Rank 1 expects 4 elements from rank 0, which sends 5.
        let ins = vec![5usize; n];
        let mut outs = vec![5usize; n];
        if me == 1 {
            outs[0] = 4;
        }
        let input = vec![7u32; ins.iter().sum()];
        let mut output = vec![0u32; outs.iter().sum()];
        c.all_to_all_v(&mut output, &input, &outs, &ins)
    });
    assert!(
        matches!(
            r[1],
            Err(ferrocomm::Error::Mismatch {
                op: "all_to_all",
                peer: 0,
                ..
            })
        ),
        "{r:?}"
    );
}

/// A group of 128 ranks: its links are made as its algorithms first use them (a ring all_reduce
/// two per rank, a direct all_to_all every pair), and every result is right.
#[test]
fn a_large_group_makes_its_links_as_it_uses_them() {
    let n = 128;
    let mut o = options(Duration::from_secs(120));
    o.transport.shm_ring_bytes = 4096;
    let ok = run_group(n, "large", o, |c| {
        let (me, n) = (c.rank() as u64, c.size() as u64);
        let mut x = vec![me; 1 << 15];
        c.with_options(OpOptions::new().hint("algorithm", "ring"))
            .all_reduce(&mut x[..], ReduceOp::Sum)
            .unwrap();
        let sum = n * (n - 1) / 2;
        let ring_ok = x.iter().all(|&v| v == sum);
        let send: Vec<u64> = (0..n).map(|p| me * 1000 + p).collect();
        let mut recv = vec![0u64; n as usize];
        c.with_options(OpOptions::new().hint("algorithm", "direct"))
            .all_to_all(&mut recv[..], &send[..])
            .unwrap();
        ring_ok && recv.iter().enumerate().all(|(p, &v)| v == p as u64 * 1000 + me)
    });
    assert!(ok.iter().all(|&k| k));
}

/// Between 2 ranks of one host a broadcast of 128-512 KiB goes by reference: the receiver
/// copies out of the root's buffer, and the root waits for that copy. Data arrives from either
/// root while the ranks drift; a receiver with another length fails at once with its buffer
/// untouched, and its root learns of it by its next call at the latest (as a streamed root
/// does) instead of waiting out its deadline; so does a receiver in another operation.
#[test]
fn a_broadcast_by_reference_between_two_ranks_delivers_and_reports_mismatches() {
    let timeout = Duration::from_secs(10);
    let mut o = options(timeout).with_check_calls(false);
    o.transport.force_tcp = false;
    // By reference even where this machine's copy out of another process is slow.
    o.transport.shm_pull_bytes = Some(4096);
    let direct = ferrocomm::OpOptions::new().hint("algorithm", "direct");
    let start = std::time::Instant::now();
    let ok = run_group(2, "bcast-ref", o.clone(), |c| {
        let me = c.rank();
        for k in 0..40usize {
            if (k + me) % 5 == 0 {
                std::thread::sleep(Duration::from_micros(500));
            }
            let (root, len) = (k % 2, [200_000, 256 << 10, 512 << 10, (128 << 10) + 1][k % 4]);
            let value = |i: usize| (i.wrapping_mul(40503) >> 5) as u8 ^ k as u8;
            let mut x: Vec<u8> = (0..len).map(|i| if me == root { value(i) } else { 0x5a }).collect();
            let r = if k % 3 == 0 {
                c.with_options(direct.clone()).broadcast(&mut x, root)
            } else {
                c.broadcast(&mut x, root)
            };
            r.unwrap();
            assert!(x.iter().enumerate().all(|(i, &v)| v == value(i)), "rank {me}, call {k}");
        }
        true
    });
    assert!(ok.iter().all(|&b| b));
    // Rank 1 expects fewer bytes than rank 0 sends.
    let got = run_group(2, "bcast-ref-len", o.clone(), |c| {
        let len = if c.rank() == 0 { 256 << 10 } else { 200_000 };
        let mut x = vec![c.rank() as u8 + 1; len];
        let first = c.with_options(direct.clone()).broadcast(&mut x, 0);
        let untouched = x.iter().all(|&v| v == c.rank() as u8 + 1);
        // A root whose call passed learns of the mismatch by its next call.
        let next = first.is_ok().then(|| c.barrier());
        (first, next, untouched)
    });
    let (first, _, untouched) = &got[1];
    assert!(untouched, "rank 1: its buffer changed");
    assert!(
        matches!(
            first,
            Err(Error::Mismatch {
                op: "broadcast",
                peer: 0,
                ..
            })
        ),
        "{got:?}"
    );
    let (first, next, _) = &got[0];
    assert!(
        matches!(first, Err(Error::Mismatch { peer: 1, .. }))
            || matches!(next, Some(Err(Error::Mismatch { peer: 1, .. }))),
        "rank 0: {got:?}"
    );
    // Rank 1 in an all_reduce of as many bytes.
    let got = run_group(2, "bcast-ref-op", o, |c| {
        let mut x = vec![1.0f32; 64 << 10];
        if c.rank() == 0 {
            c.broadcast(&mut x, 0).and_then(|_| c.barrier())
        } else {
            c.all_reduce(&mut x, ReduceOp::Sum)
        }
    });
    assert!(got.iter().all(|r| matches!(r, Err(Error::Mismatch { .. }))), "{got:?}");
    assert!(start.elapsed() < timeout, "took {:?}", start.elapsed());
}

/// `finalize` is the last chance of a rank that left a collective before its peers' calls
/// came (a streamed broadcast's root): rank 1 calls with fewer elements and fails there; rank
/// 0's broadcast completes, and its `finalize` reports the mismatch, naming rank 1.
#[test]
fn finalize_reports_a_mismatch_its_broadcast_root_had_not_yet_checked() {
    let got = run_group(2, "finalize-mismatch", options(Duration::from_secs(5)), |c| {
        // Streamed: the root does not wait for its receivers' calls.
        let streamed = c.with_options(ferrocomm::OpOptions::new().hint("algorithm", "direct"));
        if c.rank() == 1 {
            return streamed.broadcast(&mut [0.0f32; 3], 0).map(|_| ());
        }
        streamed
            .broadcast(&mut [1.0f32; 4], 0)
            .expect("the root does not wait for its receiver");
        c.finalize()
    });
    for r in &got {
        assert!(matches!(r, Err(ferrocomm::Error::Mismatch { .. })), "{got:?}");
    }
    assert!(
        matches!(&got[0], Err(ferrocomm::Error::Mismatch { peer: 1, .. })),
        "{got:?}"
    );
}
