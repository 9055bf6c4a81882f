//! The inference collectives on device buffers with every rank on GPU 0 in this process: the
//! fused all_reduce + residual + RMSNorm (one- and two-shot, bf16 and fp8 out, and its steps
//! apart: the hint `unfused`) and MoE
//! dispatch / combine (bf16, K = 1 and 8, skewed routing, separate halves), checked with the
//! same references as the CPU backend (tests/common/inference_suite.rs), every rank's bits
//! equal. NCCL cannot serve ranks that share a GPU, so these take the device backend's own path.
//! Skips with a reason without a GPU; FERROCOMM_REQUIRE_GPU=1 turns a skip into a failure.

mod common;

use common::gpu::{bytes_of, from_bytes, input, norm_on_gpu, view};
use common::inference_suite::{check_moe_rank, check_norm, expert_factor, moe_inputs, MoeCase, MoeResult, Routing};
use common::*;
use ferrocomm::device;
use ferrocomm::device::cudarc::driver::{CudaSlice, CudaStream};
use ferrocomm::{bf16, Combine, Dispatch, MoeShape};
use std::sync::Arc;

fn on_ranks<R: Send>(n: usize, name: &str, f: impl Fn(&Comm, &Arc<CudaStream>) -> R + Sync) -> Vec<R> {
    let comms = Comm::new_group(
        "device",
        &vec![Device::Cuda(0); n],
        name,
        options(Duration::from_secs(60)),
    )
    .unwrap();
    std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                sc.spawn(|| {
                    let s = device::new_stream(0).unwrap();
                    let _current = device::use_stream(&s);
                    f(c, &s)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn gpu_fused_norm_matches_the_reference_and_every_rank_agrees() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    for world in [2, 4] {
        for (rows, hint, fp8) in [
            ((1, 4096), "oneshot", false),
            ((128, 4096), "twoshot", false),
            ((64, 7168), "oneshot", true),
            ((5, 129), "twoshot", false),
        ] {
            let got = on_ranks(world, &format!("gpu-norm-{world}-{rows:?}-{hint}-{fp8}"), |c, s| {
                norm_on_gpu::<bf16>(c, s, seed, rows, &[("algorithm", hint)], fp8)
            });
            for g in &got {
                assert_eq!(g, &got[0], "every rank's bits agree");
            }
            check_norm(world, seed, rows, fp8, &got[0]);
            // The steps apart (widen, the own all_reduce, the norm kernel) give the same bits.
            let apart = on_ranks(world, &format!("gpu-norm-apart-{world}-{rows:?}-{fp8}"), |c, s| {
                norm_on_gpu::<bf16>(c, s, seed, rows, &[("algorithm", "unfused")], fp8)
            });
            for g in &apart {
                assert_eq!(g, &got[0], "the unfused steps give the fused kernels' bits");
            }
        }
    }
}

fn moe_on_gpu(c: &Comm, s: &Arc<CudaStream>, seed: u64, case: &MoeCase) -> MoeResult {
    let sh = case.shape;
    let local = sh.experts / case.world;
    let (x, ids, w) = moe_inputs::<bf16>(seed, c.rank(), case);
    let rows = local * sh.capacity;
    let (dx, dids, dw) = (
        s.clone_htod(bytes_of(&x)).unwrap(),
        s.clone_htod(bytes_of(&ids)).unwrap(),
        s.clone_htod(bytes_of(&w)).unwrap(),
    );
    let mut drecv = s.clone_htod(&vec![0xEEu8; rows * sh.hidden * 2]).unwrap();
    let mut dcounts = s.clone_htod(bytes_of(&vec![-7i32; local])).unwrap();
    let mut dsrc = s.clone_htod(bytes_of(&vec![-7i32; rows * 3])).unwrap();
    let send = || Dispatch::send(input::<bf16>(&dx, s), input::<i64>(&dids, s));
    let recv = |d: Dispatch<'static>, r: &mut CudaSlice<u8>, cn: &mut CudaSlice<u8>, sr: &mut CudaSlice<u8>| {
        d.recv(view::<bf16>(r, s), view::<i32>(cn, s), view::<i32>(sr, s))
    };
    if case.halves {
        c.moe_dispatch(sh, send()).unwrap();
        c.moe_dispatch(sh, recv(Dispatch::recv_only(), &mut drecv, &mut dcounts, &mut dsrc))
            .unwrap();
    } else {
        c.moe_dispatch(sh, recv(send(), &mut drecv, &mut dcounts, &mut dsrc))
            .unwrap();
    }
    let recv_bits = s.clone_dtoh(&drecv).unwrap();
    let counts: Vec<i32> = from_bytes(&s.clone_dtoh(&dcounts).unwrap());
    let src: Vec<i32> = from_bytes(&s.clone_dtoh(&dsrc).unwrap());
    // The "experts": row * (1 + expert / 64), on the host.
    let mut expert_out: Vec<bf16> = from_bytes(&recv_bits);
    for e in 0..local {
        let f = expert_factor(c.rank() * local + e);
        for i in 0..(counts[e] as usize).min(sh.capacity) {
            for v in &mut expert_out[(e * sh.capacity + i) * sh.hidden..][..sh.hidden] {
                *v = bf16::from_f64(v.to_f64() * f);
            }
        }
    }
    let dout_experts = s.clone_htod(bytes_of(&expert_out)).unwrap();
    let mut dout = s.clone_htod(&vec![0xEEu8; case.tokens * sh.hidden * 2]).unwrap();
    let csend = || {
        Combine::send(
            input::<bf16>(&dout_experts, s),
            input::<i32>(&dsrc, s),
            input::<i32>(&dcounts, s),
        )
    };
    if case.halves {
        c.moe_combine(sh, csend()).unwrap();
        let r = Combine::recv_only().recv(input::<i64>(&dids, s), input::<f32>(&dw, s), view::<bf16>(&mut dout, s));
        c.moe_combine(sh, r).unwrap();
    } else {
        let r = csend().recv(input::<i64>(&dids, s), input::<f32>(&dw, s), view::<bf16>(&mut dout, s));
        c.moe_combine(sh, r).unwrap();
    }
    let out: Vec<bf16> = from_bytes(&s.clone_dtoh(&dout).unwrap());
    s.synchronize().unwrap();
    (counts, src, recv_bits, out.iter().map(|v| v.to_f64()).collect())
}

#[test]
fn gpu_moe_dispatch_and_combine_match_the_reference() {
    if !gpu_or_skip() {
        return;
    }
    let seed = fresh_seed();
    for (world, topk, routing, halves) in [
        (2, 8, Routing::Random, false),
        (4, 1, Routing::Random, true),
        (4, 8, Routing::AllToOne, false),
        (8, 8, Routing::Random, false),
    ] {
        let tokens = 128;
        let case = MoeCase {
            world,
            tokens,
            shape: MoeShape {
                experts: 32,
                topk,
                hidden: 7168,
                capacity: tokens * world,
            },
            routing,
            halves,
        };
        let got = on_ranks(world, &format!("gpu-moe-{world}-{topk}-{halves}"), |c, s| {
            moe_on_gpu(c, s, seed, &case)
        });
        for (me, g) in got.iter().enumerate() {
            check_moe_rank::<bf16>(me, seed, &case, g);
        }
    }
}
