//! The inference collectives on the CPU engine: the fused all_reduce + residual + RMSNorm, and
//! MoE dispatch / combine. Each runs as a few of the engine's own exchanges (each a call of its
//! own, so a rank that called something else fails with `Error::Mismatch`) around the host
//! arithmetic of `compute/`.
//!
//! The fused norm is one-shot (every rank gathers every rank's `x` and computes every row) or
//! two-shot (rank r receives row block r of every rank's `x`, computes those rows, and the
//! results are gathered). Both sum the ranks in rank order in f32 and compute each row with
//! the same code, so every rank gets the same bits either way.
//!
//! A dispatch's send half moves each token once to every rank that owns one of its experts
//! (a count exchange, then the rows); the rows wait in `Pending` until the receive half packs
//! them per local expert in (source rank, token, k) order. Combine sends each expert row back
//! to its token's rank; the receive half sums `weight * row` over k in order.

use super::algorithms::{self, Algo};
use super::engine::{Engine, OpCtx};
use super::header::{Call, Tag, ANY_COUNT};
use crate::compute::rmsnorm::Norm;
use crate::compute::rows;
use crate::contracts::backend::{hint_ignored, unknown_hints_ignored, RunOptions};
use crate::contracts::dtype::DType;
use crate::contracts::error::{Error, Result};
use crate::contracts::inference::{MoeCombine, MoeDispatch, MoeShape, RmsNormFusion, FP8_BLOCK};

/// Operation codes of the calls' tags (header.rs names them).
pub(super) const FUSED_NORM: u8 = 11;
pub(super) const MOE_DISPATCH: u8 = 12;
pub(super) const MOE_COMBINE: u8 = 13;

/// Rows a dispatch or combine has sent and this rank has received, until its receive half.
#[derive(Default)]
pub(super) struct Pending {
    dispatch: Option<Arrived>,
    combine: Option<Arrived>,
}

/// What came from each source rank, with the shape and dtype it was sent with.
struct Arrived {
    shape: MoeShape,
    dtype: DType,
    from: Vec<Vec<u8>>,
}

impl Arrived {
    /// A send half may not start while the previous one's rows wait for their receive half.
    fn check_free(op: &'static str, slot: &Option<Arrived>) -> Result<()> {
        match slot {
            Some(_) => Err(Error::invalid(
                op,
                "the receive half of the previous call has not run: send halves cannot overlap",
            )),
            None => Ok(()),
        }
    }

    /// The rows of the send half before this receive half, which must have its shape and dtype.
    fn take(op: &'static str, slot: &mut Option<Arrived>, shape: MoeShape, dtype: DType) -> Result<Arrived> {
        let arrived = slot
            .take()
            .ok_or_else(|| Error::invalid(op, "a receive half without a send half before it"))?;
        if arrived.shape != shape || arrived.dtype != dtype {
            return Err(Error::invalid(
                op,
                format!(
                    "the receive half ({shape:?}, {dtype}) does not match its send half ({:?}, {})",
                    arrived.shape, arrived.dtype
                ),
            ));
        }
        Ok(arrived)
    }

    /// Every source sent whole records of `record` bytes.
    fn whole_records(&self, op: &'static str, record: usize) -> Result<()> {
        match self.from.iter().position(|m| m.len() % record != 0) {
            Some(r) => Err(Error::Protocol {
                context: op,
                reason: format!("rank {r} sent {} bytes, not whole rows of {record}", self.from[r].len()),
            }),
            None => Ok(()),
        }
    }
}

fn tag(code: u8, dtype: DType, sub: u8) -> Tag {
    Tag {
        op: code,
        dtype: dtype as u8,
        redop: sub,
        nbytes: 0,
    }
}

/// Opens one exchange of an inference collective: `count` and `root` are what every rank must
/// agree on (the root field carries the row length).
fn begin(e: &mut Engine, t: Tag, count: u64, hidden: usize, algo: Algo) {
    let call = Call {
        count,
        root: hidden.min(u32::MAX as usize) as u32,
        algo: algo.code(),
        seq: 0,
    };
    e.begin_call(t, call, true, true);
}

/// The fused norm's algorithm: the hint's (`oneshot`, `twoshot`), else one-shot up to
/// `direct_max` bytes of `x` per rank.
fn two_shot(f: &RmsNormFusion, opts: &RunOptions, direct_max: usize, size: usize) -> Result<bool> {
    const OP: &str = "all_reduce_residual_rmsnorm";
    unknown_hints_ignored("cpu", OP, opts.hints, &["algorithm"]);
    let by_size = f.x.byte_len() > direct_max && f.tokens() >= size;
    Ok(match opts.hints.get("algorithm").map(String::as_str) {
        None => by_size,
        Some("oneshot") => false,
        Some("twoshot") => true,
        Some(a @ ("direct" | "ring")) => {
            hint_ignored("cpu", OP, "algorithm", a, "the fused norm runs oneshot or twoshot");
            by_size
        }
        Some(other) => {
            return Err(Error::invalid(
                OP,
                format!("hint algorithm={other:?}: the fused norm accepts \"oneshot\" or \"twoshot\""),
            ))
        }
    })
}

pub(super) fn all_reduce_rmsnorm(
    e: &mut Engine,
    ctx: &OpCtx,
    f: &mut RmsNormFusion<'_>,
    opts: &RunOptions,
    tuning_direct_max: usize,
) -> Result<()> {
    let (size, me) = (e.size, e.rank);
    let twoshot = two_shot(f, opts, tuning_direct_max, size)?;
    let (d, hidden, tokens) = (f.x.dtype(), f.hidden, f.tokens());
    let out_dtype = f.out.dtype();
    let gamma = rows::load(f.gamma.host_bytes(), d);
    let norm = Norm {
        gamma: &gamma,
        eps: f.eps,
        dtype: d,
        out_dtype,
    };
    let (row_in, row_out) = (hidden * d.size(), hidden * out_dtype.size());
    let fp8 = f.scales.is_some();
    // The sub-code says which exchange of the algorithm a message belongs to, and the out
    // dtype: ranks must agree on both.
    let sub = |step: u8| step | (out_dtype as u8) << 2;
    let algo = |bytes: usize| {
        if bytes <= tuning_direct_max {
            Algo::Direct
        } else {
            Algo::Ring
        }
    };
    if !twoshot {
        let x = f.x.host_bytes();
        let mut all = vec![0u8; x.len() * size];
        {
            let mut parts: Vec<&mut [u8]> = all.chunks_mut(x.len().max(1)).take(size).collect();
            parts.resize_with(size, Default::default);
            let a = algo(x.len() * size);
            begin(e, tag(FUSED_NORM, d, sub(0)), (tokens * hidden) as u64, hidden, a);
            algorithms::all_gather(e, ctx, tag(FUSED_NORM, d, sub(0)), x, &mut parts, a)?;
        }
        let residual = f.residual.host_bytes_mut();
        let out = f.out.host_bytes_mut();
        let mut scales = f.scales.as_mut().map(|s| s.host_bytes_mut());
        let mut acc = vec![0f32; hidden];
        for t in 0..tokens {
            acc.fill(0.0);
            for r in 0..size {
                let at = r * x.len() + t * row_in;
                rows::add_into(&mut acc, &all[at..at + row_in], d);
            }
            let s = norm.row(
                &mut acc,
                &mut residual[t * row_in..(t + 1) * row_in],
                &mut out[t * row_out..(t + 1) * row_out],
            );
            if let Some(sc) = scales.as_deref_mut() {
                sc[4 * t..4 * t + 4].copy_from_slice(&s.to_le_bytes());
            }
        }
        return Ok(());
    }
    // Two-shot: rank b owns token rows blocks[b]..blocks[b + 1].
    let blocks: Vec<usize> = (0..=size).map(|b| b * tokens / size).collect();
    let rows_of = |b: usize| blocks[b + 1] - blocks[b];
    let x = f.x.host_bytes();
    let mine = rows_of(me);
    let mut recv = vec![0u8; mine * row_in * size];
    {
        let ins: Vec<&[u8]> = (0..size)
            .map(|b| &x[blocks[b] * row_in..blocks[b + 1] * row_in])
            .collect();
        let mut outs: Vec<&mut [u8]> = if mine == 0 {
            (0..size).map(|_| Default::default()).collect()
        } else {
            recv.chunks_mut(mine * row_in).collect()
        };
        let t = tag(FUSED_NORM, d, sub(1));
        e.begin_call(
            t,
            Call {
                count: ANY_COUNT,
                root: hidden as u32,
                algo: Algo::Direct.code(),
                seq: 0,
            },
            true,
            true,
        );
        algorithms::all_to_all(e, ctx, t, &ins, &mut outs)?;
    }
    // Our rows, packed as residual rows, then out rows, then (fp8) scales.
    let record = |rows: usize| rows * (row_in + row_out + if fp8 { 4 } else { 0 });
    let mut block = vec![0u8; record(mine)];
    {
        let (res, rest) = block.split_at_mut(mine * row_in);
        let (out, sc) = rest.split_at_mut(mine * row_out);
        res.copy_from_slice(&f.residual.host_bytes()[blocks[me] * row_in..blocks[me + 1] * row_in]);
        let mut acc = vec![0f32; hidden];
        for i in 0..mine {
            acc.fill(0.0);
            for r in 0..size {
                let at = r * mine * row_in + i * row_in;
                rows::add_into(&mut acc, &recv[at..at + row_in], d);
            }
            let s = norm.row(
                &mut acc,
                &mut res[i * row_in..(i + 1) * row_in],
                &mut out[i * row_out..(i + 1) * row_out],
            );
            if fp8 {
                sc[4 * i..4 * i + 4].copy_from_slice(&s.to_le_bytes());
            }
        }
    }
    let mut gathered = vec![0u8; record(tokens)];
    let a = algo(gathered.len());
    {
        let mut parts: Vec<&mut [u8]> = Vec::with_capacity(size);
        let mut rest = &mut gathered[..];
        for b in 0..size {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(record(rows_of(b)));
            parts.push(head);
            rest = tail;
        }
        let t = tag(FUSED_NORM, d, sub(2));
        begin(e, t, (tokens * hidden) as u64, hidden, a);
        algorithms::all_gather(e, ctx, t, &block, &mut parts, a)?;
    }
    let residual = f.residual.host_bytes_mut();
    let out = f.out.host_bytes_mut();
    let mut scales = f.scales.as_mut().map(|s| s.host_bytes_mut());
    let mut at = 0;
    for b in 0..size {
        let (lo, hi, n) = (blocks[b], blocks[b + 1], rows_of(b));
        residual[lo * row_in..hi * row_in].copy_from_slice(&gathered[at..at + n * row_in]);
        at += n * row_in;
        out[lo * row_out..hi * row_out].copy_from_slice(&gathered[at..at + n * row_out]);
        at += n * row_out;
        if let Some(sc) = scales.as_deref_mut() {
            sc[lo * 4..hi * 4].copy_from_slice(&gathered[at..at + n * 4]);
            at += n * 4;
        }
    }
    Ok(())
}

/// Reads expert ids (i32 or i64) as i64.
fn expert_ids(bytes: &[u8], dtype: DType) -> Vec<i64> {
    match dtype {
        DType::I64 => bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap_or_default()) as i64)
            .collect(),
    }
}

fn check_ids(op: &'static str, ids: &[i64], experts: usize) -> Result<()> {
    match ids.iter().position(|&x| x < -1 || x >= experts as i64) {
        Some(i) => Err(Error::invalid(
            op,
            format!("topk_idx[{i}] = {} is not an expert (0..{experts}) or -1", ids[i]),
        )),
        None => Ok(()),
    }
}

/// Sends `msgs[p]` to every rank p and returns what each rank sent here: a count exchange,
/// then the messages (two calls).
fn exchange(e: &mut Engine, ctx: &OpCtx, code: u8, d: DType, hidden: usize, msgs: &[Vec<u8>]) -> Result<Vec<Vec<u8>>> {
    let size = e.size;
    let lens: Vec<[u8; 8]> = msgs.iter().map(|m| (m.len() as u64).to_le_bytes()).collect();
    let mut got = vec![[0u8; 8]; size];
    {
        let t = tag(code, d, 0);
        let ins: Vec<&[u8]> = lens.iter().map(|l| &l[..]).collect();
        let mut outs: Vec<&mut [u8]> = got.iter_mut().map(|g| &mut g[..]).collect();
        begin(e, t, size as u64, hidden, Algo::Direct);
        algorithms::all_to_all(e, ctx, t, &ins, &mut outs)?;
    }
    let mut from: Vec<Vec<u8>> = got.iter().map(|g| vec![0u8; u64::from_le_bytes(*g) as usize]).collect();
    let t = tag(code, d, 1);
    let ins: Vec<&[u8]> = msgs.iter().map(|m| &m[..]).collect();
    let mut outs: Vec<&mut [u8]> = from.iter_mut().map(|f| &mut f[..]).collect();
    e.begin_call(
        t,
        Call {
            count: ANY_COUNT,
            root: hidden as u32,
            algo: Algo::Direct.code(),
            seq: 0,
        },
        true,
        true,
    );
    algorithms::all_to_all(e, ctx, t, &ins, &mut outs)?;
    Ok(from)
}

/// Bytes of a dispatched row: the token (u32), its K expert ids (i32), the row, its scales.
fn dispatch_record(s: &MoeShape, d: DType) -> usize {
    4 + 4 * s.topk + s.hidden * d.size() + fp8_scale_bytes(s, d)
}

fn fp8_scale_bytes(s: &MoeShape, d: DType) -> usize {
    if d == DType::F8E4M3 {
        4 * (s.hidden / FP8_BLOCK)
    } else {
        0
    }
}

pub(super) fn moe_dispatch(e: &mut Engine, ctx: &OpCtx, pending: &mut Pending, m: &mut MoeDispatch<'_>) -> Result<()> {
    const OP: &str = "moe_dispatch";
    let (size, s) = (e.size, m.shape);
    let local = s.local_experts(size);
    if let Some(send) = &m.send {
        Arrived::check_free(OP, &pending.dispatch)?;
        let d = send.tokens.dtype();
        let ids = expert_ids(send.topk_idx.host_bytes(), send.topk_idx.dtype());
        check_ids(OP, &ids, s.experts)?;
        let (row, sc) = (s.hidden * d.size(), fp8_scale_bytes(&s, d));
        let tokens = send.tokens.host_bytes();
        let scales = send.scales.as_ref().map(|b| b.host_bytes());
        let mut msgs = vec![Vec::new(); size];
        for (t, k_ids) in ids.chunks_exact(s.topk).enumerate() {
            let mut sent_to = vec![false; size];
            for &x in k_ids.iter().filter(|&&x| x >= 0) {
                let dst = x as usize / local;
                if std::mem::replace(&mut sent_to[dst], true) {
                    continue;
                }
                let msg = &mut msgs[dst];
                msg.extend_from_slice(&(t as u32).to_le_bytes());
                k_ids
                    .iter()
                    .for_each(|&k| msg.extend_from_slice(&(k as i32).to_le_bytes()));
                msg.extend_from_slice(&tokens[t * row..(t + 1) * row]);
                if let Some(scales) = scales {
                    msg.extend_from_slice(&scales[t * sc..(t + 1) * sc]);
                }
            }
        }
        let from = exchange(e, ctx, MOE_DISPATCH, d, s.hidden, &msgs)?;
        pending.dispatch = Some(Arrived {
            shape: s,
            dtype: d,
            from,
        });
    }
    let Some(recv) = &mut m.recv else { return Ok(()) };
    let d = recv.tokens.dtype();
    let arrived = Arrived::take(OP, &mut pending.dispatch, s, d)?;
    let (row, sc) = (s.hidden * d.size(), fp8_scale_bytes(&s, d));
    let record = dispatch_record(&s, d);
    let first = e.rank * local;
    let mut counts = vec![0usize; local];
    let out = recv.tokens.host_bytes_mut();
    let mut out_scales = recv.scales.as_mut().map(|b| b.host_bytes_mut());
    let src = recv.src.host_bytes_mut();
    arrived.whole_records(OP, record)?;
    for (r, msg) in arrived.from.iter().enumerate() {
        for rec in msg.chunks_exact(record) {
            let token = u32::from_le_bytes(rec[..4].try_into().unwrap_or_default());
            let ids = &rec[4..4 + 4 * s.topk];
            let data = &rec[4 + 4 * s.topk..4 + 4 * s.topk + row];
            let data_scales = &rec[4 + 4 * s.topk + row..];
            for (k, id) in ids.chunks_exact(4).enumerate() {
                let x = i32::from_le_bytes(id.try_into().unwrap_or_default()) as i64;
                if x < first as i64 || x >= (first + local) as i64 {
                    continue;
                }
                let el = x as usize - first;
                let i = counts[el];
                counts[el] += 1;
                if i >= s.capacity {
                    continue;
                }
                let slot = el * s.capacity + i;
                out[slot * row..(slot + 1) * row].copy_from_slice(data);
                if let Some(o) = out_scales.as_deref_mut() {
                    o[slot * sc..(slot + 1) * sc].copy_from_slice(data_scales);
                }
                for (j, v) in [r as i32, token as i32, k as i32].into_iter().enumerate() {
                    src[(slot * 3 + j) * 4..(slot * 3 + j + 1) * 4].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    let counts_out = recv.counts.host_bytes_mut();
    for (el, &c) in counts.iter().enumerate() {
        counts_out[el * 4..el * 4 + 4].copy_from_slice(&(c.min(i32::MAX as usize) as i32).to_le_bytes());
    }
    match counts.iter().position(|&c| c > s.capacity) {
        Some(el) => Err(Error::CapacityExceeded {
            op: OP,
            what: format!("local expert {el} (expert {}) of rank {}", first + el, e.rank),
            count: counts[el],
            capacity: s.capacity,
        }),
        None => Ok(()),
    }
}

fn read_i32(b: &[u8], i: usize) -> i32 {
    i32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().unwrap_or_default())
}

pub(super) fn moe_combine(e: &mut Engine, ctx: &OpCtx, pending: &mut Pending, m: &mut MoeCombine<'_>) -> Result<()> {
    const OP: &str = "moe_combine";
    let (size, s) = (e.size, m.shape);
    let local = s.local_experts(size);
    if let Some(send) = &m.send {
        Arrived::check_free(OP, &pending.combine)?;
        let d = send.expert_out.dtype();
        let row = s.hidden * d.size();
        let (out, src, counts) = (
            send.expert_out.host_bytes(),
            send.src.host_bytes(),
            send.counts.host_bytes(),
        );
        let mut msgs = vec![Vec::new(); size];
        for el in 0..local {
            let c = read_i32(counts, el);
            if c < 0 {
                return Err(Error::invalid(OP, format!("counts[{el}] = {c} is negative")));
            }
            for i in 0..(c as usize).min(s.capacity) {
                let slot = el * s.capacity + i;
                let (r, t, k) = (
                    read_i32(src, slot * 3),
                    read_i32(src, slot * 3 + 1),
                    read_i32(src, slot * 3 + 2),
                );
                if r < 0 || r as usize >= size || t < 0 || k < 0 || k as usize >= s.topk {
                    return Err(Error::invalid(
                        OP,
                        format!("src[{el}, {i}] = ({r}, {t}, {k}) is not a dispatched row's source"),
                    ));
                }
                let msg = &mut msgs[r as usize];
                msg.extend_from_slice(&(t as u32).to_le_bytes());
                msg.extend_from_slice(&(k as u32).to_le_bytes());
                msg.extend_from_slice(&out[slot * row..(slot + 1) * row]);
            }
        }
        let from = exchange(e, ctx, MOE_COMBINE, d, s.hidden, &msgs)?;
        pending.combine = Some(Arrived {
            shape: s,
            dtype: d,
            from,
        });
    }
    let Some(recv) = &mut m.recv else { return Ok(()) };
    let d = recv.out.dtype();
    let arrived = Arrived::take(OP, &mut pending.combine, s, d)?;
    let ids = expert_ids(recv.topk_idx.host_bytes(), recv.topk_idx.dtype());
    check_ids(OP, &ids, s.experts)?;
    let tokens = ids.len() / s.topk;
    let weights = rows::load(recv.topk_weights.host_bytes(), DType::F32);
    let row = s.hidden * d.size();
    // Where the row of (token, k) arrived.
    let mut at: Vec<Option<(usize, usize)>> = vec![None; tokens * s.topk];
    let record = 8 + row;
    arrived.whole_records(OP, record)?;
    for (r, msg) in arrived.from.iter().enumerate() {
        for (i, rec) in msg.chunks_exact(record).enumerate() {
            let t = u32::from_le_bytes(rec[..4].try_into().unwrap_or_default()) as usize;
            let k = u32::from_le_bytes(rec[4..8].try_into().unwrap_or_default()) as usize;
            let owner = ids.get(t * s.topk + k).map(|&x| x / local as i64);
            if t >= tokens || k >= s.topk || owner != Some(r as i64) {
                return Err(Error::invalid(
                    OP,
                    format!("rank {r} returned a row for token {t}, k = {k}, which it was not sent"),
                ));
            }
            at[t * s.topk + k] = Some((r, i * record + 8));
        }
    }
    let out = recv.out.host_bytes_mut();
    let mut acc = vec![0f32; s.hidden];
    for t in 0..tokens {
        acc.fill(0.0);
        for k in 0..s.topk {
            let x = ids[t * s.topk + k];
            if x < 0 {
                continue;
            }
            let Some((r, off)) = at[t * s.topk + k] else {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "no row came back for token {t}, k = {k} (expert {x} on rank {}): its dispatch \
                         exceeded that expert's capacity, or the expert rank's counts were cut",
                        x / local as i64
                    ),
                ));
            };
            rows::add_scaled_into(&mut acc, &arrived.from[r][off..off + row], d, weights[t * s.topk + k]);
        }
        rows::store(&mut out[t * row..(t + 1) * row], &acc, d);
    }
    Ok(())
}
