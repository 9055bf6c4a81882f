//! The inference collectives checked against plain references in f64: the fused all_reduce +
//! residual + RMSNorm and MoE dispatch / combine. Each check runs a group on one backend and
//! device, so the CPU backend and the host device share them.

#![allow(clippy::needless_range_loop)] // index loops mirror the formulas they check

use super::*;
use ferrocomm::{bf16, f16, Combine, Dispatch, MoeShape, F8E4M3};

/// An activation type of the fused norm and of MoE rows.
pub trait Act: Element + Copy + Default + PartialEq + std::fmt::Debug {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    /// Relative tolerance of one rounding to this type plus f32 arithmetic.
    const TOL: f64;
}

impl Act for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    const TOL: f64 = 2e-5;
}

impl Act for f16 {
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    const TOL: f64 = 2e-3;
}

impl Act for bf16 {
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    const TOL: f64 = 1.6e-2;
}

/// One rank's inputs of the fused norm.
pub fn norm_inputs<T: Act>(seed: u64, rank: usize, tokens: usize, hidden: usize) -> (Vec<T>, Vec<T>, Vec<T>) {
    let mut r = rng(seed, rank as u64);
    let x = (0..tokens * hidden)
        .map(|_| T::from_f64(r.gen_range(-1.0..1.0)))
        .collect();
    // Residual and gamma are the same on every rank, as in a tensor-parallel layer.
    let mut shared = rng(seed, 1000);
    let residual = (0..tokens * hidden)
        .map(|_| T::from_f64(shared.gen_range(-2.0..2.0)))
        .collect();
    let gamma = (0..hidden).map(|_| T::from_f64(shared.gen_range(0.5..1.5))).collect();
    (x, residual, gamma)
}

/// The fused norm in f64: (new residual, y).
fn norm_reference<T: Act>(xs: &[Vec<T>], residual: &[T], gamma: &[T], hidden: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let n = residual.len();
    let s: Vec<f64> = (0..n)
        .map(|i| xs.iter().map(|x| x[i].to_f64()).sum::<f64>() + residual[i].to_f64())
        .collect();
    let mut y = vec![0f64; n];
    for (t, row) in s.chunks(hidden).enumerate() {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for j in 0..hidden {
            y[t * hidden + j] = row[j] * inv * gamma[j].to_f64();
        }
    }
    (s, y)
}

fn close(what: &str, i: usize, got: f64, want: f64, tol: f64, scale: f64) {
    assert!(
        (got - want).abs() <= tol * scale.max(want.abs()),
        "{what}[{i}]: got {got}, want {want} (tolerance {tol} relative to {})",
        scale.max(want.abs())
    );
}

/// One rank's fused norm results: (new residual, out as bits, fp8 scales).
pub type NormResult<T> = (Vec<T>, Vec<u8>, Vec<f32>);

const EPS: f32 = 1e-5;

/// Runs the fused norm on this rank's inputs (`hint`: the `algorithm` hint, if any).
pub fn norm_rank<T: Act>(
    c: &Comm,
    seed: u64,
    (tokens, hidden): (usize, usize),
    hint: Option<&str>,
    fp8: bool,
) -> NormResult<T> {
    let (x, mut residual, gamma) = norm_inputs::<T>(seed, c.rank(), tokens, hidden);
    let o = hint.map_or(OpOptions::new(), |h| OpOptions::new().hint("algorithm", h));
    if fp8 {
        let mut out = vec![F8E4M3::from_bits(0x7F); tokens * hidden];
        let mut scales = vec![f32::NAN; tokens];
        c.with_options(o)
            .all_reduce_residual_rmsnorm_fp8(&x, &mut residual, &gamma, &mut out, &mut scales, EPS)
            .unwrap();
        (residual, out.iter().map(|v| v.to_bits()).collect(), scales)
    } else {
        let mut out = vec![T::from_f64(-12345.0); tokens * hidden];
        c.with_options(o)
            .all_reduce_residual_rmsnorm(&x, &mut residual, &gamma, &mut out, EPS)
            .unwrap();
        (residual, out.iter().flat_map(bytes_of).collect(), Vec::new())
    }
}

/// Checks one rank's result against the f64 reference of `world` ranks' inputs.
pub fn check_norm<T: Act>(world: usize, seed: u64, (tokens, hidden): (usize, usize), fp8: bool, got: &NormResult<T>) {
    let xs: Vec<Vec<T>> = (0..world)
        .map(|r| norm_inputs::<T>(seed, r, tokens, hidden).0)
        .collect();
    let (_, residual, gamma) = norm_inputs::<T>(seed, 0, tokens, hidden);
    let (s, y) = norm_reference(&xs, &residual, &gamma, hidden, EPS as f64);
    let (res, out, scales) = got;
    for i in 0..tokens * hidden {
        close("residual", i, res[i].to_f64(), s[i], T::TOL, 1.0);
    }
    for t in 0..tokens {
        let row = &y[t * hidden..(t + 1) * hidden];
        let amax = row.iter().fold(0f64, |m, v| m.max(v.abs()));
        for j in 0..hidden {
            let i = t * hidden + j;
            if fp8 {
                // 3 mantissa bits: half an ulp is 2^-4 of the value, and the scale maps the row's
                // largest magnitude to 448, so small values lose relative precision.
                let got = F8E4M3::from_bits(out[i]).to_f32() as f64 * scales[t] as f64;
                close("y (fp8)", i, got, row[j], 0.07, amax / 64.0);
            } else {
                let got: T = from_bytes(&out[i * T::DTYPE.size()..(i + 1) * T::DTYPE.size()]);
                close("y", i, got.to_f64(), row[j], 2.0 * T::TOL, 1.0);
            }
        }
        if fp8 {
            close("scale", t, scales[t] as f64, amax / 448.0, 2.0 * T::TOL, 0.0);
        }
    }
}

/// Runs the fused norm on `world` ranks with `hint` (or none), checks every rank against the
/// f64 reference and every rank's bits against rank 0's, twice.
pub fn fused_norm<T: Act>(
    backend: &str,
    device: Device,
    world: usize,
    tokens: usize,
    hidden: usize,
    hint: Option<&str>,
    fp8: bool,
) {
    let opts = options(Duration::from_secs(30));
    fused_norm_with::<T>(backend, device, opts, world, (tokens, hidden), hint, fp8)
}

/// `fused_norm` with the communicator options `opts` (the TCP transport, say).
pub fn fused_norm_with<T: Act>(
    backend: &str,
    device: Device,
    opts: CommOptions,
    world: usize,
    rows: (usize, usize),
    hint: Option<&str>,
    fp8: bool,
) {
    let seed = fresh_seed();
    let name = format!("norm-{world}-{rows:?}-{hint:?}-{fp8}").replace(' ', "");
    let run = |c: &Comm| norm_rank::<T>(c, seed, rows, hint, fp8);
    let first = run_group_on_device(backend, device, world, &name, opts.clone(), run);
    let again = run_group_on_device(backend, device, world, &format!("{name}-again"), opts, run);
    assert_eq!(first, again, "two runs on the same inputs give the same bits");
    for (r, got) in first.iter().enumerate() {
        assert_eq!(got, &first[0], "rank {r} and rank 0 got different bits");
    }
    check_norm(world, seed, rows, fp8, &first[0]);
}

/// The inference collectives on one rank of any communicator (processes, too): the fused norm
/// both ways and a MoE round trip, checked against the references; returns the checks made.
pub fn on_comm(c: &Comm, seed: u64) -> usize {
    for hint in ["oneshot", "twoshot"] {
        let got = norm_rank::<bf16>(c, seed, (9, 96), Some(hint), false);
        check_norm(c.size(), seed, (9, 96), false, &got);
    }
    let fp8 = norm_rank::<f32>(c, seed, (3, 40), None, true);
    check_norm(c.size(), seed, (3, 40), true, &fp8);
    let case = MoeCase {
        world: c.size(),
        tokens: 7,
        shape: MoeShape {
            experts: 2 * c.size(),
            topk: 2,
            hidden: 24,
            capacity: 7 * c.size(),
        },
        routing: Routing::Random,
        halves: true,
    };
    let got = moe_rank::<bf16>(c, seed, &case).unwrap();
    check_moe_rank::<bf16>(c.rank(), seed, &case, &got);
    4
}

fn bytes_of<T: Element>(v: &T) -> Vec<u8> {
    // SAFETY: `Element` types are plain old data of their size.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }.to_vec()
}

fn from_bytes<T: Element + Default>(b: &[u8]) -> T {
    let mut v = T::default();
    // SAFETY: as above; `b` has `size_of::<T>()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), (&mut v as *mut T).cast::<u8>(), b.len()) };
    v
}

/// The routing of one rank's tokens.
#[derive(Clone, Copy, Debug)]
pub enum Routing {
    /// Distinct experts drawn at random for each token.
    Random,
    /// Every token to expert 0 (and, for K > 1, experts 1..K): one rank gets everything.
    AllToOne,
    /// Only the experts of the last rank, some slots -1.
    LastRankSparse,
}

fn route(r: &mut StdRng, routing: Routing, shape: &MoeShape, world: usize, tokens: usize) -> Vec<i64> {
    let local = shape.experts / world;
    let mut ids = Vec::new();
    for _ in 0..tokens {
        match routing {
            Routing::Random => {
                let mut chosen: Vec<i64> = Vec::new();
                while chosen.len() < shape.topk {
                    let x = r.gen_range(0..shape.experts) as i64;
                    if !chosen.contains(&x) {
                        chosen.push(x);
                    }
                }
                ids.extend(chosen);
            }
            Routing::AllToOne => ids.extend((0..shape.topk as i64).collect::<Vec<_>>()),
            Routing::LastRankSparse => {
                let first = (shape.experts - local) as i64;
                ids.extend((0..shape.topk).map(|k| if k % 2 == 1 { -1 } else { first + (k / 2 % local) as i64 }));
            }
        }
    }
    ids
}

/// One MoE check: a dispatch and a combine whose "experts" multiply each row by
/// (1 + global expert id / 64), against the reference `Σ_k w_k (1 + e_k / 64) x`.
#[derive(Clone, Copy, Debug)]
pub struct MoeCase {
    pub world: usize,
    pub tokens: usize,
    pub shape: MoeShape,
    pub routing: Routing,
    /// Run the halves of dispatch and combine as separate calls.
    pub halves: bool,
}

/// Per rank: (counts, src, received rows as bits, combined output as f64).
pub type MoeResult = (Vec<i32>, Vec<i32>, Vec<u8>, Vec<f64>);

pub fn moe_inputs<T: Act>(seed: u64, rank: usize, case: &MoeCase) -> (Vec<T>, Vec<i64>, Vec<f32>) {
    let mut r = rng(seed, rank as u64);
    let x: Vec<T> = (0..case.tokens * case.shape.hidden)
        .map(|_| T::from_f64(r.gen_range(-1.0..1.0)))
        .collect();
    let ids = route(&mut r, case.routing, &case.shape, case.world, case.tokens);
    let w: Vec<f32> = (0..case.tokens * case.shape.topk)
        .map(|_| r.gen_range(0.0..1.0))
        .collect();
    (x, ids, w)
}

pub fn expert_factor(expert: usize) -> f64 {
    1.0 + expert as f64 / 64.0
}

/// Dispatch, "expert" compute, combine on one rank.
fn moe_rank<T: Act>(c: &Comm, seed: u64, case: &MoeCase) -> ferrocomm::Result<MoeResult> {
    let s = case.shape;
    let local = s.experts / case.world;
    let (x, ids, w) = moe_inputs::<T>(seed, c.rank(), case);
    let rows = local * s.capacity;
    let mut recv = vec![T::from_f64(-999.0); rows * s.hidden];
    let mut counts = vec![-7i32; local];
    let mut src = vec![-7i32; rows * 3];
    if case.halves {
        c.moe_dispatch(s, Dispatch::send(&x, &ids))?;
        c.moe_dispatch(s, Dispatch::recv_only().recv(&mut recv, &mut counts, &mut src))?;
    } else {
        c.moe_dispatch(s, Dispatch::send(&x, &ids).recv(&mut recv, &mut counts, &mut src))?;
    }
    let mut expert_out = recv.clone();
    for e in 0..local {
        let f = expert_factor(c.rank() * local + e);
        for i in 0..(counts[e] as usize).min(s.capacity) {
            let row = &mut expert_out[(e * s.capacity + i) * s.hidden..][..s.hidden];
            row.iter_mut().for_each(|v| *v = T::from_f64(v.to_f64() * f));
        }
    }
    let mut out = vec![T::from_f64(-999.0); case.tokens * s.hidden];
    if case.halves {
        c.moe_combine(s, Combine::send(&expert_out, &src, &counts))?;
        c.moe_combine(s, Combine::recv_only().recv(&ids, &w, &mut out))?;
    } else {
        c.moe_combine(s, Combine::send(&expert_out, &src, &counts).recv(&ids, &w, &mut out))?;
    }
    let bits = recv.iter().flat_map(bytes_of).collect();
    Ok((counts, src, bits, out.iter().map(|v| v.to_f64()).collect()))
}

/// Runs `case` on `world` ranks and checks dispatch (exact) and combine (f64 reference) on every
/// rank, and that a second run gives the same bits. Returns every rank's result.
pub fn moe<T: Act>(backend: &str, device: Device, case: MoeCase) -> Vec<MoeResult> {
    let seed = fresh_seed();
    let name = format!("moe-{case:?}").replace(' ', "");
    let opts = options(Duration::from_secs(30));
    let run = |c: &Comm| moe_rank::<T>(c, seed, &case).unwrap();
    let got = run_group_on_device(backend, device, case.world, &name, opts.clone(), run);
    let again = run_group_on_device(backend, device, case.world, &format!("{name}-2"), opts, run);
    assert_eq!(got.len(), again.len());
    for (a, b) in got.iter().zip(&again) {
        assert_eq!((&a.0, &a.1, &a.2), (&b.0, &b.1, &b.2), "dispatch is deterministic");
        let same = a.3.iter().zip(&b.3).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "combine is deterministic");
    }
    for (me, g) in got.iter().enumerate() {
        check_moe_rank::<T>(me, seed, &case, g);
    }
    got
}

/// Checks rank `me`'s dispatch (exactly: the rows, their order and sources) and combine
/// (against Σ_k w_k factor(e_k) x in f64).
pub fn check_moe_rank<T: Act>(me: usize, seed: u64, case: &MoeCase, got: &MoeResult) {
    let s = case.shape;
    let local = s.experts / case.world;
    let inputs: Vec<_> = (0..case.world).map(|r| moe_inputs::<T>(seed, r, case)).collect();
    // Dispatch: the rows each rank's experts should have, in (source, token, k) order.
    {
        let (counts, src, bits, out) = got;
        let mut want: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new(); local];
        for (r, (_, ids, _)) in inputs.iter().enumerate() {
            for t in 0..case.tokens {
                for k in 0..s.topk {
                    let x = ids[t * s.topk + k];
                    if x >= 0 && x as usize / local == me {
                        want[x as usize % local].push((r, t, k));
                    }
                }
            }
        }
        let size = T::DTYPE.size();
        for e in 0..local {
            assert_eq!(counts[e] as usize, want[e].len(), "rank {me} expert {e}: count");
            for (i, &(r, t, k)) in want[e].iter().enumerate() {
                let slot = e * s.capacity + i;
                assert_eq!(
                    &src[slot * 3..slot * 3 + 3],
                    &[r as i32, t as i32, k as i32],
                    "src of {slot}"
                );
                let row = &bits[slot * s.hidden * size..(slot + 1) * s.hidden * size];
                let x = &inputs[r].0[t * s.hidden..(t + 1) * s.hidden];
                let sent: Vec<u8> = x.iter().flat_map(bytes_of).collect();
                assert_eq!(row, &sent[..], "rank {me} expert {e} row {i}: the token's bits");
            }
        }
        // Combine: Σ_k w_k * factor(e_k) * x_t.
        let (x, ids, w) = &inputs[me];
        for t in 0..case.tokens {
            let mut factor = 0f64;
            let mut scale = 0f64;
            for k in 0..s.topk {
                let e = ids[t * s.topk + k];
                if e >= 0 {
                    factor += w[t * s.topk + k] as f64 * expert_factor(e as usize);
                    scale += w[t * s.topk + k].abs() as f64 * expert_factor(e as usize);
                }
            }
            for j in 0..s.hidden {
                let want = factor * x[t * s.hidden + j].to_f64();
                // Each expert row was rounded to T once, then summed in f32: one ulp per term.
                close(
                    "combined",
                    t * s.hidden + j,
                    out[t * s.hidden + j],
                    want,
                    2.0 * T::TOL,
                    scale,
                );
            }
        }
    }
}
