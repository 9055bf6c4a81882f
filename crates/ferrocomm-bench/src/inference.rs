//! `rmsnorm` and `moe`: the inference collectives on a host communicator.
//!
//! `rmsnorm` times the fused `all_reduce_residual_rmsnorm` (or its fp8 form) against the same
//! steps unfused: x copied into a scratch buffer, `all_reduce` on it, then a residual add and
//! RMSNorm pass written here with the library's arithmetic (f32, the same order of operations;
//! only the all_reduce's result is rounded to the element type before the residual is added,
//! which is what running the steps apart costs in precision). The two run alternately, one
//! call each per iteration, so both see the same machine; each is the slowest rank's mean.
//!
//! `moe` times `moe_dispatch` and `moe_combine` of one MoE layer with random top-K routing and
//! identity experts (the combine sends back what the dispatch delivered; with `--fp8` the
//! experts dequantise their fp8 rows to `--datatype`, untimed). A barrier precedes each timed
//! half, so neither half's time holds the other's or the experts' stragglers.
//!
//! `--check` runs each once more on fresh outputs and counts elements outside a tolerance
//! derived from the types' unit roundoff (see `tol_*` below): for `rmsnorm` the fused result
//! against an f64 reference and against the unfused one; for `moe` every dispatched row
//! against its source token (bits, scales, order, counts) and `combine(dispatch(x))` against
//! `Σ_k w_k x` in f64.

use crate::cli::{Args, DType, Inference, MoeOpts, RmsNormOpts};
use crate::progress::Progress;
use crate::report::{Params, Row};
use ferrocomm::prelude::*;
use ferrocomm::{bf16, f16, Combine, Dispatch, Error, MoeShape, Result, F8E4M3};
use std::time::Instant;

/// Elements per fp8 scale block of a dispatched token (the library's `FP8_BLOCK`).
const BLOCK: usize = 128;

/// The activation types of the inference ops.
pub trait Act: Element + Default {
    /// Unit roundoff: half the distance from 1 to the next value.
    const U: f64;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Act for f32 {
    const U: f64 = 1.0 / (1u64 << 24) as f64;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Act for f16 {
    const U: f64 = 1.0 / (1u64 << 11) as f64;
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Act for bf16 {
    const U: f64 = 1.0 / (1u64 << 8) as f64;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// f32's unit roundoff: the accumulations' own error per step.
const U32: f64 = 1.0 / (1u64 << 24) as f64;

/// The shape written with `--json` / `--csv`, for the inference ops.
pub fn params(a: &Args, world: usize) -> Option<Params> {
    match a.inference.as_deref() {
        Some(Inference::RmsNorm(o)) => Some(Params {
            hidden: o.hidden,
            fp8: o.fp8,
            eps: Some(o.eps),
            ..Params::default()
        }),
        Some(Inference::Moe(o)) => Some(Params {
            hidden: o.hidden,
            fp8: o.fp8,
            topk: Some(o.topk),
            experts: Some(o.experts),
            capacity: Some(capacity(o, world)),
            ..Params::default()
        }),
        None => None,
    }
}

/// Rows per local expert: `--capacity`, or the most tokens of the run times the ranks.
fn capacity(o: &MoeOpts, world: usize) -> usize {
    o.capacity
        .unwrap_or_else(|| o.tokens.iter().copied().max().unwrap_or(1) * world)
}

/// Runs `rmsnorm` or `moe` on this rank; rank 0 prints the table. Every rank returns the rows.
pub fn run(comm: &Comm, a: &Args) -> Result<Vec<Row>> {
    let refuse = |op: &str| {
        Err(Error::Config(format!(
            "{op} takes -d f32, f16 or bf16, not {}",
            a.dtype.name()
        )))
    };
    match a.inference.as_deref() {
        Some(Inference::RmsNorm(o)) => match a.dtype {
            DType::F32 => rmsnorm::<f32>(comm, a, o),
            DType::F16 => rmsnorm::<f16>(comm, a, o),
            DType::Bf16 => rmsnorm::<bf16>(comm, a, o),
            _ => refuse("rmsnorm"),
        },
        Some(Inference::Moe(o)) => match a.dtype {
            DType::F32 => moe::<f32>(comm, a, o),
            DType::F16 => moe::<f16>(comm, a, o),
            DType::Bf16 => moe::<bf16>(comm, a, o),
            _ => refuse("moe"),
        },
        None => Err(Error::Config(format!("{} is not an inference op", a.op))),
    }
}

/// splitmix64: the bench's deterministic random numbers (every rank can regenerate any
/// rank's inputs for `--check`).
struct Rng(u64);

impl Rng {
    fn new(stream: &[u64]) -> Rng {
        let mut r = Rng(0x853c_49e6_748f_ea9b);
        for &s in stream {
            r.0 ^= s;
            r.next();
        }
        r
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `len` values uniform in [lo, hi), rounded to `T`.
fn values<T: Act>(stream: &[u64], len: usize, lo: f32, hi: f32) -> Vec<T> {
    let mut r = Rng::new(stream);
    (0..len).map(|_| T::from_f32(r.uniform(lo, hi))).collect()
}

/// Streams of the inputs: x of a rank, the residual, gamma, MoE tokens and routing.
const X: u64 = 1;
const RESIDUAL: u64 = 2;
const GAMMA: u64 = 3;
const TOKENS: u64 = 4;
const ROUTING: u64 = 5;

/// The slowest rank's value of each entry.
fn slowest(comm: &Comm, v: &mut [f64]) -> Result<()> {
    comm.all_reduce(v, ReduceOp::Max)
}

/// Wrong elements over all ranks.
fn total(comm: &Comm, bad: u64) -> Result<u64> {
    let mut t = [bad];
    comm.all_reduce(&mut t, ReduceOp::Sum)?;
    Ok(t[0])
}

/// The residual add and RMSNorm pass of the unfused steps, with the library's arithmetic
/// (host/compute/rmsnorm.rs): `acc = sum + residual` in f32, residual overwritten with it
/// rounded, sum of squares by plain multiplies and adds in order, `v * inv * gamma`; each finished
/// row goes to `store(token, row)`.
fn residual_norm<T: Act>(
    sum: &[T],
    residual: &mut [T],
    gamma: &[f32],
    eps: f32,
    acc: &mut [f32],
    mut store: impl FnMut(usize, &mut [f32]),
) {
    let hidden = gamma.len();
    for (t, (s, r)) in sum
        .chunks_exact(hidden)
        .zip(residual.chunks_exact_mut(hidden))
        .enumerate()
    {
        for ((a, &s), r) in acc.iter_mut().zip(s).zip(r.iter_mut()) {
            *a = s.to_f32() + r.to_f32();
            *r = T::from_f32(*a);
        }
        let mut square = 0f32;
        for &v in acc.iter() {
            square += v * v;
        }
        let inv = 1.0 / (square / hidden as f32 + eps).sqrt();
        for (v, g) in acc.iter_mut().zip(gamma) {
            *v = *v * inv * g;
        }
        store(t, acc);
    }
}

/// The per-token (or per-block) fp8 scale, as the library computes it.
fn fp8_scale(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        amax / F8E4M3::MAX
    } else {
        1.0
    }
}

/// Quantises `row` to fp8 into `out` and returns its scale.
fn quantise(row: &mut [f32], out: &mut [F8E4M3]) -> f32 {
    let scale = fp8_scale(row.iter().fold(0f32, |m, v| m.max(v.abs())));
    for (o, v) in out.iter_mut().zip(row.iter_mut()) {
        *v /= scale;
        *o = F8E4M3::from_f32(*v);
    }
    scale
}

/// The outputs of one fused or unfused run.
struct NormOut<T> {
    residual: Vec<T>,
    /// Without `--fp8`.
    out: Vec<T>,
    /// With `--fp8`: the quantised rows and their scales.
    out8: Vec<F8E4M3>,
    scales: Vec<f32>,
}

impl<T: Act> NormOut<T> {
    fn new(residual: &[T], fp8: bool, tokens: usize) -> NormOut<T> {
        let len = residual.len();
        NormOut {
            residual: residual.to_vec(),
            out: vec![T::default(); if fp8 { 0 } else { len }],
            out8: vec![F8E4M3::default(); if fp8 { len } else { 0 }],
            scales: vec![0f32; if fp8 { tokens } else { 0 }],
        }
    }

    /// Element `i` of the output, dequantised.
    fn y(&self, i: usize, hidden: usize) -> f64 {
        if self.out8.is_empty() {
            self.out[i].to_f32() as f64
        } else {
            self.out8[i].to_f32() as f64 * self.scales[i / hidden] as f64
        }
    }
}

/// The buffers of one token count, and the two ways to run it.
struct NormCase<'c, T> {
    coll: &'c ferrocomm::WithOptions<'c, Comm>,
    comm: &'c Comm,
    x: Vec<T>,
    residual: Vec<T>,
    gamma: Vec<T>,
    gamma_f: Vec<f32>,
    eps: f32,
    /// x's copy that the unfused all_reduce reduces in place.
    scratch: Vec<T>,
    acc: Vec<f32>,
}

impl<T: Act> NormCase<'_, T> {
    fn fused(&self, o: &mut NormOut<T>) -> Result<()> {
        let (x, g) = (&self.x, &self.gamma);
        if o.out8.is_empty() {
            self.coll
                .all_reduce_residual_rmsnorm(x, &mut o.residual, g, &mut o.out, self.eps)
        } else {
            self.coll
                .all_reduce_residual_rmsnorm_fp8(x, &mut o.residual, g, &mut o.out8, &mut o.scales, self.eps)
        }
    }

    fn unfused(&mut self, o: &mut NormOut<T>) -> Result<()> {
        self.scratch.copy_from_slice(&self.x);
        self.comm.all_reduce(&mut self.scratch, ReduceOp::Sum)?;
        let hidden = self.gamma_f.len();
        let fp8 = !o.out8.is_empty();
        let (out, out8, scales) = (&mut o.out, &mut o.out8, &mut o.scales);
        residual_norm(
            &self.scratch,
            &mut o.residual,
            &self.gamma_f,
            self.eps,
            &mut self.acc,
            |t, row| {
                let at = t * hidden..(t + 1) * hidden;
                if fp8 {
                    scales[t] = quantise(row, &mut out8[at]);
                } else {
                    for (d, &v) in out[at].iter_mut().zip(row.iter()) {
                        *d = T::from_f32(v);
                    }
                }
            },
        );
        Ok(())
    }
}

const NORM_HEADER: &str = "#   tokens       size     fused    unfused  unfused/   busbw  #wrong
#             (B)/rank      (us)       (us)     fused  (GB/s)";

/// The token counts of an `rmsnorm` sweep: `--tokens`, else the whole rows of `hidden`
/// elements of `esize` bytes in each size of the -b/-e/-f sweep (a size below one row has none).
pub fn token_rows(a: &Args, o: &RmsNormOpts, esize: usize) -> Vec<usize> {
    let mut tokens: Vec<usize> = if o.tokens.is_empty() {
        crate::size::sweep(a.min_bytes, a.max_bytes, a.factor)
            .into_iter()
            .map(|b| b / (o.hidden * esize))
            .filter(|&t| t > 0)
            .collect()
    } else {
        o.tokens.clone()
    };
    tokens.dedup();
    tokens
}

fn rmsnorm<T: Act>(comm: &Comm, a: &Args, o: &RmsNormOpts) -> Result<Vec<Row>> {
    let (n, me) = (comm.size(), comm.rank());
    let hidden = o.hidden;
    let esize = std::mem::size_of::<T>();
    let tokens = token_rows(a, o, esize);
    let hints = match &a.algo {
        Some(name) => OpOptions::new().hint("algorithm", name),
        None => OpOptions::new(),
    };
    let coll = comm.with_options(hints);
    let lead = me == 0;
    if lead {
        println!(
            "# ferrocomm-bench rmsnorm on backend {}, {} ranks, {}, hidden {}, out {}, eps {}: fused \
             all_reduce_residual_rmsnorm against all_reduce + a residual/norm pass",
            comm.backend_name(),
            n,
            a.dtype.name(),
            hidden,
            if o.fp8 { "f8e4m3" } else { a.dtype.name() },
            o.eps
        );
        println!("{NORM_HEADER}");
    }
    let progress = Progress::new(&a.op, tokens.len(), lead);
    let gamma: Vec<T> = values(&[GAMMA], hidden, 0.5, 1.5);
    let mut rows = Vec::new();
    for t in tokens {
        progress.start_row(format!("{t} tokens"));
        let len = t * hidden;
        let x: Vec<T> = values(&[X, me as u64, t as u64], len, -1.0, 1.0);
        let residual: Vec<T> = values(&[RESIDUAL, t as u64], len, -1.0, 1.0);
        let mut case = NormCase {
            coll: &coll,
            comm,
            gamma_f: gamma.iter().map(|g| g.to_f32()).collect(),
            gamma: gamma.clone(),
            x,
            residual,
            eps: o.eps,
            scratch: vec![T::default(); len],
            acc: vec![0f32; hidden],
        };
        let mut fused = NormOut::new(&case.residual, o.fp8, t);
        let mut unfused = NormOut::new(&case.residual, o.fp8, t);
        // Alternately, one call each: the same machine state for both. The residuals keep
        // growing by Σx per call, which changes no cost.
        let mut secs = [0f64; 2];
        for i in 0..a.warmup + a.iters {
            if i == a.warmup {
                comm.barrier()?;
            }
            let t0 = Instant::now();
            case.fused(&mut fused)?;
            let t1 = Instant::now();
            case.unfused(&mut unfused)?;
            if i >= a.warmup {
                secs[0] += (t1 - t0).as_secs_f64();
                secs[1] += t1.elapsed().as_secs_f64();
            }
        }
        secs.iter_mut().for_each(|s| *s /= a.iters as f64);
        slowest(comm, &mut secs)?;
        let wrong = if a.check {
            total(comm, check_rmsnorm(&mut case, o.fp8, t)?)?
        } else {
            0
        };
        let bytes = len * esize;
        let algbw = bytes as f64 / secs[0] / 1e9;
        let row = Row {
            bytes,
            count: len,
            time_us: secs[0] * 1e6,
            algbw,
            busbw: algbw * crate::ops::bus_factor("all_reduce", n),
            wrong,
            tokens: Some(t),
            unfused_us: Some(secs[1] * 1e6),
            ratio: Some(secs[1] / secs[0]),
            ..Row::default()
        };
        if lead {
            progress.print_row(&format!(
                "{:>10} {:>10} {:>9.2} {:>10.2} {:>9.3} {:>7.2} {:>7}",
                t,
                bytes,
                row.time_us,
                secs[1] * 1e6,
                secs[1] / secs[0],
                row.busbw,
                wrong
            ));
        }
        rows.push(row);
    }
    Ok(rows)
}

/// One fused and one unfused run from the initial residual; counts this rank's elements
/// (residual and output) where the fused result strays from the f64 reference, or the
/// unfused from the fused, by more than the types allow.
///
/// Tolerances, with u = the element type's unit roundoff, u32 = f32's, n ranks, and for each
/// element `mag = Σ_r |x_r| + |residual|` (what its sum's rounding errors scale with) and
/// `k = inv_rms * |gamma|` (how an error in the sum reaches the output):
/// - fused residual vs reference s: `u |s| + (n + 1) u32 mag`: one rounding of an f32 sum;
/// - fused output vs reference y: `u |y| + hidden u32 |y| + (n + 1) u32 mag k`: one rounding of
///   the output, the f32 sum of squares' error, the sum's; fp8 output: `2^-4 |y| + 2^-10 scale`
///   (3 mantissa bits, subnormal steps of 2^-9 scale) in place of `u |y|`;
/// - unfused vs fused: the unfused all_reduce rounds its sum to the element type up to n - 1
///   times before the residual is added: `(n + 1) u mag` on the residual, `(n + 1) u mag k +
///   2 u |y|` on the output (fp8: one step of 3 mantissa bits, `2^-3 |y| + 2^-9 scale`).
fn check_rmsnorm<T: Act>(case: &mut NormCase<'_, T>, fp8: bool, tokens: usize) -> Result<u64> {
    let (n, hidden) = (case.comm.size(), case.gamma_f.len());
    let mut fused = NormOut::new(&case.residual, fp8, tokens);
    let mut unfused = NormOut::new(&case.residual, fp8, tokens);
    case.fused(&mut fused)?;
    case.unfused(&mut unfused)?;
    let xs: Vec<Vec<T>> = (0..n)
        .map(|r| values(&[X, r as u64, tokens as u64], tokens * hidden, -1.0, 1.0))
        .collect();
    let u = T::U;
    let mut bad = 0u64;
    let mut s = vec![0f64; hidden];
    let mut mag = vec![0f64; hidden];
    for t in 0..tokens {
        for j in 0..hidden {
            let i = t * hidden + j;
            let res = case.residual[i].to_f32() as f64;
            s[j] = xs.iter().map(|x| x[i].to_f32() as f64).sum::<f64>() + res;
            mag[j] = xs.iter().map(|x| (x[i].to_f32() as f64).abs()).sum::<f64>() + res.abs();
        }
        let inv = 1.0 / (s.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + case.eps as f64).sqrt();
        let scale = |o: &NormOut<T>| if fp8 { o.scales[t] as f64 } else { 0.0 };
        let (scale_f, scale_u) = (scale(&fused), scale(&unfused));
        for j in 0..hidden {
            let i = t * hidden + j;
            let k = inv * case.gamma_f[j].abs() as f64;
            let y = s[j] * inv * case.gamma_f[j] as f64;
            let (rf, ru) = (fused.residual[i].to_f32() as f64, unfused.residual[i].to_f32() as f64);
            let (yf, yu) = (fused.y(i, hidden), unfused.y(i, hidden));
            let sum_err = (n + 1) as f64 * U32 * mag[j];
            let out_round = if fp8 {
                y.abs() / 16.0 + scale_f / 1024.0
            } else {
                u * y.abs()
            };
            let step = if fp8 {
                yf.abs() / 8.0 + scale_f.max(scale_u) / 512.0
            } else {
                0.0
            };
            let within = [
                (rf - s[j]).abs() <= u * s[j].abs() + sum_err,
                (yf - y).abs() <= out_round + hidden as f64 * U32 * y.abs() + sum_err * k,
                (ru - rf).abs() <= u * s[j].abs() + (n + 1) as f64 * u * mag[j],
                (yu - yf).abs()
                    <= step + 2.0 * u * y.abs() + (n + 1) as f64 * u * mag[j] * k + hidden as f64 * U32 * y.abs(),
            ];
            bad += within.iter().filter(|ok| !**ok).count() as u64;
        }
    }
    Ok(bad)
}

/// The MoE routing of one rank: `tokens * topk` distinct experts per token, and weights that
/// sum to 1 per token.
fn routing(o: &MoeOpts, rank: usize, tokens: usize) -> (Vec<i32>, Vec<f32>) {
    let mut r = Rng::new(&[ROUTING, o.seed, rank as u64, tokens as u64]);
    let (mut ids, mut weights) = (Vec::with_capacity(tokens * o.topk), Vec::with_capacity(tokens * o.topk));
    for _ in 0..tokens {
        let start = ids.len();
        while ids.len() < start + o.topk {
            let e = r.below(o.experts) as i32;
            if !ids[start..].contains(&e) {
                ids.push(e);
            }
        }
        let w: Vec<f32> = (0..o.topk).map(|_| r.uniform(0.1, 1.0)).collect();
        let sum: f32 = w.iter().sum();
        weights.extend(w.iter().map(|v| v / sum));
    }
    (ids, weights)
}

/// A rank's MoE input tokens.
fn moe_tokens<T: Act>(o: &MoeOpts, rank: usize, tokens: usize) -> Vec<T> {
    values(
        &[TOKENS, o.seed, rank as u64, tokens as u64],
        tokens * o.hidden,
        -1.0,
        1.0,
    )
}

/// `x` quantised to fp8 with a scale per 128-element block (DeepEP's fp8 dispatch).
fn quantise_blocks<T: Act>(x: &[T]) -> (Vec<F8E4M3>, Vec<f32>) {
    let mut q = vec![F8E4M3::default(); x.len()];
    let mut scales = Vec::with_capacity(x.len() / BLOCK);
    let mut row = [0f32; BLOCK];
    for (b, chunk) in x.chunks(BLOCK).enumerate() {
        let row = &mut row[..chunk.len()];
        for (r, v) in row.iter_mut().zip(chunk) {
            *r = v.to_f32();
        }
        scales.push(quantise(row, &mut q[b * BLOCK..b * BLOCK + chunk.len()]));
    }
    (q, scales)
}

/// What an identity expert returns for a dispatched fp8 row: the row dequantised, in `T`.
fn dequantise<T: Act>(q: &[F8E4M3], scales: &[f32], out: &mut [T]) {
    for ((o, q), b) in out.chunks_mut(BLOCK).zip(q.chunks(BLOCK)).zip(scales) {
        for (o, q) in o.iter_mut().zip(q) {
            *o = T::from_f32(q.to_f32() * b);
        }
    }
}

/// The buffers of one MoE layer on this rank.
struct MoeCase<T> {
    shape: MoeShape,
    fp8: bool,
    tokens: Vec<T>,
    q: Vec<F8E4M3>,
    scales: Vec<f32>,
    ids: Vec<i32>,
    weights: Vec<f32>,
    /// The dispatch's output (without `--fp8`, also the identity experts' output).
    recv: Vec<T>,
    recv8: Vec<F8E4M3>,
    recv_scales: Vec<f32>,
    counts: Vec<i32>,
    src: Vec<i32>,
    /// With `--fp8`: the experts' dequantised rows.
    expert_out: Vec<T>,
    out: Vec<T>,
}

impl<T: Act> MoeCase<T> {
    fn new(o: &MoeOpts, rank: usize, world: usize, tokens: usize, capacity: usize) -> MoeCase<T> {
        let shape = MoeShape {
            experts: o.experts,
            topk: o.topk,
            hidden: o.hidden,
            capacity,
        };
        let rows = (o.experts / world) * capacity;
        let x: Vec<T> = moe_tokens(o, rank, tokens);
        let (q, scales) = if o.fp8 {
            quantise_blocks(&x)
        } else {
            (Vec::new(), Vec::new())
        };
        let (ids, weights) = routing(o, rank, tokens);
        let (act_rows, fp8_rows) = if o.fp8 { (0, rows) } else { (rows, 0) };
        MoeCase {
            shape,
            fp8: o.fp8,
            tokens: x,
            q,
            scales,
            ids,
            weights,
            recv: vec![T::default(); act_rows * o.hidden],
            recv8: vec![F8E4M3::default(); fp8_rows * o.hidden],
            recv_scales: vec![0f32; fp8_rows * (o.hidden / BLOCK)],
            counts: vec![0; o.experts / world],
            src: vec![0; rows * 3],
            expert_out: vec![T::default(); fp8_rows * o.hidden],
            out: vec![T::default(); tokens * o.hidden],
        }
    }

    fn dispatch(&mut self, c: &Comm) -> Result<()> {
        let d = if self.fp8 {
            Dispatch::send(&self.q, &self.ids)
                .scales(&self.scales)
                .recv(&mut self.recv8, &mut self.counts, &mut self.src)
                .recv_scales(&mut self.recv_scales)
        } else {
            Dispatch::send(&self.tokens, &self.ids).recv(&mut self.recv, &mut self.counts, &mut self.src)
        };
        c.moe_dispatch(self.shape, d)
    }

    /// The identity experts: nothing to do on activations; fp8 rows are dequantised.
    fn experts(&mut self) {
        if !self.fp8 {
            return;
        }
        let (h, cap) = (self.shape.hidden, self.shape.capacity);
        for (e, &c) in self.counts.iter().enumerate() {
            let rows = e * cap..e * cap + (c.max(0) as usize).min(cap);
            dequantise(
                &self.recv8[rows.start * h..rows.end * h],
                &self.recv_scales[rows.start * h / BLOCK..rows.end * h / BLOCK],
                &mut self.expert_out[rows.start * h..rows.end * h],
            );
        }
    }

    fn combine(&mut self, c: &Comm) -> Result<()> {
        let expert_out = if self.fp8 { &self.expert_out } else { &self.recv };
        let b = Combine::send(expert_out, &self.src, &self.counts).recv(&self.ids, &self.weights, &mut self.out);
        c.moe_combine(self.shape, b)
    }
}

fn moe<T: Act>(comm: &Comm, a: &Args, o: &MoeOpts) -> Result<Vec<Row>> {
    let (n, me) = (comm.size(), comm.rank());
    if o.topk > o.experts || !o.experts.is_multiple_of(n) {
        return Err(Error::Config(format!(
            "moe: --topk {} of --experts {} over {n} ranks: need topk <= experts and experts a \
             multiple of the ranks",
            o.topk, o.experts
        )));
    }
    let cap = capacity(o, n);
    let lead = me == 0;
    let dispatched = if o.fp8 { "f8e4m3" } else { a.dtype.name() };
    if lead {
        println!(
            "# ferrocomm-bench moe on backend {}, {} ranks: dispatch {dispatched} tokens, combine {}, \
             hidden {}, top-{} of {} experts ({} per rank), capacity {cap}, random routing (seed {}), \
             identity experts",
            comm.backend_name(),
            n,
            a.dtype.name(),
            o.hidden,
            o.topk,
            o.experts,
            o.experts / n,
            o.seed
        );
        println!("#   tokens       size  dispatch   combine     total  #wrong");
        println!("#             (B)/rank      (us)      (us)      (us)");
    }
    let progress = Progress::new(&a.op, o.tokens.len(), lead);
    let mut rows = Vec::new();
    for &t in &o.tokens {
        progress.start_row(format!("{t} tokens"));
        let mut case = MoeCase::<T>::new(o, me, n, t, cap);
        let mut secs = [0f64; 3];
        for i in 0..a.warmup + a.iters {
            comm.barrier()?;
            let t0 = Instant::now();
            case.dispatch(comm)?;
            let d = t0.elapsed().as_secs_f64();
            case.experts();
            comm.barrier()?;
            let t1 = Instant::now();
            case.combine(comm)?;
            let c = t1.elapsed().as_secs_f64();
            if i >= a.warmup {
                secs[0] += d;
                secs[1] += c;
                secs[2] += d + c;
            }
        }
        secs.iter_mut().for_each(|s| *s /= a.iters as f64);
        slowest(comm, &mut secs)?;
        let wrong = if a.check {
            total(comm, check_moe(comm, o, &mut case, t)?)?
        } else {
            0
        };
        let bytes = t * o.hidden * if o.fp8 { 1 } else { std::mem::size_of::<T>() };
        let algbw = bytes as f64 / secs[2] / 1e9;
        let row = Row {
            bytes,
            count: t * o.hidden,
            time_us: secs[2] * 1e6,
            algbw,
            busbw: algbw,
            wrong,
            tokens: Some(t),
            dispatch_us: Some(secs[0] * 1e6),
            combine_us: Some(secs[1] * 1e6),
            ..Row::default()
        };
        if lead {
            progress.print_row(&format!(
                "{:>10} {:>10} {:>9.2} {:>9.2} {:>9.2} {:>7}",
                t,
                bytes,
                secs[0] * 1e6,
                secs[1] * 1e6,
                secs[2] * 1e6,
                wrong
            ));
        }
        rows.push(row);
    }
    Ok(rows)
}

/// One more dispatch and combine on cleared outputs; counts this rank's wrong elements:
/// - dispatch: each local expert's count against the routing of every rank; each row in
///   (source rank, token, k) order, routed to that expert, and bit for bit its source token
///   (with `--fp8`: its fp8 codes and block scales);
/// - combine: `out[t, j]` against `Σ_k w[t, k] e[t, j]` in f64, where `e` is what the identity
///   experts returned (x itself; with `--fp8`, x's fp8 form dequantised to the type), within
///   `u |ref| + (K + 1) u32 Σ_k |w e|` (one rounding of the output, the f32 multiply-adds).
fn check_moe<T: Act>(comm: &Comm, o: &MoeOpts, case: &mut MoeCase<T>, tokens: usize) -> Result<u64> {
    let (n, me) = (comm.size(), comm.rank());
    let (h, cap, k) = (o.hidden, case.shape.capacity, o.topk);
    let local = o.experts / n;
    let first = me * local;
    case.counts.fill(-1);
    case.src.fill(-1);
    case.recv.fill(T::from_f32(f32::NAN));
    case.recv8.fill(F8E4M3::from_f32(f32::NAN));
    case.out.fill(T::from_f32(f32::NAN));
    case.dispatch(comm)?;
    let mut bad = 0u64;
    // Every rank's tokens and routing, as that rank made them.
    let sources: Vec<(Vec<T>, Vec<i32>)> = (0..n)
        .map(|r| (moe_tokens::<T>(o, r, tokens), routing(o, r, tokens).0))
        .collect();
    let quantised: Vec<(Vec<F8E4M3>, Vec<f32>)> = if o.fp8 {
        sources.iter().map(|(x, _)| quantise_blocks(x)).collect()
    } else {
        Vec::new()
    };
    for e in 0..local {
        let want = sources
            .iter()
            .map(|(_, ids)| ids.iter().filter(|&&x| x == (first + e) as i32).count())
            .sum::<usize>();
        if case.counts[e] != want as i32 {
            bad += 1;
        }
        let mut last: Option<(i32, i32, i32)> = None;
        for i in 0..want.min(cap) {
            let slot = e * cap + i;
            let (r, t, kk) = (case.src[slot * 3], case.src[slot * 3 + 1], case.src[slot * 3 + 2]);
            let valid = (0..n as i32).contains(&r) && (0..tokens as i32).contains(&t) && (0..k as i32).contains(&kk);
            if !valid
                || sources[r as usize].1[t as usize * k + kk as usize] != (first + e) as i32
                || last.is_some_and(|l| l >= (r, t, kk))
            {
                bad += h as u64;
                continue;
            }
            last = Some((r, t, kk));
            let (r, t) = (r as usize, t as usize);
            let at = t * h..(t + 1) * h;
            bad += if o.fp8 {
                let (q, s) = &quantised[r];
                let got = &case.recv8[slot * h..(slot + 1) * h];
                let codes = got.iter().zip(&q[at]).filter(|(a, b)| a != b).count();
                let sc = &case.recv_scales[slot * h / BLOCK..(slot + 1) * h / BLOCK];
                let scales = sc
                    .iter()
                    .zip(&s[t * h / BLOCK..(t + 1) * h / BLOCK])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                (codes + scales) as u64
            } else {
                let got = &case.recv[slot * h..(slot + 1) * h];
                got.iter()
                    .zip(&sources[r].0[at])
                    .filter(|(a, b)| a.to_f32().to_bits() != b.to_f32().to_bits())
                    .count() as u64
            };
        }
    }
    case.experts();
    comm.barrier()?;
    case.combine(comm)?;
    // What the identity experts returned for this rank's tokens.
    let e: Vec<T> = if o.fp8 {
        let mut e = vec![T::default(); case.tokens.len()];
        dequantise(&case.q, &case.scales, &mut e);
        e
    } else {
        case.tokens.clone()
    };
    for t in 0..tokens {
        let w = &case.weights[t * k..(t + 1) * k];
        let wsum: f64 = w.iter().map(|&v| v as f64).sum();
        let wabs: f64 = w.iter().map(|&v| (v as f64).abs()).sum();
        for j in 0..h {
            let x = e[t * h + j].to_f32() as f64;
            let want = wsum * x;
            let got = case.out[t * h + j].to_f32() as f64;
            let tol = T::U * want.abs() + (k + 1) as f64 * U32 * wabs * x.abs();
            if (got - want).abs() > tol || got.is_nan() {
                bad += 1;
            }
        }
    }
    Ok(bad)
}
