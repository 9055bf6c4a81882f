//! The device backend's own kernels with every rank on GPU 0 in this process — NCCL cannot
//! serve ranks that share a GPU, so these calls take the own kernels: one- and two-shot
//! all_reduce and reduce_scatter for f32 / f16 / bf16 × sum / min / max / avg, all_gather and
//! all_to_all (equal and v form, chunked through slots), × world sizes 2, 3, 4, 8 × sizes from
//! one element to 64 MiB (above the window's 1 MiB, in chunks), against a host reference;
//! every rank's all_reduce result bitwise equal, and equal between the two algorithms; a
//! mismatched all_to_all_v is reported (and, with `check_calls`, refused before it runs); calls
//! on two streams of a rank run in issue order; graph capture and replays with fresh inputs; the
//! multimem all_reduce where the GPU supports multicast. Skips with a reason without a GPU;
//! FERROCOMM_REQUIRE_GPU=1 turns a skip into a failure.

mod common;

use common::gpu::{bytes_of, from_bytes, view};
use common::*;
use ferrocomm::device;
use ferrocomm::device::cudarc::driver::{sys, CudaSlice, CudaStream};
use ferrocomm::{bf16, f16, Error};
use std::sync::{Arc, Barrier};

/// All ranks run `sizes` all_reduces of `T` under every op (with hint `algorithm` when given);
/// each result is checked against the host reduction of the inputs, and all ranks must agree
/// bit for bit. Returns rank 0's results.
fn sweep<T: TestElem + Clone>(world: usize, seed: u64, sizes: &[usize], algorithm: Option<&str>) -> Vec<Vec<u8>> {
    sweep_ops::<T>(world, seed, sizes, algorithm, &ALL_OPS)
}

const ALL_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

/// `sweep` over the reduce ops `ops` only.
fn sweep_ops<T: TestElem + Clone>(
    world: usize,
    seed: u64,
    sizes: &[usize],
    algorithm: Option<&str>,
    ops: &[ReduceOp],
) -> Vec<Vec<u8>> {
    let comms = Comm::new_group(
        "device",
        &vec![Device::Cuda(0); world],
        &format!("own-{world}-{:?}", T::DTYPE),
        options(Duration::from_secs(60)),
    )
    .unwrap();
    let results: Vec<Vec<Vec<u8>>> = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                sc.spawn(move || {
                    let s = device::new_stream(0).unwrap();
                    let _current = device::use_stream(&s);
                    let opts = algorithm.map_or(OpOptions::new(), |a| OpOptions::new().hint("algorithm", a));
                    let mut out = Vec::new();
                    for (k, &n) in sizes.iter().enumerate() {
                        for &op in ops {
                            let x: Vec<T> = random_vec(&mut rng(seed ^ k as u64, c.rank() as u64), n, Some(op));
                            let mut mem = s.clone_htod(bytes_of(&x)).unwrap();
                            c.with_options(opts.clone())
                                .all_reduce(view::<T>(&mut mem, &s), op)
                                .unwrap();
                            let got = s.clone_dtoh(&mem).unwrap();
                            s.synchronize().unwrap();
                            out.push(got);
                        }
                    }
                    c.finalize().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut i = 0;
    for (k, &n) in sizes.iter().enumerate() {
        for &op in ops {
            for r in 1..world {
                assert_eq!(results[r][i], results[0][i], "rank {r} differs from rank 0: n={n} {op}");
            }
            let inputs: Vec<Vec<T>> = (0..world)
                .map(|r| random_vec(&mut rng(seed ^ k as u64, r as u64), n, Some(op)))
                .collect();
            let got: Vec<T> = from_bytes(&results[0][i]);
            for e in 0..n {
                let vals: Vec<T> = inputs.iter().map(|v| v[e]).collect();
                if let Err(why) = T::check_reduced(&vals, op, got[e]) {
                    panic!("world {world}, {:?}, n={n}, {op}, element {e}: {why}", T::DTYPE);
                }
            }
            i += 1;
        }
    }
    results.into_iter().next().unwrap()
}

const SIZES: &[usize] = &[1, 7, 8, 1000, 4099, 65_539, 262_144];

#[test]
fn gpu_one_shot_all_reduce_matches_the_host_reference() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    for world in [2, 3, 4, 8] {
        sweep::<f32>(world, seed, SIZES, Some("oneshot"));
        sweep::<f16>(world, seed, SIZES, Some("oneshot"));
        sweep::<bf16>(world, seed, SIZES, Some("oneshot"));
        // NCCL cannot reduce these: the own kernels, wrapping like the CPU engine.
        sweep::<i16>(world, seed, SIZES, Some("oneshot"));
        sweep::<u16>(world, seed, SIZES, Some("oneshot"));
    }
}

/// The two-shot kernel reduces in the same rank order as the one-shot: same bits.
#[test]
fn gpu_two_shot_all_reduce_matches_the_host_reference_and_the_one_shot_bits() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    for world in [2, 3, 4, 8] {
        let two = sweep::<f32>(world, seed, SIZES, Some("twoshot"));
        assert!(
            two == sweep::<f32>(world, seed, SIZES, Some("oneshot")),
            "world {world}: f32 bits differ"
        );
        let two = sweep::<bf16>(world, seed, SIZES, Some("twoshot"));
        assert!(
            two == sweep::<bf16>(world, seed, SIZES, Some("oneshot")),
            "world {world}: bf16 bits differ"
        );
        sweep::<f16>(world, seed, SIZES, Some("twoshot"));
        let two = sweep::<i16>(world, seed, SIZES, Some("twoshot"));
        assert!(
            two == sweep::<i16>(world, seed, SIZES, Some("oneshot")),
            "world {world}: i16 bits differ"
        );
    }
}

/// Without a hint the size picks the algorithm; both sides of FERROCOMM_DEVICE_TWOSHOT_MIN
/// (128 KiB) and mixed sizes in one sequence, so calls with different grids follow each other.
#[test]
fn gpu_all_reduce_by_size_mixes_grids_and_algorithms() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    let sizes = [65_536, 3, 262_144, 1000, 32_768 + 5, 200_000, 1];
    for world in [3, 8] {
        sweep::<f32>(world, seed, &sizes, None);
    }
}

/// The largest message the window holds in one launch (1 MiB of f32), and one more element,
/// which takes a second launch.
#[test]
fn gpu_one_shot_all_reduce_at_and_past_the_window_size() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    sweep::<f32>(2, seed, &[(1 << 20) / 4, (1 << 20) / 4 + 1], None);
}

/// A captured all_reduce replayed with fresh inputs each time: the kernel takes a new epoch on
/// every replay, so each result is that replay's reduction.
#[test]
fn gpu_one_shot_all_reduce_replays_from_a_cuda_graph() {
    if !gpu_or_skip() {
        return;
    }
    let world = 4;
    let n = 3000;
    let seed = fresh_seed();
    let comms = Comm::new_group(
        "device",
        &[Device::Cuda(0); 4],
        "own-graph",
        options(Duration::from_secs(60)),
    )
    .unwrap();
    let round_inputs = |round: u64, r: usize| -> Vec<f32> { random_vec(&mut rng(seed ^ round, r as u64), n, None) };
    let captured = Barrier::new(world);
    std::thread::scope(|sc| {
        for c in &comms {
            let (captured, round_inputs) = (&captured, &round_inputs);
            sc.spawn(move || {
                let s = device::new_stream(0).unwrap();
                let _current = device::use_stream(&s);
                let mut mem = s.alloc_zeros::<u8>(n * 4).unwrap();
                let graph = {
                    let buf = view::<f32>(&mut mem, &s);
                    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                        .unwrap();
                    c.all_reduce(buf, ReduceOp::Sum).unwrap();
                    s.end_capture(sys::CUgraphInstantiate_flags(0))
                        .unwrap()
                        .expect("a captured graph")
                };
                captured.wait();
                for round in 0..100u64 {
                    let x = round_inputs(round, c.rank());
                    s.memcpy_htod(bytes_of(&x), &mut mem).unwrap();
                    graph.launch().unwrap();
                    let got: Vec<f32> = from_bytes(&s.clone_dtoh(&mem).unwrap());
                    s.synchronize().unwrap();
                    for e in (0..n).step_by(97) {
                        let vals: Vec<f32> = (0..world).map(|r| round_inputs(round, r)[e]).collect();
                        if let Err(why) = f32::check_reduced(&vals, ReduceOp::Sum, got[e]) {
                            panic!("rank {} replay {round} element {e}: {why}", c.rank());
                        }
                    }
                }
            });
        }
    });
}

/// all_gather and all_to_all (exact copies) and reduce_scatter (block `rank` of the
/// reduction) on the kernels.
fn gather_and_scatter<T: TestElem + Clone>(world: usize, seed: u64, sizes: &[usize]) {
    let comms = Comm::new_group(
        "device",
        &vec![Device::Cuda(0); world],
        &format!("own-ag-rs-{world}-{:?}", T::DTYPE),
        options(Duration::from_secs(60)),
    )
    .unwrap();
    let ops = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];
    let input = |k: usize, r: usize, len: usize, op: Option<ReduceOp>| -> Vec<T> {
        random_vec(&mut rng(seed ^ (k as u64) << 8, r as u64), len, op)
    };
    std::thread::scope(|sc| {
        for c in &comms {
            sc.spawn(move || {
                let (me, s) = (c.rank(), device::new_stream(0).unwrap());
                let _current = device::use_stream(&s);
                for (k, &n) in sizes.iter().enumerate() {
                    // all_gather: rank r's n elements land in block r of everyone's output.
                    let mine = input(k, me, n, None);
                    let mut src = s.clone_htod(bytes_of(&mine)).unwrap();
                    let mut dst = s.clone_htod(bytes_of(&vec![T::poison(); n * world])).unwrap();
                    c.all_gather(view::<T>(&mut dst, &s), view::<T>(&mut src, &s)).unwrap();
                    let got: Vec<T> = from_bytes(&s.clone_dtoh(&dst).unwrap());
                    s.synchronize().unwrap();
                    let want: Vec<T> = (0..world).flat_map(|r| input(k, r, n, None)).collect();
                    assert!(got == want, "rank {me}: all_gather of {n} {:?} differs", T::DTYPE);
                    // all_to_all: block r of our output is block `me` of rank r's input.
                    let blocks = input(k + 2000, me, n * world, None);
                    let mut src = s.clone_htod(bytes_of(&blocks)).unwrap();
                    let mut dst = s.clone_htod(bytes_of(&vec![T::poison(); n * world])).unwrap();
                    c.all_to_all(view::<T>(&mut dst, &s), view::<T>(&mut src, &s)).unwrap();
                    let got: Vec<T> = from_bytes(&s.clone_dtoh(&dst).unwrap());
                    s.synchronize().unwrap();
                    let want: Vec<T> = (0..world)
                        .flat_map(|r| input(k + 2000, r, n * world, None)[me * n..(me + 1) * n].to_vec())
                        .collect();
                    assert!(
                        got == want,
                        "rank {me}: all_to_all of {n} {:?} per peer differs",
                        T::DTYPE
                    );
                    // reduce_scatter: block `me` of the reduction of every rank's world × n input.
                    for &op in &ops {
                        let all = input(k + 1000, me, n * world, Some(op));
                        let mut src = s.clone_htod(bytes_of(&all)).unwrap();
                        let mut dst = s.clone_htod(bytes_of(&vec![T::poison(); n])).unwrap();
                        c.reduce_scatter(view::<T>(&mut dst, &s), view::<T>(&mut src, &s), op)
                            .unwrap();
                        let got: Vec<T> = from_bytes(&s.clone_dtoh(&dst).unwrap());
                        s.synchronize().unwrap();
                        let inputs: Vec<Vec<T>> = (0..world).map(|r| input(k + 1000, r, n * world, Some(op))).collect();
                        for e in 0..n {
                            let vals: Vec<T> = inputs.iter().map(|v| v[me * n + e]).collect();
                            if let Err(why) = T::check_reduced(&vals, op, got[e]) {
                                panic!(
                                    "rank {me}, reduce_scatter {:?} n={n} {op}, element {e}: {why}",
                                    T::DTYPE
                                );
                            }
                        }
                    }
                    // reduce_scatter_list: the same with each rank's blocks in separate
                    // allocations (the kernel takes one pointer per block).
                    let all = input(k + 3000, me, n * world, Some(ReduceOp::Sum));
                    let mut blocks: Vec<CudaSlice<u8>> =
                        all.chunks(n).map(|b| s.clone_htod(bytes_of(b)).unwrap()).collect();
                    let mut dst = s.clone_htod(bytes_of(&vec![T::poison(); n])).unwrap();
                    let views = blocks.iter_mut().map(|b| view::<T>(b, &s)).collect();
                    c.reduce_scatter_list(view::<T>(&mut dst, &s), views, ReduceOp::Sum)
                        .unwrap();
                    let got: Vec<T> = from_bytes(&s.clone_dtoh(&dst).unwrap());
                    s.synchronize().unwrap();
                    let inputs: Vec<Vec<T>> = (0..world)
                        .map(|r| input(k + 3000, r, n * world, Some(ReduceOp::Sum)))
                        .collect();
                    for e in 0..n {
                        let vals: Vec<T> = inputs.iter().map(|v| v[me * n + e]).collect();
                        if let Err(why) = T::check_reduced(&vals, ReduceOp::Sum, got[e]) {
                            panic!(
                                "rank {me}, reduce_scatter_list {:?} n={n}, element {e}: {why}",
                                T::DTYPE
                            );
                        }
                    }
                }
                c.finalize().unwrap();
            });
        }
    });
}

#[test]
fn gpu_one_shot_all_gather_all_to_all_and_reduce_scatter_match_the_host_reference() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    for world in [2, 3, 4, 8] {
        let sizes = [1, 5, 8, 1000, 4099, (1 << 17) / world];
        gather_and_scatter::<f32>(world, seed, &sizes);
        gather_and_scatter::<f16>(world, seed, &sizes);
        gather_and_scatter::<bf16>(world, seed, &sizes);
    }
}

/// all_to_all_v with random per-pair counts (zeros, and parts larger than a slot, which take
/// several chunks), repeated with new counts: block r of our output is our part of rank r's
/// input.
#[test]
fn gpu_all_to_all_v_with_any_sizes_matches_the_host_reference() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    for world in [2, 3, 8] {
        let comms = Comm::new_group(
            "device",
            &vec![Device::Cuda(0); world],
            &format!("own-a2av-{world}"),
            options(Duration::from_secs(60)),
        )
        .unwrap();
        // counts[k][p][r]: elements rank p sends rank r in round k (a slot is 1 MiB / world).
        let counts = random_all_to_all_counts(seed, world, 6, 100_000..400_000);
        let input = |k: usize, p: usize| -> Vec<f32> {
            random_vec(
                &mut rng(seed ^ (k as u64) << 12, p as u64),
                counts[k][p].iter().sum(),
                None,
            )
        };
        std::thread::scope(|sc| {
            for c in &comms {
                let (counts, input) = (&counts, &input);
                sc.spawn(move || {
                    let (me, s) = (c.rank(), device::new_stream(0).unwrap());
                    let _current = device::use_stream(&s);
                    for (k, round) in counts.iter().enumerate() {
                        let send = &round[me];
                        let recv: Vec<usize> = (0..world).map(|p| round[p][me]).collect();
                        let mut src = s.clone_htod(bytes_of(&input(k, me))).unwrap();
                        let poison = vec![f32::poison(); recv.iter().sum::<usize>()];
                        let mut dst = s.clone_htod(bytes_of(&poison)).unwrap();
                        c.all_to_all_v(view::<f32>(&mut dst, &s), view::<f32>(&mut src, &s), &recv, send)
                            .unwrap();
                        let got: Vec<f32> = from_bytes(&s.clone_dtoh(&dst).unwrap());
                        s.synchronize().unwrap();
                        let mut at = 0;
                        for p in 0..world {
                            let theirs = input(k, p);
                            let from: usize = round[p][..me].iter().sum();
                            let want = &theirs[from..from + recv[p]];
                            assert!(
                                got[at..at + recv[p]] == *want,
                                "world {world} round {k}: rank {me}'s part from rank {p} ({} elements) differs",
                                recv[p]
                            );
                            at += recv[p];
                        }
                    }
                    c.finalize().unwrap();
                });
            }
        });
    }
}

/// Runs `f(comm, stream)` on `n` ranks on GPU 0 in this process, each on its own thread with a
/// stream of its own (made current by `f` where it wants); returns the results in rank order.
fn on_ranks<R: Send>(
    n: usize,
    name: &str,
    options: CommOptions,
    f: impl Fn(&Comm, &Arc<CudaStream>) -> R + Sync,
) -> Vec<R> {
    let comms = Comm::new_group("device", &vec![Device::Cuda(0); n], name, options).unwrap();
    std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| sc.spawn(|| f(c, &device::new_stream(0).unwrap())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// An all_to_all_v on the current stream `s` whose parts do not pair up: rank 1 expects 12
/// elements from rank 0, which sends 10.
fn mismatched_all_to_all_v(c: &Comm, s: &Arc<CudaStream>) -> ferrocomm::Result<()> {
    let (send, recv) = mismatched_all_to_all_v_counts(c.rank());
    let mut src = s.alloc_zeros::<u8>(4 * send.iter().sum::<usize>()).unwrap();
    let mut dst = s.alloc_zeros::<u8>(4 * recv.iter().sum::<usize>()).unwrap();
    let r = c.all_to_all_v(view::<f32>(&mut dst, s), view::<f32>(&mut src, s), &recv, &send);
    s.synchronize().unwrap();
    r
}

/// Calls of one communicator on two streams of a rank run one after the other (they share the
/// collective window): every rank alternates all_reduces between two streams with no wait in
/// between, and each result matches the host reference.
#[test]
fn gpu_calls_on_two_streams_run_in_issue_order() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    let (world, calls, n) = (4, 16, 70_001);
    let input =
        |k: usize, r: usize| -> Vec<f32> { random_vec(&mut rng(seed ^ k as u64, r as u64), n, Some(ReduceOp::Sum)) };
    let results = on_ranks(
        world,
        "own-two-streams",
        options(Duration::from_secs(60)),
        |c, first| {
            let streams = [first.clone(), device::new_stream(0).unwrap()];
            let mut mems = Vec::new();
            for k in 0..calls {
                let s = &streams[k % 2];
                let mut mem = s.clone_htod(bytes_of(&input(k, c.rank()))).unwrap();
                let _current = device::use_stream(s);
                c.all_reduce(view::<f32>(&mut mem, s), ReduceOp::Sum).unwrap();
                mems.push(mem);
            }
            let out: Vec<Vec<u8>> = mems
                .iter()
                .enumerate()
                .map(|(k, m)| streams[k % 2].clone_dtoh(m).unwrap())
                .collect();
            streams.iter().for_each(|s| s.synchronize().unwrap());
            c.finalize().unwrap();
            out
        },
    );
    for k in 0..calls {
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(k, r)).collect();
        for (r, rank_results) in results.iter().enumerate() {
            let got: Vec<f32> = from_bytes(&rank_results[k]);
            for e in 0..n {
                let vals: Vec<f32> = inputs.iter().map(|v| v[e]).collect();
                if let Err(why) = f32::check_reduced(&vals, ReduceOp::Sum, got[e]) {
                    panic!("rank {r}, call {k} (stream {}), element {e}: {why}", k % 2);
                }
            }
        }
    }
}

/// The mismatched all_to_all_v: rank 1's kernel records the mismatch, and rank 1's next call
/// reports it, naming rank 0.
#[test]
fn gpu_mismatched_all_to_all_v_is_reported_by_the_receiver() {
    if !gpu_or_skip() {
        return;
    }
    let errors = on_ranks(2, "own-a2av-mismatch", options(Duration::from_secs(5)), |c, s| {
        let _current = device::use_stream(s);
        mismatched_all_to_all_v(c, s).unwrap();
        // The next call reports what the kernel recorded.
        let mut more = s.alloc_zeros::<u8>(16).unwrap();
        let e = c.all_reduce(view::<f32>(&mut more, s), ReduceOp::Sum).err();
        s.synchronize().unwrap();
        e
    });
    match &errors[1] {
        Some(Error::Mismatch { peer: 0, detail, .. }) => assert!(detail.contains("40 bytes"), "{detail}"),
        other => panic!("rank 1 should report rank 0's mismatched part, got {other:?}"),
    }
}

/// The same mismatched all_to_all_v with `check_calls` on: both ranks get `Error::Mismatch`
/// from the call itself, before a kernel runs, and the communicator goes on working.
#[test]
fn gpu_mismatched_calls_are_refused_up_front_with_the_check_on() {
    if !gpu_or_skip() {
        return;
    }
    let checked = options(Duration::from_secs(5)).with_check_calls(true);
    let results = on_ranks(2, "own-checked", checked, |c, s| {
        let _current = device::use_stream(s);
        let e = mismatched_all_to_all_v(c, s).expect_err("the mismatched all_to_all_v was issued");
        let mut one = s.clone_htod(bytes_of(&[c.rank() as f32 + 1.0])).unwrap();
        c.all_reduce(view::<f32>(&mut one, s), ReduceOp::Sum).unwrap();
        let got = s.clone_dtoh(&one).unwrap();
        s.synchronize().unwrap();
        (e, from_bytes::<f32>(&got)[0])
    });
    for (rank, (e, sum)) in results.iter().enumerate() {
        assert!(
            matches!(e, Error::Mismatch { op: "all_to_all", peer, .. } if *peer == 1 - rank),
            "rank {rank}: {e}"
        );
        assert_eq!(*sum, 3.0, "rank {rank}: the all_reduce after the refused call");
    }
}

/// Ranks of one process on one GPU without a stream of their own would queue their kernels
/// one behind the other on the legacy stream, each waiting for the next: refused up front.
#[test]
fn gpu_ranks_sharing_a_gpu_on_the_legacy_stream_are_refused() {
    if !gpu_or_skip() {
        return;
    }
    on_ranks(2, "own-legacy", options(Duration::from_secs(5)), |c, s| {
        let mut mem = s.alloc_zeros::<u8>(64).unwrap();
        s.synchronize().unwrap();
        // No use_stream guard: the legacy default stream.
        let e = c.all_reduce(view::<f32>(&mut mem, s), ReduceOp::Sum).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { .. }) && e.to_string().contains("stream each"),
            "{e}"
        );
        // With a stream of its own the same call runs.
        let _current = device::use_stream(s);
        c.all_reduce(view::<f32>(&mut mem, s), ReduceOp::Sum).unwrap();
        s.synchronize().unwrap();
    });
}

/// The multimem all_reduce (kernels/multimem.cu) where GPU 0 supports multicast: one rank is
/// the only team one GPU can form, so the switch reduces over one segment, which still runs
/// the whole kernel (copy in, load-reduce and store through the multicast address, copy out)
/// against the host reference. Ranks sharing the GPU have no multicast object: the hint cannot
/// be honoured there and is ignored (the size rule's kernel runs), and so is it for a pair the
/// switch does not reduce.
#[test]
fn gpu_multimem_all_reduce_where_multicast_exists() {
    if !gpu_or_skip() {
        return;
    }
    on_ranks(2, "multimem-shared", options(Duration::from_secs(30)), |c, s| {
        let _current = device::use_stream(s);
        let mut mem = s.clone_htod(bytes_of(&[c.rank() as f32 + 1.0; 16])).unwrap();
        c.with_options(OpOptions::new().hint("algorithm", "multimem"))
            .all_reduce(view::<f32>(&mut mem, s), ReduceOp::Sum)
            .unwrap();
        let got: Vec<f32> = from_bytes(&s.clone_dtoh(&mem).unwrap());
        assert_eq!(got, vec![3.0; 16]);
    });
    if !device::multicast_supported(0).unwrap() {
        eprintln!("SKIPPED (in part): GPU 0 does not support multicast objects (needs sm_90+ behind NVSwitch)");
        return;
    }
    let seed = fresh_seed();
    let multimem = Some("multimem");
    sweep_ops::<f32>(1, seed, SIZES, multimem, &[ReduceOp::Sum, ReduceOp::Avg]);
    sweep_ops::<f16>(1, seed, SIZES, multimem, &[ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max]);
    sweep_ops::<bf16>(1, seed, SIZES, multimem, &[ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max]);
    let comms = Comm::new_group(
        "device",
        &[Device::Cuda(0)],
        "multimem-refused",
        options(Duration::from_secs(30)),
    )
    .unwrap();
    let s = device::new_stream(0).unwrap();
    let _current = device::use_stream(&s);
    let mut mem = s.clone_htod(bytes_of(&[-2.5f32; 16])).unwrap();
    comms[0]
        .with_options(OpOptions::new().hint("algorithm", "multimem"))
        .all_reduce(view::<f32>(&mut mem, &s), ReduceOp::Min)
        .unwrap();
    let got: Vec<f32> = from_bytes(&s.clone_dtoh(&mem).unwrap());
    assert_eq!(got, vec![-2.5; 16]);
}

/// Messages above the collective window's 1 MiB region run as consecutive launches over
/// chunks: all_reduce by size (two-shot) and one-shot up to 64 MiB of f32, bf16 sums, all
/// checked against the host reference and equal on every rank.
#[test]
fn gpu_all_reduce_above_the_window_runs_in_chunks() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    let sizes = [262_145, 1_000_003, 16 << 20];
    for world in [2, 4] {
        sweep_ops::<f32>(world, seed, &sizes, None, &[ReduceOp::Sum, ReduceOp::Max]);
        sweep_ops::<bf16>(world, seed, &sizes[..2], Some("oneshot"), &[ReduceOp::Sum]);
    }
}

/// all_gather and reduce_scatter parts above what one launch takes (1 MiB, and 1 MiB / world
/// for reduce_scatter's blocks) run in chunks too; all_to_all of the same sizes alongside.
#[test]
fn gpu_all_gather_and_reduce_scatter_above_the_window_run_in_chunks() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    gather_and_scatter::<f32>(3, seed, &[300_001, 1 << 20]);
    gather_and_scatter::<bf16>(2, seed, &[700_000]);
}
