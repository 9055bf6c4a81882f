//! Broadcast down a binomial tree: each rank takes the buffer from its parent and sends it on
//! to its children, the larger subtree first. Over TCP a message is a system call of its
//! sender's that also runs the receiving side of loopback's stack, so the direct broadcast's
//! root, which sends to every rank itself, set the pace where ranks span hosts: at 4 ranks it
//! sends 3 messages, here 2 while its first child sends the third (measured: docs/results/cpu.md,
//! part 32).
//!
//! The call check is the direct broadcast's: a receiver checks before a byte lands only the
//! call of its parent, whose message carries it, and the parent checked its own parent's in
//! turn; an inner rank's first message to each child, sent after its first exchange, carries
//! the call too (`Engine::begin_broadcast_call_carried`). Every other call is checked as it
//! comes, and no peer waits for it, so it is held (held_calls.rs).

use super::engine::{Engine, Lands, OpCtx, Xfers};
use super::header::{Call, Tag};
use crate::contracts::error::Result;
use smallvec::SmallVec;

/// The algorithm's code in the call header (header.rs), beside `Algo`'s and two_level.rs's.
pub(crate) const CODE: u8 = 3;

/// The fewest ranks at which the tree differs from the direct broadcast (at 3 the root sends
/// to both others either way).
pub(crate) const MIN_RANKS: usize = 4;

/// Our place in the tree of `root` over `n` ranks: rank `me`'s distance from the root.
fn place(me: usize, n: usize, root: usize) -> usize {
    (me + n - root) % n
}

/// The rank our buffer comes from; `None` at the root. In places from the root, a rank's
/// parent is its place without its lowest set bit.
pub(crate) fn parent(me: usize, n: usize, root: usize) -> Option<usize> {
    let v = place(me, n, root);
    (v != 0).then(|| (v - (v & v.wrapping_neg()) + root) % n)
}

/// The ranks we send to, the larger subtree first: in places, ours plus each power of two
/// below our lowest set bit (below `n` at the root).
pub(crate) fn children(me: usize, n: usize, root: usize) -> SmallVec<[usize; 4]> {
    let v = place(me, n, root);
    let below = if v == 0 {
        n.next_power_of_two()
    } else {
        v & v.wrapping_neg()
    };
    let mut out = SmallVec::new();
    let mut step = below >> 1;
    while step > 0 {
        if v + step < n {
            out.push((v + step + root) % n);
        }
        step >>= 1;
    }
    out
}

/// Opens the call (`Engine::begin_broadcast_call_carried`: our parent's bytes land here, and an
/// inner rank's call reaches its children on its data) and runs the broadcast.
pub(crate) fn broadcast(e: &mut Engine, ctx: &OpCtx, tag: Tag, call: Call, buf: &mut [u8], root: usize) -> Result<()> {
    let (n, me) = (e.size, e.rank);
    let parent = parent(me, n, root);
    let kids = children(me, n, root);
    let carried_later: &[usize] = if parent.is_some() { &kids } else { &[] };
    e.begin_broadcast_call_carried(tag, call, parent.map_or(Lands::Nothing, Lands::From), carried_later);
    if let Some(p) = parent {
        let x = e.recv(p, tag, buf);
        e.exchange(ctx, &mut [x])?;
    }
    if kids.is_empty() {
        return Ok(());
    }
    // Through the stream: a parent does not wait for its children to copy.
    let mut x: Xfers = kids.iter().map(|&c| e.send_in_stream(c, tag, buf)).collect();
    e.exchange(ctx, &mut x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank but the root has one parent, which lists it among its children, and every
    /// rank is reached from the root; the root's first child heads the larger subtree.
    #[test]
    fn the_tree_reaches_every_rank_once_from_any_root() {
        for n in 1..=13 {
            for root in 0..n {
                let mut reached = vec![false; n];
                reached[root] = true;
                let mut todo = vec![root];
                while let Some(r) = todo.pop() {
                    for c in children(r, n, root) {
                        assert!(!reached[c], "n {n} root {root}: {c} twice");
                        assert_eq!(parent(c, n, root), Some(r), "n {n} root {root}");
                        reached[c] = true;
                        todo.push(c);
                    }
                }
                assert!(reached.iter().all(|&r| r), "n {n} root {root}");
                assert_eq!(parent(root, n, root), None);
            }
        }
        assert_eq!(children(0, 4, 0).as_slice(), [2, 1]);
        assert_eq!(children(2, 4, 0).as_slice(), [3]);
        assert_eq!(children(3, 4, 1).as_slice(), [0], "root 1: place 2 sends to place 3");
    }
}
