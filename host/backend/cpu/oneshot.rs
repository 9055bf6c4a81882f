//! One-shot collectives over the board (net/links/shm_board.rs), used when every rank shares this
//! host: each rank publishes its contribution once and reads every peer's in place, instead of
//! sending framed copies through the rings (a broadcast larger than a slot, a slot per round). all_reduce folds in rank order, as the direct
//! algorithm does, so every rank computes bit-identical results. Every round reads every
//! peer's contribution, which the board's slot reuse relies on.

use super::algorithms::{scaled_parts, Scratch};
use super::engine::{Engine, OpCtx, Pacer};
use super::header::Tag;
use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::{Error, Result};
use crate::contracts::reduce::{epilogue, prologue, reduce_into};
use crate::net::links::shm_board::{Board, SLOT_BYTES};
use std::ops::RangeInclusive;

/// Set in a round's label by a rank whose all_to_all blocks do not fit its slot.
const DECLINED: u64 = 1 << 32;
/// Set in a round's label by a rank that refuses its call (see `refuse`): its data says why.
const REFUSED: u64 = 1 << 33;
/// Where a label carries a call argument that the tag does not (the fused norm's row length).
const ARG_SHIFT: u32 = 34;
/// Arguments that fit a label.
pub(crate) const ARG_MAX: u64 = (1 << (64 - ARG_SHIFT)) - 1;

/// Can a contribution of `bytes` per rank go through the board?
pub(crate) fn fits(e: &Engine, bytes: usize) -> bool {
    e.transport.board.is_some() && bytes <= SLOT_BYTES
}

/// The collectives whose largest round differs where every rank has a CPU of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RoundOp {
    AllReduce,
    Broadcast,
    /// all_gather, reduce_scatter, all_to_all.
    Exchange,
}

/// The largest contribution that runs as a round without a hint (`Broadcast`: its root's
/// buffer; else the operation's bytes, as `Tuning::use_board` counts them); `direct_max`
/// (`FERROCOMM_CPU_DIRECT_MAX`) bounds all but one. Where ranks outnumber CPUs (crowding.rs)
/// the round wins at every size it takes, and a broadcast takes every size in pieces
/// (`broadcast`): at 4 processes on 2 cores the pieces took 0.46-0.78 of the chain's time from
/// 128 KiB to 4 MiB (medians 0.53-0.63), 0.69-0.75 at 8-16 MiB and 0.97-1.05 at 32-64 MiB,
/// where both wait on memory (docs/results/cpu.md, part 25). Where every rank has a CPU of its
/// own (2 processes bound to the 2 cores of the AMD EPYC guest, messages through the rings;
/// docs/results/cpu.md, "Larger rounds where every rank has a CPU"): all_reduce's ring beats
/// the round from 16 KiB (1.21-1.34 us against 1.34-1.38); the streamed broadcast, whose root
/// runs ahead, is level with the round from 16 KiB and loses at 4-8 KiB (0.36-0.41 us against
/// 0.23-0.28), and the chain beats the round's pieces at 128 KiB-16 MiB (part 25); all_gather,
/// reduce_scatter and all_to_all keep winning in a round up to 32 KiB (all_gather at 16 KiB:
/// 0.51-0.53 against 0.65-0.68).
pub(crate) fn round_max(e: &Engine, op: RoundOp, direct_max: usize) -> usize {
    match (e.transport.crowded(), op) {
        (true, RoundOp::Broadcast) => usize::MAX,
        (true, _) => direct_max,
        (false, RoundOp::AllReduce | RoundOp::Broadcast) => direct_max.min(8 << 10),
        (false, RoundOp::Exchange) => direct_max.min(32 << 10),
    }
}

/// The sizes of the operations of `op` that run as a shared-memory round without a hint
/// (`round_max` is the largest). Where ranks outnumber CPUs a broadcast up to
/// `CROWDED_BROADCAST_STREAMED` streams instead: its receivers wait only for the root's call
/// (engine.rs, `begin_broadcast_call`), the round for every rank's.
pub(crate) fn round_sizes(e: &Engine, op: RoundOp, direct_max: usize) -> RangeInclusive<usize> {
    if e.transport.crowded() && op == RoundOp::Broadcast {
        return CROWDED_BROADCAST_STREAMED + 1..=usize::MAX;
    }
    0..=round_max(e, op, direct_max)
}

/// The largest broadcast that streams rather than runs as a round where ranks outnumber CPUs.
/// Measured (4 processes on the 2 cores of the AMD EPYC guest, 4 interleaved runs of each,
/// docs/results/cpu.md, part 30): streamed, 8 B-512 B took 0.60-0.92 of the round's time
/// (2.2-3.0 us against 3.1-5.2); at 4-64 KiB the two changed places from run to run.
pub(crate) const CROWDED_BROADCAST_STREAMED: usize = 2 << 10;

fn board(e: &Engine) -> &Board {
    e.transport.board.as_ref().expect("callers check `fits` first")
}

/// Waits until `ready` holds of `peer`'s part of the board, with the operation's deadline, abort
/// flag and the peer's liveness checked as the engine checks them.
fn wait_for(e: &Engine, ctx: &OpCtx, peer: usize, ready: impl Fn(&Board) -> bool) -> Result<()> {
    let b = board(e);
    let mut pace = Pacer::new(&e.transport);
    while !ready(b) {
        let Some(now) = pace.stalled(ctx) else { continue };
        ctx.check(now, || Some(peer))?;
        // The peer updates the board before it leaves or moves on, so look once more first.
        if let Err(g) = e.transport.check_peer(peer) {
            if ready(b) {
                break;
            }
            return Err(Error::PeerLost {
                op: ctx.op,
                peer: g.rank,
                reason: g.reason,
            });
        }
        if e.transport.has_unread(peer) && !ready(b) {
            return Err(Error::Mismatch {
                op: ctx.op,
                peer,
                detail: "it sent a message of another operation while this rank waits for its \
                         shared-memory contribution"
                    .into(),
            });
        }
    }
    Ok(())
}

/// Waits for `peer`'s contribution to `round` and checks that it is the same call as ours
/// (and, given `len`, of that many bytes); returns its label.
fn await_peer(e: &Engine, ctx: &OpCtx, peer: usize, round: u64, tag: Tag, len: Option<usize>) -> Result<u64> {
    let (label, nbytes) = await_round(e, ctx, peer, round)?;
    let got = Tag::from_label(label, nbytes);
    let want = Tag {
        nbytes: len.map_or(nbytes, |l| l as u64),
        ..tag
    };
    if got != want {
        return Err(Error::Mismatch {
            op: ctx.op,
            peer,
            detail: format!("it called {}, this rank {}", got.describe(), want.describe()),
        });
    }
    Ok(label)
}

pub(crate) fn all_reduce(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (n, me, len) = (e.size, e.rank, buf.len());
    // A premul_sum contribution is scaled in a copy: nothing lands in `buf` before every peer's
    // call has been checked.
    let premul = matches!(op, ReduceOp::PremulSum(_));
    let round = if premul {
        let mut words = vec![0u64; len.div_ceil(8)];
        // SAFETY: u64 storage viewed as bytes, within the allocation (aligned for every dtype).
        let scaled = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) };
        scaled.copy_from_slice(buf);
        prologue(dtype, op, scaled);
        e.publish_round(tag.label(), &[scaled])
    } else {
        e.publish_round(tag.label(), &[buf])
    };
    // Every peer's call is checked before anything lands in `buf`.
    for r in (0..n).filter(|&r| r != me) {
        await_peer(e, ctx, r, round, tag, Some(len))?;
    }
    // buf = c0 op c1 op ... in rank order; our own contribution is read back from the board.
    for r in 0..n {
        let src = board(e).data(r, round, len);
        match r {
            0 if me == 0 && !premul => {}
            0 => buf.copy_from_slice(src),
            _ => reduce_into(dtype, op, buf, src),
        }
    }
    epilogue(dtype, op, n, buf);
    Ok(())
}

pub(crate) fn all_gather(e: &mut Engine, ctx: &OpCtx, tag: Tag, input: &[u8], outputs: &mut [&mut [u8]]) -> Result<()> {
    let me = e.rank;
    let round = e.publish_round(tag.label(), &[input]);
    // Every peer's call is checked before anything lands in `outputs`. Ranks may contribute
    // different lengths (all_gather_v): outputs say how much each sends.
    for (r, out) in outputs.iter().enumerate().filter(|(r, _)| *r != me) {
        await_peer(e, ctx, r, round, tag, Some(out.len()))?;
    }
    for (r, out) in outputs.iter_mut().enumerate() {
        if r == me {
            out.copy_from_slice(input);
        } else {
            out.copy_from_slice(board(e).data(r, round, out.len()));
        }
    }
    Ok(())
}

/// A broadcast as one round: the root publishes `buf`, every other rank only its buffer's
/// length (as the round's byte count, in the control line its peers wait on: reading it from a
/// data line took the root a second line from each receiver's core: 0.83-0.90 of the time
/// without it at 2 processes, in the guest's slow phase; docs/results/cpu.md, part 16), and the
/// others copy the root's contribution once every peer's call has been checked. The root rides
/// in the label, so ranks that name different roots disagree there; each rank checks every
/// peer's length against its own, so a receiver with another count is a mismatch on every rank.
/// Unlike the streamed broadcast, whose root runs ahead, the root waits for every peer's round;
/// small messages still gain, as no rank sends a message per peer (measured: docs/results/cpu.md).
///
/// A buffer larger than a slot goes in pieces of a slot, a round each. The first round's byte
/// count is the whole length on every rank, the root's included, so every call is checked before
/// any piece lands; the later rounds carry the pieces' lengths. With two slots the root copies
/// piece k + 1 in while the receivers copy piece k out.
pub(crate) fn broadcast(e: &mut Engine, ctx: &OpCtx, tag: Tag, buf: &mut [u8], root: usize) -> Result<()> {
    let (n, me, len) = (e.size, e.rank, buf.len());
    let label = tag.label() | (root as u64) << ARG_SHIFT;
    let mut at = 0;
    loop {
        let piece = at..(at + SLOT_BYTES).min(len);
        // Every rank's byte count is its buffer's length (first round) or the piece's, the
        // root's and the receivers' alike.
        let count = if at == 0 { len } else { piece.len() };
        let round = if me != root {
            e.publish_round_count(label, count as u64)
        } else if piece.len() < count {
            e.publish_round_first_piece(label, &buf[piece.clone()], count as u64)
        } else {
            e.publish_round(label, &[&buf[piece.clone()]])
        };
        for p in (0..n).filter(|&p| p != me) {
            let (got, nbytes) = await_round(e, ctx, p, round)?;
            if got == label && nbytes == count as u64 {
                continue;
            }
            // Named by field where only one differs, as the call headers do (header.rs).
            let same_call = got & ((1 << ARG_SHIFT) - 1) == tag.label();
            return Err(Error::Mismatch {
                op: ctx.op,
                peer: p,
                detail: if got == label {
                    format!("bytes: this rank has {count}, rank {p} has {nbytes}")
                } else if same_call {
                    format!("root: this rank has {root}, rank {p} has {}", got >> ARG_SHIFT)
                } else {
                    format!(
                        "it called {}, this rank {} with root {root}",
                        Tag::from_label(got, nbytes).describe(),
                        Tag::from_label(label, len as u64).describe()
                    )
                },
            });
        }
        if me != root {
            let got = board(e).data(root, round, piece.len());
            buf[piece.clone()].copy_from_slice(got);
        }
        at = piece.end;
        if at == len {
            return Ok(());
        }
    }
}

pub(crate) fn barrier(e: &mut Engine, ctx: &OpCtx, tag: Tag) -> Result<()> {
    let round = e.publish_round(tag.label(), &[&[]]);
    for p in (0..e.size).filter(|&p| p != e.rank) {
        await_peer(e, ctx, p, round, tag, Some(0))?;
    }
    Ok(())
}

/// Every rank publishes all its blocks; each folds block `rank` of every rank, in rank order
/// (bit-identical to the direct algorithm), into `output`.
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
) -> Result<()> {
    let (n, me) = (e.size, e.rank);
    let total: usize = inputs.iter().map(|i| i.len()).sum();
    // premul_sum scales a copy, as the direct algorithm does.
    let premul = matches!(op, ReduceOp::PremulSum(_));
    let scaled: Vec<&[u8]> = if premul {
        let (work, _) = s.two(total, 0);
        scaled_parts(work, inputs, dtype, op).into_iter().map(|p| &*p).collect()
    } else {
        Vec::new()
    };
    let contributed: &[&[u8]] = if premul { &scaled } else { inputs };
    let round = e.publish_round(tag.label(), contributed);
    for r in (0..n).filter(|&r| r != me) {
        await_peer(e, ctx, r, round, tag, Some(total))?;
    }
    // Our own block's length was checked against `output` with the call's arguments.
    check_blocks_for_us(e, ctx, round, (0..n).filter(|&r| r != me).map(|r| (r, output.len())))?;
    for r in 0..n {
        // Our own block comes from our memory, not back from our slot: where it shares a cache
        // line with the block the peer reads there (8-64 B at 2 processes), reading it back
        // after the peer did took a transfer from the peer's core (measured: 0.83-0.95 of the
        // time without it at 8-256 B; docs/results/cpu.md, part 16).
        let block = if r == me {
            contributed[me]
        } else {
            board(e).part(r, round, me).expect("checked above")
        };
        if r == 0 {
            output.copy_from_slice(block);
        } else {
            reduce_into(dtype, op, output, block);
        }
    }
    epilogue(dtype, op, n, output);
    Ok(())
}

/// Checks, before anything lands in an output, that each rank's block for us in `round` has
/// the length we expect of it: `want` gives (rank, bytes).
fn check_blocks_for_us(e: &Engine, ctx: &OpCtx, round: u64, want: impl Iterator<Item = (usize, usize)>) -> Result<()> {
    for (r, len) in want {
        match board(e).part(r, round, e.rank) {
            Some(block) if block.len() == len => {}
            got => {
                return Err(Error::Mismatch {
                    op: ctx.op,
                    peer: r,
                    detail: format!(
                        "it sent {} bytes to this rank, which expected {len}",
                        got.map_or(0, <[u8]>::len)
                    ),
                })
            }
        }
    }
    Ok(())
}

/// all_to_all in one round when every rank's blocks fit its slot and `limit` (`round_max`, or
/// none where the hint asks for rounds). Whether they do is known only to each rank itself, so
/// a rank whose blocks do not fit publishes a declined round;
/// every rank reads every label, and if any declined, all return `false` alike and the caller
/// runs the message algorithm instead.
pub(crate) fn all_to_all(
    e: &mut Engine,
    ctx: &OpCtx,
    tag: Tag,
    inputs: &[&[u8]],
    outputs: &mut [&mut [u8]],
    limit: usize,
) -> Result<bool> {
    let me = e.rank;
    let total = inputs.iter().map(|i| i.len()).sum::<usize>();
    let fits = total <= SLOT_BYTES && total <= limit;
    let round = if fits {
        e.publish_round(tag.label(), inputs)
    } else {
        e.publish_round(tag.label() | DECLINED, &[])
    };
    let mut declined = !fits;
    for p in (0..e.size).filter(|&p| p != me) {
        declined |= await_peer(e, ctx, p, round, tag, None)? & DECLINED != 0;
    }
    if declined {
        return Ok(false);
    }
    let want = outputs.iter().map(|o| o.len()).enumerate().filter(|(r, _)| *r != me);
    check_blocks_for_us(e, ctx, round, want)?;
    for (r, out) in outputs.iter_mut().enumerate() {
        let block = if r == me {
            inputs[me]
        } else {
            board(e).part(r, round, me).expect("checked above")
        };
        out.copy_from_slice(block);
    }
    Ok(true)
}

/// A round in which every rank publishes `input` and reads every peer's in place: each peer's
/// call is checked (the same tag, `arg` and length). Returns the round, whose contributions
/// `data` reads until this rank's next round. A peer that refused its call (`refuse`) fails
/// the round on every rank, with an error that names the first such peer and its reason.
pub(crate) fn gather_in_place(e: &mut Engine, ctx: &OpCtx, tag: Tag, arg: u64, input: &[u8]) -> Result<u64> {
    let label = tag.label() | arg << ARG_SHIFT;
    let round = e.publish_round(label, &[input]);
    let mut refused = None;
    for p in (0..e.size).filter(|&p| p != e.rank) {
        let (got, nbytes) = await_round(e, ctx, p, round)?;
        if got & REFUSED != 0 {
            refused = refused.or(Some((p, nbytes)));
        } else if got != label || nbytes != input.len() as u64 {
            return Err(Error::Mismatch {
                op: ctx.op,
                peer: p,
                detail: format!(
                    "it called {} (argument {}), this rank {} (argument {arg})",
                    Tag::from_label(got, nbytes).describe(),
                    got >> ARG_SHIFT,
                    Tag::from_label(label, input.len() as u64).describe()
                ),
            });
        }
    }
    match refused {
        Some((p, nbytes)) => {
            let why = board(e).data(p, round, (nbytes as usize).min(SLOT_BYTES));
            Err(super::header::refusal(ctx.op, p, tag.op, why))
        }
        None => Ok(round),
    }
}

/// The `len` bytes that `rank` published for `round`, `len` being the round's byte count (see
/// `gather_in_place` and `Board::data`).
pub(crate) fn data(e: &Engine, rank: usize, round: u64, len: usize) -> &[u8] {
    board(e).data(rank, round, len)
}

/// Takes part in a round of a collective that this rank refuses, `reason` saying why, so that
/// its peers fail at once (see `gather_in_place`) instead of waiting for it; reads every peer's
/// round, as every round does.
pub(crate) fn refuse(e: &mut Engine, ctx: &OpCtx, tag: Tag, reason: &[u8]) -> Result<()> {
    let why = &reason[..reason.len().min(SLOT_BYTES)];
    let round = e.publish_round(tag.label() | REFUSED, &[why]);
    for p in (0..e.size).filter(|&p| p != e.rank) {
        let (got, nbytes) = await_round(e, ctx, p, round)?;
        if got as u8 != tag.op {
            return Err(Error::Mismatch {
                op: ctx.op,
                peer: p,
                detail: format!(
                    "this rank refused its call of {}; rank {p} called {}",
                    super::header::op_name(tag.op),
                    Tag::from_label(got, nbytes).describe()
                ),
            });
        }
    }
    Ok(())
}

/// Waits for `peer`'s contribution to `round`, checks that both ranks had exchanged the same
/// messages before it, and returns its label and length.
fn await_round(e: &Engine, ctx: &OpCtx, peer: usize, round: u64) -> Result<(u64, u64)> {
    wait_for(e, ctx, peer, |b| b.peer_round(peer, round).is_some())?;
    let b = board(e);
    let received = e.received_from(peer);
    let sent = b.peer_sent_to_us(peer, round, received);
    if sent != received {
        return Err(Error::Mismatch {
            op: ctx.op,
            peer,
            detail: format!(
                "it had sent {sent} messages to this rank before this collective, this rank had \
                 received {received}: the ranks called different operations before it"
            ),
        });
    }
    Ok(b.peer_round(peer, round).expect("seen above"))
}
