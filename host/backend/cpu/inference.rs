//! The inference collectives on the CPU engine: the fused all_reduce + residual + RMSNorm, and
//! MoE dispatch / combine. Each runs as a few of the engine's own exchanges (each a call of its
//! own, so a rank that called something else fails with `Error::Mismatch`) around the host
//! arithmetic of `compute/`.
//!
//! The fused norm is one-shot (every rank gathers every rank's `x` and computes every row) or
//! two-shot (rank r receives row block r of every rank's `x`, computes those rows, and the
//! results are gathered: the residual and output rows, or for f32 the residual rows alone,
//! from which each rank computes the output rows). Where every rank shares this host and `x`
//! fits, one-shot is a shared-memory round (oneshot.rs). Both sum the ranks in rank order in
//! f32 and compute each row with the same code, so every rank gets the same bits either way.
//!
//! A dispatch's send half moves each token once to every rank that owns one of its experts
//! (a count exchange, then the rows); the rows wait in `Pending` until the receive half packs
//! them per local expert in (source rank, token, k) order. Combine sends each expert row back
//! to its token's rank; the receive half sums `weight * row` over k in order.

use super::algorithms::{self, Algo, Scratch};
use super::engine::{Engine, OpCtx};
use super::header::{Call, Tag, ANY_COUNT};
use super::oneshot;
use crate::compute::rmsnorm::Norm;
use crate::compute::rows;
use crate::contracts::backend::{hint_ignored, unknown_hints_ignored, RunOptions};
use crate::contracts::dtype::DType;
use crate::contracts::error::{Error, Result};
use crate::contracts::inference::{
    CombineSend, DispatchSend, MoeCombine, MoeDispatch, MoeShape, RmsNormFusion, FP8_BLOCK,
};
use crate::contracts::ops::Op;

/// Operation codes of the calls' tags (header.rs names them).
pub(super) const FUSED_NORM: u8 = 11;
pub(super) const MOE_DISPATCH: u8 = 12;
pub(super) const MOE_COMBINE: u8 = 13;

/// Rows a dispatch or combine has sent and this rank has received, until its receive half;
/// and the message buffers of earlier calls, kept for the next ones (allocating, and faulting
/// in, megabytes per call cost more than the copies into them).
#[derive(Default)]
pub(super) struct Pending {
    dispatch: Option<Arrived>,
    combine: Option<Arrived>,
    spare: Vec<Vec<u8>>,
}

impl Pending {
    /// The spare buffer for `len` bytes: the smallest that holds them, else the largest.
    fn pick(&mut self, len: usize) -> Vec<u8> {
        let fits = (0..self.spare.len())
            .filter(|&i| self.spare[i].capacity() >= len)
            .min_by_key(|&i| self.spare[i].capacity());
        let largest = (0..self.spare.len()).max_by_key(|&i| self.spare[i].capacity());
        fits.or(largest).map_or_else(Vec::new, |i| self.spare.swap_remove(i))
    }

    /// A buffer of `len` bytes, contents unspecified (an exchange overwrites them all): only
    /// bytes past the spare buffer's old length are written here.
    fn buffer(&mut self, len: usize) -> Vec<u8> {
        let mut v = self.pick(len);
        if v.len() > len {
            v.truncate(len);
        } else {
            v.resize(len, 0);
        }
        v
    }

    /// An empty buffer with room for `len` bytes.
    fn empty(&mut self, len: usize) -> Vec<u8> {
        let mut v = self.pick(len);
        v.clear();
        v.reserve(len);
        v
    }

    fn give_back(&mut self, bufs: impl IntoIterator<Item = Vec<u8>>) {
        self.spare.extend(bufs);
    }
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

/// The fused norm's algorithm: the hint's (`oneshot`, `twoshot`), else `by_size`.
fn two_shot(f: &RmsNormFusion, opts: &RunOptions, direct_max: usize, size: usize) -> Result<bool> {
    const OP: &str = "all_reduce_residual_rmsnorm";
    unknown_hints_ignored("cpu", OP, opts.hints, &["algorithm"]);
    let by_size = by_size(f, direct_max, size);
    Ok(match opts.hints.get("algorithm").map(String::as_str) {
        None => by_size,
        Some("oneshot") => false,
        Some("twoshot") => true,
        Some(a @ ("direct" | "ring" | "two_level")) => {
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

/// Two-shot unless one-shot is better: up to `direct_max` bytes of `x` per rank (one
/// exchange), and wherever it moves no more bytes. One-shot receives `(n - 1) x`, two-shot
/// `(n - 1) / n` of `x` and of the rows it gathers back (see `gathered_row`), so one-shot wins
/// while those rows are at least `n - 1` times `x`'s (f32 up to 2 ranks, f16 / bf16 up to 3,
/// with fp8 out up to 2).
fn by_size(f: &RmsNormFusion, direct_max: usize, size: usize) -> bool {
    let row_in = f.hidden * f.x.dtype().size();
    let fewer_bytes = gathered_row(f) < (size - 1) * row_in;
    f.x.byte_len() > direct_max && f.tokens() >= size && fewer_bytes
}

/// Whether one-shot runs as a shared-memory round (oneshot.rs): every rank on this host, and
/// `x` within a round's slot. The round reads peers' rows in place, one copy instead of the
/// rings' two.
fn on_board(e: &Engine, f: &RmsNormFusion, twoshot: bool) -> bool {
    !twoshot && e.size > 1 && oneshot::fits(e, f.x.byte_len()) && f.hidden as u64 <= oneshot::ARG_MAX
}

/// Bytes per token row that two-shot gathers from the rank that computed it: the new residual
/// row, and the output row and its fp8 scale. An f32 residual row is the row's f32 sum itself
/// (its rounding is exact), from which every rank computes the output row in the same order,
/// to the same bits: f32 gathers the residual only.
fn gathered_row(f: &RmsNormFusion) -> usize {
    let d = f.x.dtype();
    let row_in = f.hidden * d.size();
    if d == DType::F32 {
        row_in
    } else {
        row_in + f.hidden * f.out.dtype().size() + if f.scales.is_some() { 4 } else { 0 }
    }
}

/// Splits `buf` into consecutive parts of the given byte lengths.
fn split_parts(buf: &mut [u8], lens: impl IntoIterator<Item = usize>) -> Vec<&mut [u8]> {
    let mut rest = buf;
    lens.into_iter()
        .map(|n| {
            let (a, b) = std::mem::take(&mut rest).split_at_mut(n);
            rest = b;
            a
        })
        .collect()
}

/// Peer p's slot among the `size - 1` peers of rank `me` (our own data is read in place).
fn peer_slot(p: usize, me: usize) -> usize {
    if p < me {
        p
    } else {
        p - 1
    }
}

/// The fused norm. Nothing is staged that can be read in place: our own `x` rows are summed
/// from `x`, peers' rows land in the engine's scratch (kept between calls), and results are
/// written to, and gathered into, the caller's buffers directly.
pub(super) fn all_reduce_rmsnorm(
    e: &mut Engine,
    scratch: &mut Scratch,
    ctx: &OpCtx,
    f: &mut RmsNormFusion<'_>,
    opts: &RunOptions,
    tuning_direct_max: usize,
) -> Result<()> {
    let (size, me) = (e.size, e.rank);
    let twoshot = match two_shot(f, opts, tuning_direct_max, size) {
        Ok(t) => t,
        Err(why) => return refuse_norm(e, ctx, f, opts, tuning_direct_max, why),
    };
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
    // The sub-code says which exchange of the algorithm a message belongs to, and the out
    // dtype: ranks must agree on both.
    let sub = |step: u8| step | (out_dtype as u8) << 2;
    let count = (tokens * hidden) as u64;
    let x = f.x.host_bytes();
    let mut acc = vec![0f32; hidden];
    if on_board(e, f, twoshot) {
        // Every rank's x in one shared-memory round, read in place; each computes every row.
        e.settle_deferred(ctx)?;
        e.count_call();
        let round = oneshot::gather_in_place(e, ctx, tag(FUSED_NORM, d, sub(0)), hidden as u64, x)?;
        let residual = f.residual.host_bytes_mut();
        let out = f.out.host_bytes_mut();
        let mut scales = f.scales.as_mut().map(|s| s.host_bytes_mut());
        for t in 0..tokens {
            acc.fill(0.0);
            for r in 0..size {
                let from = if r == me {
                    x
                } else {
                    oneshot::data(e, r, round, x.len())
                };
                rows::add_into(&mut acc, &from[t * row_in..(t + 1) * row_in], d);
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
    if !twoshot {
        // Every rank's x to every rank; each computes every row.
        let (peers, _) = scratch.two(x.len() * (size - 1), 0);
        let mut slots = split_parts(peers, std::iter::repeat(x.len()).take(size - 1));
        let t = tag(FUSED_NORM, d, sub(0));
        begin(e, t, count, hidden, Algo::Direct);
        if size > 1 {
            let mut xf = Vec::with_capacity(2 * (size - 1));
            for (i, slot) in slots.iter_mut().enumerate() {
                let p = if i < me { i } else { i + 1 };
                xf.push(e.send(p, t, x));
                xf.push(e.recv(p, t, slot));
            }
            e.exchange(ctx, &mut xf)?;
        }
        let residual = f.residual.host_bytes_mut();
        let out = f.out.host_bytes_mut();
        let mut scales = f.scales.as_mut().map(|s| s.host_bytes_mut());
        for t in 0..tokens {
            acc.fill(0.0);
            for r in 0..size {
                let from = if r == me { x } else { &*slots[peer_slot(r, me)] };
                rows::add_into(&mut acc, &from[t * row_in..(t + 1) * row_in], d);
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
    // Two-shot: rank b owns token rows blocks[b]..blocks[b + 1]. First each rank receives its
    // block of every peer's x.
    let blocks: Vec<usize> = (0..=size).map(|b| b * tokens / size).collect();
    let rows_of = |b: usize| blocks[b + 1] - blocks[b];
    let (lo, hi) = (blocks[me], blocks[me + 1]);
    let mine = hi - lo;
    let (peers, _) = scratch.two(mine * row_in * (size - 1), 0);
    {
        let mut slots = split_parts(peers, std::iter::repeat(mine * row_in).take(size - 1));
        let t = tag(FUSED_NORM, d, sub(1));
        begin(e, t, count, hidden, Algo::Direct);
        let mut xf = Vec::with_capacity(2 * (size - 1));
        for (i, slot) in slots.iter_mut().enumerate() {
            let p = if i < me { i } else { i + 1 };
            xf.push(e.send(p, t, &x[blocks[p] * row_in..blocks[p + 1] * row_in]));
            xf.push(e.recv(p, t, slot));
        }
        e.exchange(ctx, &mut xf)?;
    }
    // Our rows, written in place.
    let residual = f.residual.host_bytes_mut();
    let out = f.out.host_bytes_mut();
    let mut scales = f.scales.as_mut().map(|s| s.host_bytes_mut());
    for t in lo..hi {
        acc.fill(0.0);
        for r in 0..size {
            let row = if r == me {
                &x[t * row_in..(t + 1) * row_in]
            } else {
                let at = (peer_slot(r, me) * mine + t - lo) * row_in;
                &peers[at..at + row_in]
            };
            rows::add_into(&mut acc, row, d);
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
    // Then every rank's rows to every rank, straight into the caller's buffers: the residual
    // rows, and (but for f32, see `gathered_row`) the output rows and their scales. The same
    // call as the first exchange, whose calls have been checked: several messages may go to
    // one peer (in a call's first exchange, a peer's second message would wait behind the
    // first one's payload, which waits for every call).
    let local_out = d == DType::F32;
    {
        let t = tag(FUSED_NORM, d, sub(2));
        let lens = |row: usize| (0..size).map(move |b| rows_of(b) * row);
        let mut res = split_parts(&mut *residual, lens(row_in));
        let own_res: &[u8] = std::mem::take::<&mut [u8]>(&mut res[me]);
        let (mut outs, mut scs) = (Vec::new(), Vec::new());
        let (mut own_out, mut own_sc): (&[u8], &[u8]) = (&[], &[]);
        if !local_out {
            outs = split_parts(&mut *out, lens(row_out));
            own_out = std::mem::take::<&mut [u8]>(&mut outs[me]);
            if let Some(sc) = scales.as_deref_mut() {
                scs = split_parts(sc, lens(4));
                own_sc = std::mem::take::<&mut [u8]>(&mut scs[me]);
            }
        }
        let mut xf = Vec::with_capacity(6 * (size - 1));
        for p in (0..size).filter(|&p| p != me) {
            xf.push(e.send(p, t, own_res));
            xf.push(e.recv(p, t, std::mem::take(&mut res[p])));
            if !local_out {
                xf.push(e.send(p, t, own_out));
                xf.push(e.recv(p, t, std::mem::take(&mut outs[p])));
                if !scs.is_empty() {
                    xf.push(e.send(p, t, own_sc));
                    xf.push(e.recv(p, t, std::mem::take(&mut scs[p])));
                }
            }
        }
        e.exchange(ctx, &mut xf)?;
    }
    if local_out {
        // The other ranks' rows: their f32 sums are their residual rows, bit for bit.
        let residual = f.residual.host_bytes();
        for t in (0..tokens).filter(|t| !(lo..hi).contains(t)) {
            rows::load_into(&mut acc, &residual[t * row_in..(t + 1) * row_in], d);
            let s = norm.normalise(&mut acc, &mut out[t * row_out..(t + 1) * row_out]);
            if let Some(sc) = scales.as_deref_mut() {
                sc[4 * t..4 * t + 4].copy_from_slice(&s.to_le_bytes());
            }
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

/// The shape's fields as the count exchange carries them, after the message's length.
const SHAPE_FIELDS: [&str; 4] = ["experts", "topk", "hidden", "capacity"];

/// The count exchange's message to one peer: the length of our message to it, and our shape.
fn count_message(len: usize, s: &MoeShape) -> [u8; 40] {
    let mut m = [0u8; 40];
    let words = [len, s.experts, s.topk, s.hidden, s.capacity];
    for (i, w) in words.into_iter().enumerate() {
        m[8 * i..8 * i + 8].copy_from_slice(&(w as u64).to_le_bytes());
    }
    m
}

fn word(m: &[u8; 40], i: usize) -> u64 {
    u64::from_le_bytes(m[8 * i..8 * i + 8].try_into().unwrap_or_default())
}

/// Sends `msgs[p]` to every rank p and returns what each rank sent here: a count exchange
/// (which also carries every rank's shape: a rank of another shape is `Error::Mismatch` on
/// every rank, naming the first in rank order that differs from this one, before any row
/// moves), then the messages (two calls). Our own message is kept as it is, not copied; the
/// others' land in spare buffers.
fn exchange(
    e: &mut Engine,
    ctx: &OpCtx,
    pending: &mut Pending,
    (code, d, s): (u8, DType, &MoeShape),
    mut msgs: Vec<Vec<u8>>,
) -> Result<Vec<Vec<u8>>> {
    let (size, me, hidden) = (e.size, e.rank, s.hidden);
    let lens: Vec<[u8; 40]> = msgs.iter().map(|m| count_message(m.len(), s)).collect();
    let mut got = vec![[0u8; 40]; size];
    {
        let t = tag(code, d, 0);
        let ins: Vec<&[u8]> = lens.iter().map(|l| &l[..]).collect();
        let mut outs: Vec<&mut [u8]> = got.iter_mut().map(|g| &mut g[..]).collect();
        // The row length travels with the shape (checked below, by name).
        begin(e, t, size as u64, 0, Algo::Direct);
        algorithms::all_to_all(e, ctx, t, &ins, &mut outs)?;
    }
    for (p, theirs) in got.iter().enumerate().filter(|&(p, _)| p != me) {
        let ours = &lens[p];
        if let Some(f) = (0..SHAPE_FIELDS.len()).find(|&f| word(ours, f + 1) != word(theirs, f + 1)) {
            return Err(Error::Mismatch {
                op: ctx.op,
                peer: p,
                detail: format!(
                    "MoE shape, {}: this rank has {}, rank {p} has {}",
                    SHAPE_FIELDS[f],
                    word(ours, f + 1),
                    word(theirs, f + 1)
                ),
            });
        }
    }
    let mut from: Vec<Vec<u8>> = (0..size)
        .map(|p| pending.buffer(if p == me { 0 } else { word(&got[p], 0) as usize }))
        .collect();
    {
        let t = tag(code, d, 1);
        let ins: Vec<&[u8]> = (0..size)
            .map(|p| if p == me { &[][..] } else { &msgs[p][..] })
            .collect();
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
    }
    std::mem::swap(&mut from[me], &mut msgs[me]);
    pending.give_back(msgs);
    Ok(from)
}

/// Fails the call with `why`, an argument error of this rank's own, after telling the peers
/// (`Engine::refuse`): they fail at once too, with an error naming this rank, instead of
/// waiting for it until their timeout. If the peers cannot be told, that failure is the error.
fn refuse(e: &mut Engine, ctx: &OpCtx, code: u8, d: DType, why: Error) -> Result<()> {
    refused(e.refuse(ctx, tag(code, d, 0), reason(&why).as_bytes()), ctx, why)
}

/// `refuse` for the fused norm, whose one-shot may run as a shared-memory round: the refusal
/// takes the way the peers' call takes (judged by this rank's `x`, with its hint if valid).
fn refuse_norm(
    e: &mut Engine,
    ctx: &OpCtx,
    f: &RmsNormFusion,
    opts: &RunOptions,
    direct_max: usize,
    why: Error,
) -> Result<()> {
    let twoshot = match opts.hints.get("algorithm").map(String::as_str) {
        Some("oneshot") => false,
        Some("twoshot") => true,
        _ => by_size(f, direct_max, e.size),
    };
    let t = tag(FUSED_NORM, f.x.dtype(), 0);
    let told = if on_board(e, f, twoshot) {
        e.settle_deferred(ctx).and_then(|()| {
            e.count_call();
            oneshot::refuse(e, ctx, t, reason(&why).as_bytes())
        })
    } else {
        e.refuse(ctx, t, reason(&why).as_bytes())
    };
    refused(told, ctx, why)
}

/// The text a refusing rank sends its peers.
fn reason(why: &Error) -> String {
    match why {
        Error::InvalidArgument { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

fn refused(told: Result<()>, ctx: &OpCtx, why: Error) -> Result<()> {
    if let Err(lost) = told {
        tracing::debug!(op = ctx.op, error = %why, "the peers could not be told of this rank's refusal");
        return Err(lost);
    }
    Err(why)
}

/// Tells the peers that this rank refuses `op` (`Backend::refuse`): the error of its own
/// checks (`reason`) goes to its caller; this is only the peers' part.
pub(super) fn refuse_op(
    e: &mut Engine,
    ctx: &OpCtx,
    op: &Op<'_>,
    opts: &RunOptions,
    direct_max: usize,
    reason: &str,
) -> Result<()> {
    let why = Error::invalid(ctx.op, reason);
    let r = match op {
        Op::AllReduceRmsNorm(f) => refuse_norm(e, ctx, f, opts, direct_max, why),
        Op::MoeDispatch(_) => refuse(e, ctx, MOE_DISPATCH, DType::U8, why),
        Op::MoeCombine(_) => refuse(e, ctx, MOE_COMBINE, DType::U8, why),
        _ => return Ok(()),
    };
    match r {
        Err(Error::InvalidArgument { .. }) => Ok(()),
        other => other,
    }
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

/// The dispatch's messages: each token once to every rank that owns one of its experts, as
/// records of `dispatch_record` bytes, each message allocated once at its final size.
fn dispatch_messages(
    pending: &mut Pending,
    s: &MoeShape,
    size: usize,
    send: &DispatchSend,
    ids: &[i64],
) -> Vec<Vec<u8>> {
    let d = send.tokens.dtype();
    let local = s.local_experts(size);
    let (row, sc) = (s.hidden * d.size(), fp8_scale_bytes(s, d));
    let tokens = send.tokens.host_bytes();
    let scales = send.scales.as_ref().map(|b| b.host_bytes());
    // The ranks token t goes to: `last[dst] == t + 1` once it has gone there.
    let mut last = vec![0usize; size];
    let mut each_token = |f: &mut dyn FnMut(usize, usize, &[i64])| {
        last.fill(0);
        for (t, k_ids) in ids.chunks_exact(s.topk).enumerate() {
            for &x in k_ids.iter().filter(|&&x| x >= 0) {
                let dst = x as usize / local;
                if std::mem::replace(&mut last[dst], t + 1) != t + 1 {
                    f(t, dst, k_ids);
                }
            }
        }
    };
    let mut records = vec![0usize; size];
    each_token(&mut |_, dst, _| records[dst] += 1);
    let record = dispatch_record(s, d);
    let mut msgs: Vec<Vec<u8>> = records.iter().map(|&n| pending.empty(n * record)).collect();
    each_token(&mut |t, dst, k_ids| {
        let msg = &mut msgs[dst];
        msg.extend_from_slice(&(t as u32).to_le_bytes());
        k_ids
            .iter()
            .for_each(|&k| msg.extend_from_slice(&(k as i32).to_le_bytes()));
        msg.extend_from_slice(&tokens[t * row..(t + 1) * row]);
        if let Some(scales) = scales {
            msg.extend_from_slice(&scales[t * sc..(t + 1) * sc]);
        }
    });
    msgs
}

pub(super) fn moe_dispatch(e: &mut Engine, ctx: &OpCtx, pending: &mut Pending, m: &mut MoeDispatch<'_>) -> Result<()> {
    const OP: &str = "moe_dispatch";
    let (size, s) = (e.size, m.shape);
    let local = s.local_experts(size);
    if let Some(send) = &m.send {
        let d = send.tokens.dtype();
        let ids = expert_ids(send.topk_idx.host_bytes(), send.topk_idx.dtype());
        if let Err(why) = Arrived::check_free(OP, &pending.dispatch).and_then(|_| check_ids(OP, &ids, s.experts)) {
            return refuse(e, ctx, MOE_DISPATCH, d, why);
        }
        let msgs = dispatch_messages(pending, &s, size, send, &ids);
        let from = exchange(e, ctx, pending, (MOE_DISPATCH, d, &s), msgs)?;
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
    pending.give_back(arrived.from);
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

/// The rows of a combine's send half that go to each rank, once `counts` and `src` are
/// checked.
fn combine_records(s: &MoeShape, size: usize, send: &CombineSend) -> Result<Vec<usize>> {
    const OP: &str = "moe_combine";
    let (src, counts) = (send.src.host_bytes(), send.counts.host_bytes());
    let mut records = vec![0usize; size];
    for el in 0..s.local_experts(size) {
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
            records[r as usize] += 1;
        }
    }
    Ok(records)
}

/// Each expert row back to its token's rank: (token u32, k u32, the row), each message
/// allocated once at its final size.
fn combine_messages(pending: &mut Pending, s: &MoeShape, send: &CombineSend, records: &[usize]) -> Vec<Vec<u8>> {
    let row = s.hidden * send.expert_out.dtype().size();
    let (out, src, counts) = (
        send.expert_out.host_bytes(),
        send.src.host_bytes(),
        send.counts.host_bytes(),
    );
    let mut msgs: Vec<Vec<u8>> = records.iter().map(|&n| pending.empty(n * (8 + row))).collect();
    for el in 0..s.local_experts(records.len()) {
        for i in 0..(read_i32(counts, el) as usize).min(s.capacity) {
            let slot = el * s.capacity + i;
            let (r, t, k) = (
                read_i32(src, slot * 3),
                read_i32(src, slot * 3 + 1),
                read_i32(src, slot * 3 + 2),
            );
            let msg = &mut msgs[r as usize];
            msg.extend_from_slice(&(t as u32).to_le_bytes());
            msg.extend_from_slice(&(k as u32).to_le_bytes());
            msg.extend_from_slice(&out[slot * row..(slot + 1) * row]);
        }
    }
    msgs
}

pub(super) fn moe_combine(e: &mut Engine, ctx: &OpCtx, pending: &mut Pending, m: &mut MoeCombine<'_>) -> Result<()> {
    const OP: &str = "moe_combine";
    let (size, s) = (e.size, m.shape);
    let local = s.local_experts(size);
    if let Some(send) = &m.send {
        let d = send.expert_out.dtype();
        let records = match Arrived::check_free(OP, &pending.combine).and_then(|_| combine_records(&s, size, send)) {
            Ok(records) => records,
            Err(why) => return refuse(e, ctx, MOE_COMBINE, d, why),
        };
        let msgs = combine_messages(pending, &s, send, &records);
        let from = exchange(e, ctx, pending, (MOE_COMBINE, d, &s), msgs)?;
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
    // A bad id, a stray record or a missing row fails the call, but only the tokens it touches
    // stay unwritten: the device kernels combine every token in parallel, and both engines
    // leave the same bits.
    let mut failed = check_ids(OP, &ids, s.experts).err();
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
            // A dropped k (-1) has no owner: a row for it is as stray as one for another rank.
            let owner = ids.get(t * s.topk + k).filter(|&&x| x >= 0).map(|&x| x / local as i64);
            if t >= tokens || k >= s.topk || owner != Some(r as i64) {
                failed.get_or_insert_with(|| {
                    Error::invalid(
                        OP,
                        format!("rank {r} returned a row for token {t}, k = {k}, which it was not sent"),
                    )
                });
                continue;
            }
            at[t * s.topk + k] = Some((r, i * record + 8));
        }
    }
    let out = recv.out.host_bytes_mut();
    let mut acc = vec![0f32; s.hidden];
    for t in 0..tokens {
        acc.fill(0.0);
        let mut whole = true;
        for k in 0..s.topk {
            let x = ids[t * s.topk + k];
            if x == -1 {
                continue;
            }
            // A bad id has no row either (no owner accepts one), and `check_ids` named it.
            let Some((r, off)) = at[t * s.topk + k] else {
                failed.get_or_insert_with(|| {
                    Error::invalid(
                        OP,
                        format!(
                            "no row came back for token {t}, k = {k} (expert {x} on rank {}): its dispatch \
                             exceeded that expert's capacity, or the expert rank's counts were cut",
                            x / local as i64
                        ),
                    )
                });
                whole = false;
                continue;
            };
            rows::add_scaled_into(&mut acc, &arrived.from[r][off..off + row], d, weights[t * s.topk + k]);
        }
        if whole {
            rows::store(&mut out[t * row..(t + 1) * row], &acc, d);
        }
    }
    pending.give_back(arrived.from);
    failed.map_or(Ok(()), Err)
}
