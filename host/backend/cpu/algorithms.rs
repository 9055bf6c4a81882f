//! Collective algorithms over the progress engine. Small messages go direct (everyone to
//! everyone, reduced in rank order, so every rank computes bit-identical results); large ones
//! use a ring (reduce-scatter, all-gather) or a chunked chain (broadcast), which work for any
//! world size. Each step hands all its messages to the engine at once.

use super::engine::{Engine, Lands, OpCtx, Xfer, Xfers};
use super::header::Tag;
use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::Result;
use crate::contracts::reduce::{epilogue, prologue, reduce_into};
use std::ops::{Range, RangeInclusive};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Algo {
    Direct,
    Ring,
}

impl Algo {
    /// The algorithm as a call header carries it.
    pub(crate) fn code(self) -> u8 {
        match self {
            Algo::Direct => 0,
            Algo::Ring => 1,
        }
    }
}

/// The ranks a ring runs over, in ring order, and our place among them: the whole
/// communicator, or a group of it (two_level.rs).
#[derive(Clone, Copy)]
pub(crate) struct Ring<'g> {
    /// `None`: ranks `0..n`, in rank order.
    members: Option<&'g [usize]>,
    n: usize,
    pos: usize,
}

impl<'g> Ring<'g> {
    /// Every rank of `e`'s communicator, in rank order.
    pub(crate) fn world(e: &Engine) -> Ring<'static> {
        Ring {
            members: None,
            n: e.size,
            pos: e.rank,
        }
    }

    /// `members`, in that order, where we are `members[pos]`.
    pub(crate) fn of(members: &'g [usize], pos: usize) -> Ring<'g> {
        Ring {
            members: Some(members),
            n: members.len(),
            pos,
        }
    }

    fn rank(&self, place: usize) -> usize {
        self.members.map_or(place, |m| m[place])
    }

    fn right(&self) -> usize {
        self.rank((self.pos + 1) % self.n)
    }

    fn left(&self) -> usize {
        self.rank((self.pos + self.n - 1) % self.n)
    }
}

/// Independent aligned scratch areas, reused across operations.
#[derive(Default)]
pub(crate) struct Scratch {
    a: Vec<u64>,
    b: Vec<u64>,
    c: Vec<u64>,
}

fn area(v: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    let words = bytes.div_ceil(8);
    if v.len() < words {
        v.resize(words, 0);
    }
    // SAFETY: u64 storage viewed as bytes; the length stays inside the allocation.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), bytes) }
}

impl Scratch {
    pub(crate) fn two(&mut self, a: usize, b: usize) -> (&mut [u8], &mut [u8]) {
        (area(&mut self.a, a), area(&mut self.b, b))
    }

    pub(crate) fn three(&mut self, a: usize, b: usize, c: usize) -> (&mut [u8], &mut [u8], &mut [u8]) {
        (area(&mut self.a, a), area(&mut self.b, b), area(&mut self.c, c))
    }
}

/// Splits `buf` into consecutive parts of the given byte lengths.
pub(crate) fn parts_of(buf: &mut [u8], lens: impl IntoIterator<Item = usize>) -> Vec<&mut [u8]> {
    let mut rest = buf;
    lens.into_iter()
        .map(|n| {
            let (a, b) = std::mem::take(&mut rest).split_at_mut(n);
            rest = b;
            a
        })
        .collect()
}

/// `inputs` copied into consecutive parts of `work` (their total length), each scaled for
/// premul_sum: a reduce_scatter's contributions, which must not scale the caller's buffers.
pub(crate) fn scaled_parts<'w>(work: &'w mut [u8], inputs: &[&[u8]], dtype: DType, op: ReduceOp) -> Vec<&'w mut [u8]> {
    let mut parts = parts_of(work, inputs.iter().map(|i| i.len()));
    for (p, i) in parts.iter_mut().zip(inputs) {
        p.copy_from_slice(i);
        prologue(dtype, op, p);
    }
    parts
}

/// Where a reducing ring works: `buf` itself, or for premul_sum a scaled copy in `scaled`,
/// which the caller copies back at the end. Either way nothing lands in `buf` before the first
/// exchange has checked every peer's call (a mismatched call leaves it untouched).
pub(crate) fn premul_work<'w>(buf: &'w mut [u8], scaled: &'w mut [u8], dtype: DType, op: ReduceOp) -> &'w mut [u8] {
    if !matches!(op, ReduceOp::PremulSum(_)) {
        return buf;
    }
    scaled.copy_from_slice(buf);
    prologue(dtype, op, scaled);
    scaled
}

/// Byte lengths of `n` balanced blocks of `count` elements.
pub(crate) fn block_lens(count: usize, n: usize, esize: usize) -> Vec<usize> {
    (0..n)
        .map(|i| (count / n + usize::from(i < count % n)) * esize)
        .collect()
}

/// `(&parts[a], &mut parts[b])` for `a != b`.
fn pair<'p>(parts: &'p mut [&mut [u8]], a: usize, b: usize) -> (&'p [u8], &'p mut [u8]) {
    if a < b {
        let (lo, hi) = parts.split_at_mut(b);
        (&*lo[a], &mut *hi[0])
    } else {
        let (lo, hi) = parts.split_at_mut(a);
        (&*hi[0], &mut *lo[b])
    }
}

/// A reducing ring step moves its block in pieces of this many bytes, and each piece is
/// reduced as soon as it is here, while it is still in cache (measured: docs/results/cpu.md).
pub(crate) const RING_PIECE: usize = 256 << 10;

/// The block from which the steps of a reducing ring, and the all-gather phase of a ring
/// all_reduce, may send by reference (net/links/pull.rs, where the link does). Below it the
/// blocks streamed through the rings stay in cache on both sides, and a sender that need not
/// wait for its receiver's copy wins; from it on the rings' two copies go through memory, and
/// one copy wins although the sender waits (docs/results/cpu.md, part 19: all_reduce of 4 and 16
/// MiB took 0.72 and 0.76 of the time at 2 processes, 0.75 and 0.86 at 4, medians of rounds).
const RING_BY_REFERENCE: usize = 1 << 20;

/// Whether a ring step's block of `len` bytes stays in the stream (`RING_BY_REFERENCE`).
fn ring_in_stream(len: usize) -> bool {
    len < RING_BY_REFERENCE
}

/// A ring step's send of `data` to `peer`: through the stream where `in_stream`, else by
/// reference where the link sends so.
fn ring_send<'b>(e: &mut Engine, peer: usize, tag: Tag, data: &'b [u8], in_stream: bool) -> Xfer<'b> {
    if in_stream {
        e.send_in_stream(peer, tag, data)
    } else {
        e.send(peer, tag, data)
    }
}

/// Piece `i` of a block of `len` bytes.
fn piece(len: usize, i: usize) -> Range<usize> {
    (i * RING_PIECE).min(len)..((i + 1) * RING_PIECE).min(len)
}

/// One step of a reducing ring: sends `out` to `right` and takes a block of `in_len` bytes from
/// `left`, both in pieces (at least one message each way, so an empty block still carries the
/// call); `reduce(range, bytes)` folds each incoming piece in. `tmp` holds a piece.
#[allow(clippy::too_many_arguments)]
fn reducing_step(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    (right, left): (usize, usize),
    out: &[u8],
    in_len: usize,
    tmp: &mut [u8],
    mut reduce: impl FnMut(Range<usize>, &[u8]),
) -> Result<()> {
    let count = |len: usize| len.div_ceil(RING_PIECE).max(1);
    let (sends, recvs) = (count(out.len()), count(in_len));
    for i in 0..sends.max(recvs) {
        let r = piece(in_len, i);
        {
            let mut x = Xfers::with_capacity(2);
            // Blocks below `RING_BY_REFERENCE` through the rings, not by reference: each rank
            // reduces between pieces, and a sender that waited for its neighbour to copy would
            // wait out that reduction too (measured: by reference, all_reduce of 256 KiB took
            // 1.2-1.4x as long, docs/results/cpu.md).
            if i < sends {
                x.push(ring_send(
                    e,
                    right,
                    tag,
                    &out[piece(out.len(), i)],
                    ring_in_stream(out.len()),
                ));
            }
            if i < recvs {
                x.push(e.recv(left, tag, &mut tmp[..r.len()]));
            }
            e.exchange(ctx, &mut x)?;
        }
        if i < recvs {
            reduce(r.clone(), &tmp[..r.len()]);
        }
    }
    Ok(())
}

/// Ring reduce-scatter over `parts` (one per member of `ring`, by place): afterwards
/// `parts[pos]` holds the reduction of every member's `parts[pos]`. Step s sends block
/// (pos-s-1) to the right and reduces block (pos-s-2) from the left into ours.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ring_reduce_scatter(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    ring: Ring<'_>,
    parts: &mut [&mut [u8]],
    dtype: DType,
    op: ReduceOp,
    tmp: &mut [u8],
) -> Result<()> {
    let (n, me) = (ring.n, ring.pos);
    let sides = (ring.right(), ring.left());
    for s in 0..n - 1 {
        let (send_b, recv_b) = ((me + 2 * n - s - 1) % n, (me + 2 * n - s - 2) % n);
        let (out, target) = pair(parts, send_b, recv_b);
        let in_len = target.len();
        reducing_step(e, ctx, tag, sides, out, in_len, tmp, |r, inc| {
            reduce_into(dtype, op, &mut target[r], inc)
        })?;
    }
    Ok(())
}

/// As `ring_reduce_scatter`, for contributions `inputs` (one block per rank) that stay as they
/// are, into `output`: a block is copied only where it is reduced. The first step sends our
/// contribution straight from `inputs` (scaled in `accs.0` for premul_sum); each step reduces
/// our contribution and the incoming block into one of `accs`, which the next step sends while
/// it reduces into the other, and the last step into `output`. Same order of operations as
/// `ring_reduce_scatter`, so the same bits; measured against copying every contribution
/// first, docs/results/cpu.md.
#[allow(clippy::too_many_arguments)]
fn ring_reduce_scatter_from(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    inputs: &[&[u8]],
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    accs: (&mut [u8], &mut [u8]),
    tmp: &mut [u8],
) -> Result<()> {
    let (n, me) = (e.size, e.rank);
    let sides = ((me + 1) % n, (me + n - 1) % n);
    let premul = matches!(op, ReduceOp::PremulSum(_));
    let (acc_a, acc_b) = accs;
    for s in 0..n - 1 {
        let (send_b, recv_b) = ((me + 2 * n - s - 1) % n, (me + 2 * n - s - 2) % n);
        let (cur, next) = if s % 2 == 0 {
            (&mut *acc_a, &mut *acc_b)
        } else {
            (&mut *acc_b, &mut *acc_a)
        };
        let out_len = inputs[send_b].len();
        if s == 0 && premul {
            cur[..out_len].copy_from_slice(inputs[send_b]);
            prologue(dtype, op, &mut cur[..out_len]);
        }
        let out: &[u8] = if s == 0 && !premul {
            inputs[send_b]
        } else {
            &cur[..out_len]
        };
        let own = inputs[recv_b];
        // The last step's block is ours (recv_b == me): it lands in `output`, after the first
        // exchange has checked every peer's call.
        let target: &mut [u8] = if s == n - 2 {
            &mut *output
        } else {
            &mut next[..own.len()]
        };
        reducing_step(e, ctx, tag, sides, out, own.len(), tmp, |r, inc| {
            let t = &mut target[r.clone()];
            t.copy_from_slice(&own[r]);
            prologue(dtype, op, t);
            reduce_into(dtype, op, t, inc);
        })?;
    }
    Ok(())
}

/// Ring all-gather: every member of `ring` starts with its own `parts[pos]` (or, given `own`,
/// with that, copied into `parts[pos]` only once the first step has checked every peer's
/// call) and ends with all of them.
pub(crate) fn ring_all_gather(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    ring: Ring<'_>,
    parts: &mut [&mut [u8]],
    own: Option<&[u8]>,
    in_stream: bool,
) -> Result<()> {
    let (n, me) = (ring.n, ring.pos);
    let (right, left) = (ring.right(), ring.left());
    for s in 0..n - 1 {
        let (send_b, recv_b) = ((me + n - s) % n, (me + 2 * n - s - 1) % n);
        let (out, inc) = pair(parts, send_b, recv_b);
        let out = match own {
            Some(own) if s == 0 => own,
            _ => out,
        };
        let send = ring_send(e, right, tag, out, in_stream);
        let mut x = [send, e.recv(left, tag, inc)];
        e.exchange(ctx, &mut x)?;
        if let (Some(own), 0) = (own, s) {
            parts[me].copy_from_slice(own);
        }
    }
    Ok(())
}

/// Ring all_reduce of `work` (scaled already for premul_sum; no epilogue) among the members of
/// `ring`: a reduce-scatter of its blocks, then an all-gather. `tmp` holds a ring piece of the
/// largest block.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ring_all_reduce(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    ring: Ring<'_>,
    work: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    tmp: &mut [u8],
) -> Result<()> {
    let mut parts = parts_of(work, block_lens(work.len() / dtype.size(), ring.n, dtype.size()));
    ring_reduce_scatter(e, ctx, tag, ring, &mut parts, dtype, op, tmp)?;
    let in_stream = gather_in_stream(&parts);
    ring_all_gather(e, ctx, tag, ring, &mut parts, None, in_stream)
}

/// Whether the all-gather phase of a ring all_reduce over `parts` keeps its blocks in the
/// stream: where they are below `RING_BY_REFERENCE` (by reference, this phase made all_reduce
/// of 256 KiB-1 MiB slower, 1.1-1.3x).
pub(crate) fn gather_in_stream(parts: &[&mut [u8]]) -> bool {
    ring_in_stream(parts.iter().map(|p| p.len()).max().unwrap_or(0))
}

/// Everyone sends `mine` to everyone; `slots[r]` receives rank r's (our own slot is filled by
/// the caller).
fn direct_all_to_all_same(e: &mut Engine, ctx: &OpCtx, tag: Tag, mine: &[u8], slots: &mut [&mut [u8]]) -> Result<()> {
    let me = e.rank;
    let mut x = Xfers::with_capacity(2 * e.size);
    for (p, slot) in slots.iter_mut().enumerate().filter(|(p, _)| *p != me) {
        x.push(e.send(p, tag, mine));
        x.push(e.recv(p, tag, slot));
    }
    e.exchange(ctx, &mut x)
}

/// `acc = slots[0] op slots[1] op ...` in rank order.
fn fold_in_rank_order(dtype: DType, op: ReduceOp, acc: &mut [u8], slots: &[&mut [u8]]) {
    acc.copy_from_slice(slots[0]);
    for s in &slots[1..] {
        reduce_into(dtype, op, acc, s);
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn all_reduce(
    e: &mut Engine,
    s: &mut Scratch,
    ctx: &OpCtx,
    tag: Tag,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    algo: Algo,
) -> Result<()> {
    let n = e.size;
    // A premul_sum contribution is scaled in scratch: nothing lands in `buf` before every
    // peer's call has been checked (a mismatched call leaves it untouched).
    let premul = matches!(op, ReduceOp::PremulSum(_));
    if n == 1 {
        prologue(dtype, op, buf);
    } else {
        match algo {
            Algo::Direct => {
                let (all, scaled) = s.two(buf.len() * n, if premul { buf.len() } else { 0 });
                let mut slots = parts_of(all, std::iter::repeat(buf.len()).take(n));
                slots[e.rank].copy_from_slice(buf);
                prologue(dtype, op, slots[e.rank]);
                let mine: &[u8] = if premul {
                    scaled.copy_from_slice(slots[e.rank]);
                    scaled
                } else {
                    buf
                };
                direct_all_to_all_same(e, ctx, tag, mine, &mut slots)?;
                fold_in_rank_order(dtype, op, buf, &slots);
            }
            Algo::Ring => {
                let largest = block_lens(buf.len() / dtype.size(), n, dtype.size())[0];
                let (tmp, scaled) = s.two(largest.min(RING_PIECE), if premul { buf.len() } else { 0 });
                let work = premul_work(buf, scaled, dtype, op);
                ring_all_reduce(e, ctx, tag, Ring::world(e), work, dtype, op, tmp)?;
                if premul {
                    buf.copy_from_slice(scaled);
                }
            }
        }
    }
    epilogue(dtype, op, n, buf);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce(
    e: &mut Engine,
    s: &mut Scratch,
    ctx: &OpCtx,
    tag: Tag,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
    algo: Algo,
) -> Result<()> {
    let (n, me, len) = (e.size, e.rank, buf.len());
    // Non-root buffers stay unchanged: the contribution is scaled in a copy.
    let (work, tmp) = s.two(len * if algo == Algo::Direct && me == root { n } else { 1 }, len);
    match algo {
        Algo::Direct if me == root => {
            let mut slots = parts_of(work, std::iter::repeat(len).take(n));
            slots[me].copy_from_slice(buf);
            prologue(dtype, op, slots[me]);
            let mut x = Xfers::with_capacity(n);
            for (p, slot) in slots.iter_mut().enumerate().filter(|(p, _)| *p != me) {
                x.push(e.recv(p, tag, slot));
            }
            e.exchange(ctx, &mut x)?;
            drop(x);
            fold_in_rank_order(dtype, op, buf, &slots);
        }
        Algo::Direct => {
            work.copy_from_slice(buf);
            prologue(dtype, op, work);
            {
                let x = e.send(root, tag, work);
                e.exchange(ctx, &mut [x])
            }?;
            return Ok(());
        }
        Algo::Ring => {
            work.copy_from_slice(buf);
            prologue(dtype, op, work);
            let lens = block_lens(len / dtype.size(), n, dtype.size());
            let mut parts = parts_of(work, lens.iter().copied());
            if n > 1 {
                ring_reduce_scatter(e, ctx, tag, Ring::world(e), &mut parts, dtype, op, tmp)?;
            }
            if me == root {
                let mut dst = parts_of(buf, lens);
                dst[me].copy_from_slice(parts[me]);
                let mut x = Xfers::with_capacity(n);
                for (p, d) in dst.iter_mut().enumerate().filter(|(p, _)| *p != me) {
                    x.push(e.recv(p, tag, d));
                }
                e.exchange(ctx, &mut x)?;
            } else {
                let x = e.send(root, tag, parts[me]);
                e.exchange(ctx, &mut [x])?;
                return Ok(());
            }
        }
    }
    epilogue(dtype, op, n, buf);
    Ok(())
}

/// The sizes at which a direct broadcast between 2 ranks sends its buffer by reference where
/// the link does (net/links/pull.rs): the receiver copies once, out of the root's buffer, where
/// through the ring the root copies in and the receiver out. Measured (2 processes bound to the
/// 2 cores of the Intel Xeon guest, 3 rounds; docs/results/cpu.md, part 25): by reference took
/// 0.73-0.99 of the chain's time at 192-512 KiB (medians 0.75-0.92); it was level at 128 KiB
/// (0.90-1.12), mixed at 768 KiB (0.74-1.11), and slower at 1 MiB (1.09-1.33), where the
/// chain's two copies run on both cores at once. Below, a root that need not wait for its
/// receiver's copy wins (by reference, 16 KiB took 2.2 us against 1.2).
pub(crate) const BROADCAST_BY_REFERENCE: RangeInclusive<usize> = (128 << 10) + 1..=512 << 10;

/// Whose bytes land at `me` in a broadcast of `algo`: the root's in the direct broadcast, the
/// previous rank's in the chain, none at the root (`Engine::begin_broadcast_call`).
pub(crate) fn broadcast_lands(me: usize, n: usize, root: usize, algo: Algo) -> Lands {
    match () {
        _ if me == root => Lands::Nothing,
        _ if algo == Algo::Direct => Lands::From(root),
        _ => Lands::From((me + n - 1) % n),
    }
}

/// The peer whose bytes come from `me` in a broadcast of `algo` and that checks our call before
/// they land (`broadcast_lands`): the chain's next rank but the root; in the direct broadcast
/// the root's data carries its call, and a receiver feeds nobody.
pub(crate) fn broadcast_feeds(me: usize, n: usize, root: usize, algo: Algo) -> Option<usize> {
    let next = (me + 1) % n;
    (algo != Algo::Direct && next != root && n > 1).then_some(next)
}

pub(crate) fn broadcast(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    buf: &mut [u8],
    root: usize,
    algo: Algo,
    chunk: usize,
) -> Result<()> {
    let (n, me) = (e.size, e.rank);
    if n == 1 {
        return Ok(());
    }
    if algo == Algo::Direct {
        if me == root {
            // In the stream, the root runs ahead of its receivers instead of waiting for each
            // to copy, but for the sizes where one copy wins (`BROADCAST_BY_REFERENCE`).
            let by_reference = n == 2 && BROADCAST_BY_REFERENCE.contains(&buf.len());
            let mut x: Xfers = (0..n)
                .filter(|&p| p != me)
                .map(|p| {
                    if by_reference {
                        e.send(p, tag, buf)
                    } else {
                        e.send_in_stream(p, tag, buf)
                    }
                })
                .collect();
            return e.exchange(ctx, &mut x);
        }
        return {
            let x = e.recv(root, tag, buf);
            e.exchange(ctx, &mut [x])
        };
    }
    // A chain root -> root+1 -> ...: step i receives chunk i while forwarding chunk i-1.
    // Chunks go through the rings, never by reference: a sender streams ahead of its
    // receiver instead of waiting for it to copy (measured: by reference, 4 MiB at 2 processes
    // took 470-520 us against 325, docs/results/cpu.md).
    let pos = (me + n - root) % n;
    let (prev, next) = ((me + n - 1) % n, (me + 1) % n);
    let last = pos == n - 1;
    let chunks: Vec<Range<usize>> = {
        let count = buf.len().div_ceil(chunk).max(1);
        (0..count)
            .map(|i| (i * chunk).min(buf.len())..((i + 1) * chunk).min(buf.len()))
            .collect()
    };
    for i in 0..=chunks.len() {
        let (head, tail) = buf.split_at_mut(chunks.get(i).map_or(buf.len(), |c| c.start));
        let mut x = Xfers::with_capacity(2);
        if pos == 0 {
            if let Some(c) = chunks.get(i) {
                x.push(e.send_in_stream(next, tag, &tail[..c.len()]));
            }
        } else {
            if let Some(c) = chunks.get(i) {
                x.push(e.recv(prev, tag, &mut tail[..c.len()]));
            }
            if i > 0 && !last {
                x.push(e.send_in_stream(next, tag, &head[chunks[i - 1].clone()]));
            }
        }
        e.exchange(ctx, &mut x)?;
    }
    Ok(())
}

pub(crate) fn all_gather(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    input: &[u8],
    outputs: &mut [&mut [u8]],
    algo: Algo,
) -> Result<()> {
    // Our own block lands only after every peer's call has been checked.
    match algo {
        _ if e.size == 1 => {}
        Algo::Direct => direct_all_to_all_same(e, ctx, tag, input, outputs)?,
        Algo::Ring => return ring_all_gather(e, ctx, tag, Ring::world(e), outputs, Some(input), false),
    }
    outputs[e.rank].copy_from_slice(input);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_scatter(
    e: &mut Engine,
    s: &mut Scratch,
    ctx: &OpCtx,
    tag: Tag,
    inputs: &[&[u8]],
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    algo: Algo,
) -> Result<()> {
    let (n, me) = (e.size, e.rank);
    let total: usize = inputs.iter().map(|i| i.len()).sum();
    let largest = inputs.iter().map(|i| i.len()).max().unwrap_or(0);
    let premul = matches!(op, ReduceOp::PremulSum(_));
    match algo {
        Algo::Direct => {
            // Our contributions, scaled for premul_sum in one work area; as they are otherwise.
            let (work, tmp) = s.two(if premul { total } else { 0 }, output.len() * n);
            let scaled;
            let parts: Vec<&[u8]> = if premul {
                scaled = scaled_parts(work, inputs, dtype, op);
                scaled.iter().map(|p| &**p).collect()
            } else {
                inputs.to_vec()
            };
            let mut slots = parts_of(tmp, std::iter::repeat(output.len()).take(n));
            slots[me].copy_from_slice(parts[me]);
            let mut x = Xfers::with_capacity(2 * n);
            for (p, slot) in slots.iter_mut().enumerate().filter(|(p, _)| *p != me) {
                x.push(e.send(p, tag, parts[p]));
                x.push(e.recv(p, tag, slot));
            }
            e.exchange(ctx, &mut x)?;
            drop(x);
            fold_in_rank_order(dtype, op, output, &slots);
        }
        Algo::Ring if n == 1 => {
            output.copy_from_slice(inputs[0]);
            prologue(dtype, op, output);
        }
        Algo::Ring => {
            // Accumulators where a block is reduced before it is sent on: none at 2 ranks
            // but premul_sum's first, scaled block.
            let (acc_a, acc_b, tmp) = s.three(
                if n > 2 || premul { largest } else { 0 },
                if n > 2 { largest } else { 0 },
                largest.min(RING_PIECE),
            );
            ring_reduce_scatter_from(e, ctx, tag, inputs, output, dtype, op, (acc_a, acc_b), tmp)?;
        }
    }
    epilogue(dtype, op, n, output);
    Ok(())
}

pub(crate) fn all_to_all(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    inputs: &[&[u8]],
    outputs: &mut [&mut [u8]],
) -> Result<()> {
    let me = e.rank;
    let mut x = Xfers::with_capacity(2 * e.size);
    for (p, out) in outputs.iter_mut().enumerate().filter(|(p, _)| *p != me) {
        x.push(e.send(p, tag, inputs[p]));
        x.push(e.recv(p, tag, out));
    }
    e.exchange(ctx, &mut x)?;
    drop(x);
    // Our own block lands only after every peer's call has been checked.
    outputs[me].copy_from_slice(inputs[me]);
    Ok(())
}

pub(crate) fn scatter(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    inputs: Option<&[&[u8]]>,
    output: &mut [u8],
    root: usize,
) -> Result<()> {
    let me = e.rank;
    match inputs {
        Some(inputs) if me == root => {
            let mut x: Xfers = (0..e.size)
                .filter(|&p| p != me)
                .map(|p| e.send(p, tag, inputs[p]))
                .collect();
            e.exchange(ctx, &mut x)?;
            // Our own block lands only after every peer's call has been checked.
            output.copy_from_slice(inputs[me]);
            Ok(())
        }
        _ => {
            let x = e.recv(root, tag, output);
            e.exchange(ctx, &mut [x])
        }
    }
}

pub(crate) fn gather(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    input: &[u8],
    outputs: Option<&mut [&mut [u8]]>,
    root: usize,
) -> Result<()> {
    let me = e.rank;
    match outputs {
        Some(outputs) if me == root => {
            let mut x = Xfers::with_capacity(e.size);
            for (p, out) in outputs.iter_mut().enumerate().filter(|(p, _)| *p != me) {
                x.push(e.recv(p, tag, out));
            }
            e.exchange(ctx, &mut x)?;
            drop(x);
            // Our own block lands only after every peer's call has been checked.
            outputs[me].copy_from_slice(input);
            Ok(())
        }
        _ => {
            let x = e.send(root, tag, input);
            e.exchange(ctx, &mut [x])
        }
    }
}

pub(crate) fn barrier(e: &mut Engine, ctx: &OpCtx, tag: Tag) -> Result<()> {
    let me = e.rank;
    let mut none: Vec<[u8; 0]> = vec![[]; e.size];
    let mut x = Xfers::with_capacity(2 * e.size);
    for (p, slot) in none.iter_mut().enumerate().filter(|(p, _)| *p != me) {
        x.push(e.send(p, tag, &[]));
        x.push(e.recv(p, tag, slot));
    }
    e.exchange(ctx, &mut x)
}
