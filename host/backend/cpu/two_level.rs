//! all_reduce in two levels, for ranks that span machines: a ring reduce-scatter among the
//! ranks of each machine, an all_reduce of each shard among the ranks that hold it on the
//! other machines (a ring reduce-scatter and all-gather across), and a ring all-gather on each
//! machine again.
//!
//! What crosses between machines is what a flat algorithm wastes. With `m` machines of `l`
//! ranks and a buffer of `B` bytes, each machine sends `2(m-1)/m · B` across in all (`B` for
//! two machines, the least an all_reduce between them can move); the flat ring crosses each
//! machine boundary with `2(n-1)/n · B` per link it has there, and the direct exchange sends
//! every rank's whole buffer to every rank of the other machines (`l² · B` from each machine
//! to each other). Measured over a rate-limited link between two network namespaces:
//! docs/results/cpu.md, "all_reduce in two levels".

use super::algorithms::{
    block_lens, gather_in_stream, parts_of, premul_work, ring_all_gather, ring_all_reduce, ring_reduce_scatter, Ring,
    Scratch, RING_PIECE,
};
use super::engine::{Engine, OpCtx};
use super::header::Tag;
use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::Result;
use crate::contracts::reduce::epilogue;

/// The algorithm's code in the call header (header.rs), beside the flat ones of `Algo`.
pub(crate) const CODE: u8 = 2;

/// Where no hint says otherwise, an all_reduce of at least this many bytes runs in two levels
/// wherever it can: measured over a link between two network namespaces (docs/results/cpu.md,
/// "all_reduce in two levels" and part 21). At 32 KiB and 4 ranks the direct exchange sends
/// 128 KiB each way across, 105 us at 10 Gbit/s: two levels took 69-75 us there against its
/// 110 on the Intel Xeon guest (136 against 114 on the AMD EPYC guest of part 12, before
/// parts 13-20); at 16 KiB the direct exchange still wins on both.
pub(crate) const TWO_LEVEL_FROM: usize = 32 << 10;

/// Where the ranks sit: the ranks of our machine, in rank order, and the ranks that hold our
/// place on every machine, in machine order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    local: Vec<usize>,
    local_pos: usize,
    across: Vec<usize>,
    across_pos: usize,
}

impl Layout {
    /// The layout of `rank` among ranks on `machines` (`machines[r]`: rank r's machine); `None`
    /// unless there are at least two machines, each with the same number (at least two) of
    /// ranks. With one rank per machine the flat ring is already the algorithm across.
    pub(crate) fn of(machines: &[usize], rank: usize) -> Option<Layout> {
        let ranks_on = |m: usize| (0..machines.len()).filter(move |&r| machines[r] == m);
        let local: Vec<usize> = ranks_on(machines[rank]).collect();
        let local_pos = local.iter().position(|&r| r == rank)?;
        let count = machines.iter().max()? + 1;
        if count < 2 || local.len() < 2 || machines.len() != count * local.len() {
            return None;
        }
        let mut across = Vec::with_capacity(count);
        for m in 0..count {
            // Every machine must have as many ranks as ours.
            let on = ranks_on(m).collect::<Vec<_>>();
            if on.len() != local.len() {
                return None;
            }
            across.push(on[local_pos]);
        }
        let across_pos = across.iter().position(|&r| r == rank)?;
        Some(Layout {
            local,
            local_pos,
            across,
            across_pos,
        })
    }
}

/// all_reduce of `buf` in two levels over `layout`, epilogue included. Every
/// rank ends with the same bits: each shard is reduced once, on the ranks across, and then
/// copied to everyone.
#[allow(clippy::too_many_arguments)]
pub(crate) fn all_reduce(
    e: &mut Engine,
    s: &mut Scratch,
    ctx: &OpCtx,
    tag: Tag,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    layout: &Layout,
) -> Result<()> {
    let esize = dtype.size();
    let premul = matches!(op, ReduceOp::PremulSum(_));
    let lens = block_lens(buf.len() / esize, layout.local.len(), esize);
    // The largest block a step receives is the first of `lens` (a shard's blocks are smaller).
    let (tmp, scaled) = s.two(lens[0].min(RING_PIECE), if premul { buf.len() } else { 0 });
    let local = Ring::of(&layout.local, layout.local_pos);
    let across = Ring::of(&layout.across, layout.across_pos);
    let mut parts = parts_of(premul_work(buf, scaled, dtype, op), lens.iter().copied());
    ring_reduce_scatter(e, ctx, tag, local, &mut parts, dtype, op, tmp)?;
    ring_all_reduce(e, ctx, tag, across, parts[layout.local_pos], dtype, op, tmp)?;
    let in_stream = gather_in_stream(&parts);
    ring_all_gather(e, ctx, tag, local, &mut parts, None, in_stream)?;
    if premul {
        buf.copy_from_slice(scaled);
    }
    epilogue(dtype, op, e.size, buf);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::header::Call;
    use super::*;
    use crate::contracts::error::Error;
    use crate::net::links::{connect_threads_with, Transport};
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    /// Transports of `machines.len()` thread ranks that say they sit on `machines`.
    fn threads_on(machines: &[usize]) -> Vec<Transport> {
        let mut ts = connect_threads_with(machines.len(), Some(4096));
        for t in &mut ts {
            t.set_machines(machines.to_vec());
        }
        ts
    }

    /// Runs one two-level all_reduce over `ts`, one transport per rank, whose machines say the
    /// layout, rank r with the bytes `inputs[r]` of `dtype`, as the backend runs it (mod.rs):
    /// the call opened first. Returns each rank's buffer and result.
    fn run_bytes(ts: Vec<Transport>, inputs: Vec<Vec<u8>>, dtype: DType, op: ReduceOp) -> Vec<(Vec<u8>, Result<()>)> {
        let n = ts.len();
        std::thread::scope(|sc| {
            let hs: Vec<_> = ts
                .into_iter()
                .zip(inputs)
                .enumerate()
                .map(|(r, (t, mut buf))| {
                    sc.spawn(move || {
                        let mut e = Engine::new(r, n, t);
                        let layout = Layout::of(e.transport.machines(), r).expect("an even layout");
                        let mut s = Scratch::default();
                        let abort = AtomicBool::new(false);
                        let ctx = OpCtx::new("all_reduce", Duration::from_secs(10), &abort);
                        let tag = super::super::tag(1, dtype, Some(op));
                        let call = Call {
                            count: (buf.len() / dtype.size()) as u64,
                            root: 0,
                            algo: CODE,
                            seq: 0,
                        };
                        e.begin_call(tag, call, true, true);
                        let r = all_reduce(&mut e, &mut s, &ctx, tag, &mut buf, dtype, op, &layout);
                        e.end_call();
                        (buf, r)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// `run_bytes` on i32 elements.
    fn run(ts: Vec<Transport>, inputs: Vec<Vec<i32>>, op: ReduceOp) -> Vec<(Vec<i32>, Result<()>)> {
        let bytes = inputs
            .iter()
            .map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        run_bytes(ts, bytes, DType::I32, op)
            .into_iter()
            .map(|(b, r)| {
                (
                    b.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect(),
                    r,
                )
            })
            .collect()
    }

    fn input(rank: usize, count: usize) -> Vec<i32> {
        (0..count).map(|i| (rank * 1000 + i) as i32).collect()
    }

    #[test]
    fn every_rank_gets_the_whole_reduction_on_any_even_layout_and_any_length() {
        let layouts: [&[usize]; 4] = [&[0, 0, 1, 1], &[0, 1, 0, 1], &[0, 0, 0, 1, 1, 1], &[0, 1, 2, 0, 1, 2]];
        for machines in layouts {
            let n = machines.len();
            // Fewer elements than ranks (empty blocks), uneven blocks, and more than one ring
            // piece per block.
            for count in [1, n - 1, 7 * n + 3, (RING_PIECE / 4) * 3 + 5] {
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                    let inputs: Vec<Vec<i32>> = (0..n).map(|r| input(r, count)).collect();
                    let want: Vec<i32> = (0..count)
                        .map(|i| {
                            let all = inputs.iter().map(|v| v[i]);
                            match op {
                                ReduceOp::Sum => all.sum(),
                                ReduceOp::Max => all.max().unwrap(),
                                _ => all.sum::<i32>() / n as i32,
                            }
                        })
                        .collect();
                    for (r, (buf, res)) in run(threads_on(machines), inputs, op).into_iter().enumerate() {
                        res.unwrap();
                        assert!(buf == want, "{machines:?}, {count} elements, {op:?}: rank {r} is wrong");
                    }
                }
            }
        }
    }

    /// A shrink hands each member its links with the members' machines, numbered anew: of six
    /// ranks, three on each of two machines (here numbered 5 and 7), the four that stay (two on
    /// each, interleaved with those that leave) see machines 0, 0, 1, 1 and still reduce in two
    /// levels. Machine numbers lost in the hand-over would leave them no layout.
    #[test]
    fn a_shrunk_group_keeps_its_machines_and_reduces_in_two_levels() {
        let members = [0, 2, 3, 5];
        let mut ts = threads_on(&[5, 5, 5, 7, 7, 7]);
        let handed: Vec<Transport> = members.iter().map(|&m| ts[m].hand_over(&members, false)).collect();
        drop(ts);
        for t in &handed {
            assert_eq!(t.machines(), &[0, 0, 1, 1]);
        }
        let count = 7 * members.len() + 3;
        let inputs: Vec<Vec<i32>> = (0..members.len()).map(|r| input(r, count)).collect();
        let want: Vec<i32> = (0..count).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
        for (r, (got, res)) in run(handed, inputs, ReduceOp::Sum).into_iter().enumerate() {
            res.unwrap();
            assert!(got == want, "rank {r} is wrong");
        }
    }

    /// premul_sum scales each contribution in scratch (the caller's buffer is the output only):
    /// f32 values whose scaled sums are exact, so every rank must hold exactly these bits.
    #[test]
    fn premul_sum_scales_every_contribution_once_and_every_rank_gets_the_same_bits() {
        let machines = [0, 1, 0, 1];
        let count = 1000;
        let value = |r: usize, i: usize| (r * 8 + i % 7) as f32;
        let inputs: Vec<Vec<u8>> = (0..4)
            .map(|r| (0..count).flat_map(|i| value(r, i).to_le_bytes()).collect())
            .collect();
        let got = run_bytes(threads_on(&machines), inputs, DType::F32, ReduceOp::PremulSum(0.5));
        for (r, (buf, res)) in got.into_iter().enumerate() {
            res.unwrap();
            for i in 0..count {
                let v = f32::from_le_bytes(buf[4 * i..4 * i + 4].try_into().unwrap());
                let want: f32 = (0..4).map(|p| value(p, i) * 0.5).sum();
                assert_eq!(v.to_bits(), want.to_bits(), "rank {r}, element {i}");
            }
        }
    }

    #[test]
    fn a_rank_with_another_count_is_a_mismatch_on_every_rank_and_no_buffer_changes() {
        let machines = [0, 0, 1, 1];
        let inputs: Vec<Vec<i32>> = (0..4).map(|r| input(r, if r == 3 { 40 } else { 32 })).collect();
        for (r, (buf, res)) in run(threads_on(&machines), inputs.clone(), ReduceOp::Sum)
            .into_iter()
            .enumerate()
        {
            assert!(matches!(res, Err(Error::Mismatch { .. })), "rank {r}: {res:?}");
            assert_eq!(buf, inputs[r], "rank {r}'s buffer changed");
        }
    }

    #[test]
    fn a_layout_needs_two_machines_with_as_many_ranks_each_and_at_least_two() {
        // Machines 0 and 1, two ranks each, interleaved.
        let l = Layout::of(&[0, 1, 0, 1], 2).unwrap();
        assert_eq!(
            l,
            Layout {
                local: vec![0, 2],
                local_pos: 1,
                across: vec![2, 3],
                across_pos: 0
            }
        );
        let l = Layout::of(&[0, 0, 0, 1, 1, 1, 2, 2, 2], 4).unwrap();
        assert_eq!(
            (l.local, l.local_pos, l.across, l.across_pos),
            (vec![3, 4, 5], 1, vec![1, 4, 7], 1)
        );
        assert_eq!(Layout::of(&[0, 0, 0, 0], 1), None, "one machine");
        assert_eq!(Layout::of(&[0, 1, 2], 1), None, "one rank per machine");
        assert_eq!(Layout::of(&[0, 0, 1, 1, 1], 0), None, "uneven machines");
        assert_eq!(
            Layout::of(&[0, 0, 0, 1, 1, 1, 2], 6),
            None,
            "uneven machines, seen from the small one"
        );
    }
}
