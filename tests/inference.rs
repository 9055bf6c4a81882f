//! The inference collectives on the CPU backend (the oracle): the fused all_reduce + residual +
#![allow(clippy::needless_range_loop)] // index loops mirror the formulas they check
//! RMSNorm and MoE dispatch / combine against f64 references, bit-identical across ranks and
//! runs, and their errors. The host device runs the same suite (tests/host_device.rs).

mod common;
use common::inference_suite::{fused_norm, fused_norm_with, moe, MoeCase, Routing};
use common::*;
use ferrocomm::{bf16, f16, Combine, Dispatch, Error, MoeShape, F8E4M3};

const CPU: Device = Device::Cpu;

#[test]
fn fused_norm_matches_the_reference_for_every_dtype_world_and_algorithm() {
    for world in [1, 2, 3, 4] {
        for hint in [Some("oneshot"), Some("twoshot"), None] {
            fused_norm::<f32>("cpu", CPU, world, 5, 129, hint, false);
            fused_norm::<bf16>("cpu", CPU, world, 7, 64, hint, false);
        }
    }
    fused_norm::<f16>("cpu", CPU, 3, 17, 1000, Some("twoshot"), false);
    fused_norm::<f16>("cpu", CPU, 2, 1, 1, None, false);
    fused_norm::<bf16>("cpu", CPU, 2, 1, 7, Some("twoshot"), false);
}

#[test]
fn fused_norm_runs_from_one_to_4096_tokens() {
    for tokens in [1, 2, 31, 256] {
        fused_norm::<bf16>("cpu", CPU, 4, tokens, 256, None, false);
    }
    fused_norm::<f32>("cpu", CPU, 2, 4096, 16, Some("oneshot"), false);
    fused_norm::<bf16>("cpu", CPU, 4, 4096, 16, Some("twoshot"), false);
}

#[test]
fn fused_norm_with_fp8_output_dequantises_to_the_reference() {
    for (world, hint) in [(1, None), (2, Some("oneshot")), (4, Some("twoshot"))] {
        fused_norm::<bf16>("cpu", CPU, world, 9, 512, hint, true);
        fused_norm::<f32>("cpu", CPU, world, 3, 33, hint, true);
    }
}

#[test]
fn fused_norm_over_tcp_matches_too() {
    // Every rank a "host" of its own.
    for hint in ["oneshot", "twoshot"] {
        let tcp = tcp_options(Duration::from_secs(30));
        fused_norm_with::<bf16>("cpu", CPU, tcp, 3, (11, 96), Some(hint), false);
    }
}

#[test]
fn fused_norm_refuses_bad_arguments_before_anything_moves() {
    let results = run_group(1, "norm-bad", options(Duration::from_secs(5)), |c| {
        let (x, mut res, gamma, mut out) = (vec![0f32; 8], vec![0f32; 8], vec![1f32; 3], vec![0f32; 8]);
        let rows = c.all_reduce_residual_rmsnorm(&x, &mut res, &gamma, &mut out, 1e-6);
        let (mut short, g4) = (vec![0f32; 4], vec![1f32; 4]);
        let size = c.all_reduce_residual_rmsnorm(&x, &mut res, &g4, &mut short, 1e-6);
        let eps = c.all_reduce_residual_rmsnorm(&x, &mut res, &g4, &mut out, f32::NAN);
        let (xi, mut ri, gi, mut oi) = (vec![0i32; 8], vec![0i32; 8], vec![1i32; 4], vec![0i32; 8]);
        let dtype = c.all_reduce_residual_rmsnorm(&xi, &mut ri, &gi, &mut oi, 0.0);
        let (mut q, mut scales) = (vec![F8E4M3::default(); 8], vec![0f32; 3]);
        let scale_count = c.all_reduce_residual_rmsnorm_fp8(&x, &mut res, &g4, &mut q, &mut scales, 0.0);
        (rows, size, eps, dtype, scale_count)
    });
    let (rows, size, eps, dtype, scale_count) = &results[0];
    assert!(
        matches!(rows, Err(Error::InvalidArgument { reason, .. }) if reason.contains("whole rows")),
        "{rows:?}"
    );
    assert!(
        matches!(size, Err(Error::SizeMismatch { what, .. }) if what == "out"),
        "{size:?}"
    );
    assert!(
        matches!(eps, Err(Error::InvalidArgument { reason, .. }) if reason.contains("eps")),
        "{eps:?}"
    );
    assert!(
        matches!(dtype, Err(Error::InvalidArgument { reason, .. }) if reason.contains("f32, f16 or bf16")),
        "{dtype:?}"
    );
    assert!(
        matches!(scale_count, Err(Error::SizeMismatch { expected: 2, .. })),
        "{scale_count:?}"
    );
}

#[test]
fn fused_norm_with_a_different_row_length_on_one_rank_is_a_mismatch() {
    let results = run_group(2, "norm-mismatch", options(Duration::from_secs(10)), |c| {
        // The same element count, cut into rows of 4 on rank 0 and of 8 on rank 1.
        let hidden = 4 * (c.rank() + 1);
        let (x, mut res, gamma, mut out) = (vec![1f32; 16], vec![0f32; 16], vec![1f32; hidden], vec![0f32; 16]);
        c.all_reduce_residual_rmsnorm(&x, &mut res, &gamma, &mut out, 0.0)
    });
    for (r, got) in results.iter().enumerate() {
        assert!(matches!(got, Err(Error::Mismatch { .. })), "rank {r}: {got:?}");
    }
}

fn shape(experts: usize, topk: usize, hidden: usize, capacity: usize) -> MoeShape {
    MoeShape {
        experts,
        topk,
        hidden,
        capacity,
    }
}

#[test]
fn moe_dispatch_and_combine_match_the_reference_at_every_world_and_k() {
    for world in [1, 2, 4, 8] {
        for topk in [1, 8] {
            let case = MoeCase {
                world,
                tokens: 13,
                shape: shape(16, topk, 33, 13 * world),
                routing: Routing::Random,
                halves: false,
            };
            moe::<bf16>("cpu", CPU, case);
        }
    }
    let case = MoeCase {
        world: 2,
        tokens: 9,
        shape: shape(4, 2, 8, 18),
        routing: Routing::Random,
        halves: false,
    };
    moe::<f32>("cpu", CPU, case);
    moe::<f16>("cpu", CPU, case);
}

#[test]
fn moe_with_skewed_routing_all_to_one_expert_and_experts_without_tokens() {
    for (world, topk) in [(4, 1), (4, 8), (2, 3)] {
        let tokens = 17;
        let case = MoeCase {
            world,
            tokens,
            shape: shape(8 * world, topk, 24, tokens * world),
            routing: Routing::AllToOne,
            halves: false,
        };
        let got = moe::<bf16>("cpu", CPU, case);
        // Rank 0 has every row; the others none.
        assert!(got[0].0.iter().take(topk).all(|&c| c as usize == tokens * world));
        assert!(got[1..].iter().all(|g| g.0.iter().all(|&c| c == 0)));
        let sparse = MoeCase {
            routing: Routing::LastRankSparse,
            ..case
        };
        moe::<bf16>("cpu", CPU, sparse);
    }
}

#[test]
fn moe_halves_run_as_separate_calls_with_compute_between() {
    for world in [1, 3] {
        let case = MoeCase {
            world,
            tokens: 6,
            shape: shape(6, 2, 16, 6 * world),
            routing: Routing::Random,
            halves: true,
        };
        moe::<bf16>("cpu", CPU, case);
    }
}

#[test]
fn moe_fp8_tokens_travel_with_their_block_scales() {
    let (world, tokens, hidden) = (2, 5, 256);
    let s = shape(4, 2, hidden, tokens * world);
    let got = run_group(world, "moe-fp8", options(Duration::from_secs(10)), |c| {
        let x: Vec<F8E4M3> = (0..tokens * hidden)
            .map(|i| F8E4M3::from_f32(((i * 7 + c.rank()) % 200) as f32 / 10.0 - 10.0))
            .collect();
        let scales: Vec<f32> = (0..tokens * 2).map(|i| (i + 100 * c.rank()) as f32).collect();
        let ids: Vec<i32> = (0..tokens)
            .flat_map(|t| [(t % 4) as i32, ((t + 1) % 4) as i32])
            .collect();
        let local = 2;
        let mut recv = vec![F8E4M3::default(); local * s.capacity * hidden];
        let mut recv_scales = vec![-1f32; local * s.capacity * 2];
        let (mut counts, mut src) = (vec![0i32; local], vec![0i32; local * s.capacity * 3]);
        let d = Dispatch::send(&x, &ids)
            .scales(&scales)
            .recv(&mut recv, &mut counts, &mut src)
            .recv_scales(&mut recv_scales);
        c.moe_dispatch(s, d).unwrap();
        (x, scales, recv, recv_scales, counts, src)
    });
    for (me, (_, _, recv, recv_scales, counts, src)) in got.iter().enumerate() {
        for e in 0..2 {
            for i in 0..counts[e] as usize {
                let slot = e * s.capacity + i;
                let (r, t) = (src[slot * 3] as usize, src[slot * 3 + 1] as usize);
                let (x, scales) = (&got[r].0, &got[r].1);
                assert_eq!(
                    &recv[slot * hidden..][..hidden],
                    &x[t * hidden..][..hidden],
                    "rank {me} slot {slot}"
                );
                assert_eq!(
                    &recv_scales[slot * 2..][..2],
                    &scales[t * 2..][..2],
                    "rank {me} slot {slot} scales"
                );
            }
        }
    }
}

#[test]
fn moe_capacity_overflow_is_an_error_never_a_silent_drop() {
    let s = shape(2, 1, 4, 3);
    let got = run_group(2, "moe-overflow", options(Duration::from_secs(10)), |c| {
        let x = vec![1f32; 5 * 4];
        let ids = vec![0i32; 5]; // 10 rows for expert 0 on rank 0, capacity 3
        let (mut recv, mut counts, mut src) = (vec![0f32; 3 * 4], vec![0i32; 1], vec![0i32; 9]);
        let r = c.moe_dispatch(s, Dispatch::send(&x, &ids).recv(&mut recv, &mut counts, &mut src));
        // The communicator is still usable afterwards.
        let mut y = [1u8];
        c.all_reduce(&mut y[..], ReduceOp::Sum).unwrap();
        (r, counts[0], y[0])
    });
    match &got[0].0 {
        Err(Error::CapacityExceeded {
            count: 10, capacity: 3, ..
        }) => {}
        other => panic!("rank 0: {other:?}"),
    }
    assert_eq!(got[0].1, 10, "the count says how many came");
    assert!(got[1].0.is_ok(), "rank 1 received nothing: {:?}", got[1].0);
    assert_eq!((got[0].2, got[1].2), (2, 2));
}

/// A combine row that answers a dropped k (id -1) is stray, even from the rank that would own
/// expert "-1 / local experts" by integer division; the token it spoils keeps its old bits.
#[test]
fn moe_combine_refuses_a_row_for_a_dropped_k() {
    let s = shape(4, 2, 4, 4);
    let got = run_group(2, "moe-dropped-k", options(Duration::from_secs(10)), |c| {
        let x = vec![1f32; 4];
        let ids = if c.rank() == 0 { [0i32, -1] } else { [2, -1] };
        let (mut recv, mut counts, mut src) = (vec![0f32; 2 * 4 * 4], vec![0i32; 2], vec![0i32; 2 * 4 * 3]);
        c.moe_dispatch(s, Dispatch::send(&x, &ids).recv(&mut recv, &mut counts, &mut src))
            .unwrap();
        if c.rank() == 0 {
            // Row 0 of expert 0 is (rank 0, token 0, k 0): say k 1, whose id is -1.
            assert_eq!(&src[..3], &[0, 0, 0]);
            src[2] = 1;
        }
        let mut out = vec![-7f32; 4];
        let r = c.moe_combine(
            s,
            Combine::send(&recv, &src, &counts).recv(&ids, &[1.0f32, 1.0], &mut out),
        );
        (r, out)
    });
    match &got[0].0 {
        Err(Error::InvalidArgument { reason, .. })
            if reason.contains("rank 0 returned a row for token 0, k = 1, which it was not sent") => {}
        other => panic!("rank 0: {other:?}"),
    }
    assert_eq!(got[0].1, [-7f32; 4], "rank 0's token lost its row: its output stays");
    assert!(got[1].0.is_ok(), "rank 1: {:?}", got[1].0);
    assert_eq!(got[1].1, [1f32; 4], "rank 1's token came back whole");
}

#[test]
fn moe_refuses_bad_routing_and_shapes() {
    let got = run_group(2, "moe-bad", options(Duration::from_secs(10)), |c| {
        let x = vec![1f32; 2 * 4];
        let (mut recv, mut counts, mut src) = (vec![0f32; 2 * 4 * 4], vec![0i32; 2], vec![0i32; 2 * 4 * 3]);
        let bad_id = c.moe_dispatch(shape(4, 1, 4, 4), Dispatch::send(&x, &[0i32, 9]));
        let uneven = c.moe_dispatch(shape(3, 1, 4, 4), Dispatch::send(&x, &[0i32, 1]));
        let recv_first = c.moe_dispatch(
            shape(4, 1, 4, 4),
            Dispatch::recv_only().recv(&mut recv, &mut counts, &mut src),
        );
        let bad_src = c.moe_combine(
            shape(4, 1, 4, 4),
            Combine::send(&recv, &vec![5i32; 2 * 4 * 3], &[1i32, 0]),
        );
        (bad_id, uneven, recv_first, bad_src)
    });
    for (bad_id, uneven, recv_first, bad_src) in &got {
        assert!(
            matches!(bad_id, Err(Error::InvalidArgument { reason, .. }) if reason.contains("topk_idx[1] = 9")),
            "{bad_id:?}"
        );
        assert!(
            matches!(uneven, Err(Error::InvalidArgument { reason, .. }) if reason.contains("evenly")),
            "{uneven:?}"
        );
        assert!(
            matches!(recv_first, Err(Error::InvalidArgument { reason, .. }) if reason.contains("without a send half")),
            "{recv_first:?}"
        );
        assert!(
            matches!(bad_src, Err(Error::InvalidArgument { reason, .. }) if reason.contains("src[0, 0]")),
            "{bad_src:?}"
        );
    }
}

#[test]
fn fp8_elements_move_exactly_and_reduce_in_f32_rounded_per_step() {
    let world = 3;
    let got = run_group(world, "fp8-moves", options(Duration::from_secs(10)), |c| {
        let mine: Vec<F8E4M3> = (0..64)
            .map(|i| F8E4M3::from_bits((i * 3 + c.rank() * 5) as u8 & 0x7E))
            .collect();
        let mut all = vec![F8E4M3::default(); 64 * world];
        c.all_gather(&mut all, &mine).unwrap();
        let mut sum = mine.clone();
        c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
        let bits = c.all_reduce(&mut sum.clone(), ReduceOp::BXor);
        (mine, all, sum, bits)
    });
    for (r, (_, all, sum, bits)) in got.iter().enumerate() {
        for (p, g) in got.iter().enumerate() {
            assert_eq!(&all[p * 64..(p + 1) * 64], &g.0[..], "rank {r}: rank {p}'s block");
        }
        for i in 0..64 {
            // Rank order, one rounding per step (as every f16/bf16 reduction of the CPU engine).
            let want = (1..world).fold(got[0].0[i], |acc, p| {
                F8E4M3::from_f32(acc.to_f32() + got[p].0[i].to_f32())
            });
            assert_eq!(sum[i], want, "rank {r} element {i}");
        }
        assert!(
            matches!(bits, Err(Error::UnsupportedReduce { dtype: "f8e4m3", .. })),
            "{bits:?}"
        );
    }
}

#[test]
fn moe_normal_mode_sizes_the_buffers_from_exchanged_counts() {
    let (world, tokens, topk, experts, hidden) = (4, 23, 3, 8, 16);
    let seed = fresh_seed();
    let got = run_group(world, "moe-normal", options(Duration::from_secs(10)), |c| {
        let mut r = rng(seed, c.rank() as u64);
        // Skewed: expert 5 is in every token's top-k.
        let ids: Vec<i64> = (0..tokens)
            .flat_map(|_| [5, r.gen_range(0..5), r.gen_range(6..8)])
            .collect();
        let counts = c.moe_expert_counts(experts, &ids).unwrap();
        let capacity = *counts.iter().max().unwrap();
        let s = shape(experts, topk, hidden, capacity);
        let local = experts / world;
        let x = vec![1f32; tokens * hidden];
        let (mut recv, mut got_counts, mut src) = (
            vec![0f32; local * capacity * hidden],
            vec![0i32; local],
            vec![0i32; local * capacity * 3],
        );
        c.moe_dispatch(s, Dispatch::send(&x, &ids).recv(&mut recv, &mut got_counts, &mut src))
            .unwrap();
        (counts, capacity, got_counts)
    });
    for (r, (counts, capacity, got_counts)) in got.iter().enumerate() {
        assert_eq!(counts, &got[0].0, "every rank learns the same counts");
        assert_eq!(*capacity, tokens * world, "expert 5 gets every token of every rank");
        let local = experts / world;
        let mine: Vec<i32> = counts[r * local..(r + 1) * local].iter().map(|&c| c as i32).collect();
        assert_eq!(
            got_counts, &mine,
            "rank {r}: the dispatch delivers what the counts said"
        );
    }
}

/// Runs `call` on `world` ranks, rank `culprit` with a bad argument (`call(c, true)`), then
/// once more with good ones everywhere, then an all_reduce. The culprit gets its own argument
/// error (whose text contains `why`); every other rank gets an argument error naming the
/// culprit and saying `why`, well before the timeout (it does not wait for the culprit); and
/// the communicator works afterwards.
fn one_rank_refuses(
    world: usize,
    culprit: usize,
    name: &str,
    why: &str,
    call: impl Fn(&Comm, bool) -> ferrocomm::Result<()> + Sync,
) {
    let timeout = Duration::from_secs(10);
    let got = run_group(world, name, options(timeout), |c| {
        let t0 = std::time::Instant::now();
        let bad = call(c, c.rank() == culprit);
        let took = t0.elapsed();
        let good = call(c, false);
        let mut y = [1u32];
        let after = c.all_reduce(&mut y[..], ReduceOp::Sum).map(|()| y[0]);
        (bad, took, good, after)
    });
    for (r, (bad, took, good, after)) in got.iter().enumerate() {
        match bad {
            Err(e) if r == culprit => assert!(e.to_string().contains(why), "rank {r} (the culprit): {e}"),
            Err(Error::InvalidArgument { reason, .. }) => assert!(
                reason.contains(&format!("rank {culprit} refused its call")) && reason.contains(why),
                "rank {r}: {reason}"
            ),
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(*took < timeout / 2, "rank {r} waited {took:?} for the culprit");
        assert!(good.is_ok(), "rank {r}, the call again with good arguments: {good:?}");
        assert_eq!(after.as_ref().ok(), Some(&(world as u32)), "rank {r}: {after:?}");
    }
}

#[test]
fn a_bad_expert_id_on_one_rank_fails_every_rank_at_once_naming_it() {
    let s = shape(6, 2, 4, 3 * 3);
    one_rank_refuses(3, 1, "moe-one-bad-id", "topk_idx[3] = 99", |c, bad| {
        let x = vec![1f32; 3 * 4];
        let ids = [0i32, 1, 2, if bad { 99 } else { 3 }, 4, 5];
        let (mut recv, mut counts, mut src) = (vec![0f32; 2 * 9 * 4], vec![0i32; 2], vec![0i32; 2 * 9 * 3]);
        c.moe_dispatch(s, Dispatch::send(&x, &ids).recv(&mut recv, &mut counts, &mut src))
    });
}

#[test]
fn a_bad_combine_source_on_one_rank_fails_every_rank_at_once_naming_it() {
    let s = shape(4, 1, 4, 2 * 2);
    one_rank_refuses(2, 0, "moe-one-bad-src", "src[0, 0] = (7, ", |c, bad| {
        let x = vec![1f32; 2 * 4];
        let ids = [0i32, 3];
        let (mut recv, mut counts, mut src) = (vec![0f32; 2 * 4 * 4], vec![0i32; 2], vec![0i32; 2 * 4 * 3]);
        c.moe_dispatch(s, Dispatch::send(&x, &ids).recv(&mut recv, &mut counts, &mut src))?;
        if bad {
            src[0] = 7; // row 0 of expert 0 "came from" rank 7
        }
        let mut out = vec![0f32; 2 * 4];
        c.moe_combine(
            s,
            Combine::send(&recv, &src, &counts).recv(&ids, &[1.0f32, 1.0], &mut out),
        )
    });
}

#[test]
fn a_wrong_buffer_size_on_one_rank_fails_every_rank_at_once_naming_it() {
    let s = shape(4, 1, 4, 2 * 4);
    one_rank_refuses(
        4,
        3,
        "moe-one-short",
        "topk_idx has 1 elements, expected 2",
        |c, bad| {
            let x = vec![1f32; 2 * 4];
            let ids: &[i32] = if bad { &[0] } else { &[0, 3] };
            let (mut recv, mut counts, mut src) = (vec![0f32; 8 * 4], vec![0i32; 1], vec![0i32; 8 * 3]);
            c.moe_dispatch(s, Dispatch::send(&x, ids).recv(&mut recv, &mut counts, &mut src))
        },
    );
}

#[test]
fn a_bad_norm_argument_on_one_rank_fails_every_rank_at_once_naming_it() {
    // gamma of 5 elements on the culprit: x's 16 elements are not whole rows of 5 (found by the
    // communicator's checks, before the backend runs it).
    one_rank_refuses(3, 2, "norm-one-bad-gamma", "not whole rows of hidden = 5", |c, bad| {
        let (x, mut res, mut out) = (vec![1f32; 16], vec![0f32; 16], vec![0f32; 16]);
        let gamma = vec![1f32; if bad { 5 } else { 4 }];
        c.all_reduce_residual_rmsnorm(&x, &mut res, &gamma, &mut out, 1e-6)
    });
    // An algorithm hint that the backend refuses (found by the CPU engine), one- and two-shot.
    for tokens in [2, 64] {
        one_rank_refuses(2, 0, "norm-one-bad-hint", "hint algorithm=\"threeshot\"", |c, bad| {
            let (x, mut res, mut out) = (
                vec![1f32; tokens * 512],
                vec![0f32; tokens * 512],
                vec![0f32; tokens * 512],
            );
            let o = match (bad, tokens) {
                (true, _) => OpOptions::new().hint("algorithm", "threeshot"),
                (false, 2) => OpOptions::new().hint("algorithm", "oneshot"),
                (false, _) => OpOptions::new().hint("algorithm", "twoshot"),
            };
            c.with_options(o)
                .all_reduce_residual_rmsnorm(&x, &mut res, &vec![1f32; 512], &mut out, 1e-6)
        });
    }
}

/// Ranks that call MoE dispatch with different shapes: `Error::Mismatch` on every rank, naming
/// the field and a rank of the other shape, well before the timeout (the shapes
/// travel with the count exchange, before any row).
#[test]
fn a_moe_shape_that_differs_on_one_rank_is_a_mismatch_on_every_rank() {
    let timeout = Duration::from_secs(10);
    let good = shape(6, 2, 4, 9);
    for (field, odd) in [
        ("topk", shape(6, 1, 4, 9)),
        ("experts", shape(3, 2, 4, 9)),
        ("capacity", shape(6, 2, 4, 8)),
        ("hidden", shape(6, 2, 8, 9)),
    ] {
        let got = run_group(3, &format!("moe-shape-{field}"), options(timeout), |c| {
            let s = if c.rank() == 1 { odd } else { good };
            let local = s.experts / 3;
            let x = vec![1f32; 3 * s.hidden];
            let ids: Vec<i32> = (0..3 * s.topk).map(|i| (i % s.experts) as i32).collect();
            let (mut recv, mut counts, mut src) = (
                vec![0f32; local * s.capacity * s.hidden],
                vec![0i32; local],
                vec![0i32; local * s.capacity * 3],
            );
            let t0 = std::time::Instant::now();
            let r = c.moe_dispatch(s, Dispatch::send(&x, &ids).recv(&mut recv, &mut counts, &mut src));
            (r, t0.elapsed())
        });
        for (r, (got, took)) in got.iter().enumerate() {
            // The first mismatch any rank found (the fault record): every rank but 1 sees rank
            // 1 named, as the peer or in the detail.
            assert!(
                matches!(got, Err(Error::Mismatch { peer, detail, .. })
                    if detail.contains(field) && (r == 1 || *peer == 1 || detail.contains("rank 1"))),
                "rank {r}, {field}: {got:?}"
            );
            assert!(*took < timeout / 2, "rank {r} waited {took:?}");
        }
    }
}
