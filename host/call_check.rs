//! Cross-rank check of every call's arguments (`FERROCOMM_CHECK_CALLS=1`).
//!
//! The CPU engine and the device kernels catch mismatched calls on their own, from the headers
//! and signatures that travel with the data. NCCL does not: ranks that call different
//! operations, or one with different sizes, hang or read garbage. With the check on, every
//! operation is preceded by a small exchange on the communicator's CPU engine: each rank sends
//! each partner its view of what passes between the two (operation, dtype, reduce op, root,
//! the messages each way) and runs the call only if every pair agrees. For a collective the
//! views go through an all_to_all, each rank judges its own pairs, and an all_reduce of the
//! first bad pair gives every rank the same verdict: a mismatch fails the call on all of them
//! before any of its bytes move, and the communicator stays usable. That is O(world) bytes per
//! rank and two small operations per call. A send/recv batch exchanges views with its peers
//! only, so the verdict is the pair's: a third rank waiting on one of them ends in its timeout.
//!
//! The check runs when the call is issued on the host; replays of a captured CUDA graph are
//! not checked again.

use crate::contracts::backend::{Backend, RunOptions};
use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::{Buf, BufMut, Op, P2p};
use std::collections::BTreeMap;
use std::time::Duration;

/// Operation kinds as the check encodes them; the position is the code.
const KINDS: [&str; 13] = [
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "scatter",
    "gather",
    "barrier",
    "send/recv",
    "all_reduce_residual_rmsnorm",
    "moe_dispatch",
    "moe_combine",
];
/// One of each reduction, to name a code (the pre-multiplied sum's scalar is per rank).
const REDUCE_OPS: [ReduceOp; 9] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Avg,
    ReduceOp::BAnd,
    ReduceOp::BOr,
    ReduceOp::BXor,
    ReduceOp::PremulSum(1.0),
];
const NONE8: u8 = u8::MAX;
const NO_ROOT: u32 = u32::MAX;
const VIEW_BYTES: usize = 48;

/// The messages one rank of a pair means to send to (or receive from) the other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Traffic {
    messages: u32,
    bytes: u64,
    /// A hash of the ordered (dtype, size) of every message: equal totals can still pair
    /// messages of different sizes.
    order: u64,
}

impl Traffic {
    fn of(messages: impl IntoIterator<Item = (DType, usize)>) -> Traffic {
        let mut t = Traffic {
            order: 0xcbf2_9ce4_8422_2325,
            ..Traffic::default()
        };
        for (dtype, bytes) in messages {
            t.messages += 1;
            t.bytes += bytes as u64;
            for b in [dtype as u8].into_iter().chain((bytes as u64).to_le_bytes()) {
                t.order = (t.order ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        t
    }

    fn one(dtype: DType, bytes: usize) -> Traffic {
        Traffic::of([(dtype, bytes)])
    }
}

/// What one rank's call means for one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct View {
    kind: u8,
    dtype: u8,
    redop: u8,
    root: u32,
    sends: Traffic,
    recvs: Traffic,
}

impl View {
    fn encode(&self) -> [u8; VIEW_BYTES] {
        let mut b = [0u8; VIEW_BYTES];
        b[0] = self.kind;
        b[1] = self.dtype;
        b[2] = self.redop;
        b[4..8].copy_from_slice(&self.root.to_le_bytes());
        b[8..12].copy_from_slice(&self.sends.messages.to_le_bytes());
        b[12..16].copy_from_slice(&self.recvs.messages.to_le_bytes());
        b[16..24].copy_from_slice(&self.sends.bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.recvs.bytes.to_le_bytes());
        b[32..40].copy_from_slice(&self.sends.order.to_le_bytes());
        b[40..48].copy_from_slice(&self.recvs.order.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> View {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        View {
            kind: b[0],
            dtype: b[1],
            redop: b[2],
            root: u32_at(4),
            sends: Traffic {
                messages: u32_at(8),
                bytes: u64_at(16),
                order: u64_at(32),
            },
            recvs: Traffic {
                messages: u32_at(12),
                bytes: u64_at(24),
                order: u64_at(40),
            },
        }
    }

    /// Whether `self` (one rank's view of the pair) and `other` (the partner's) describe the
    /// same call: same operation and arguments, and each side receives what the other sends.
    fn agrees(&self, other: &View) -> bool {
        (self.kind, self.dtype, self.redop, self.root) == (other.kind, other.dtype, other.redop, other.root)
            && self.sends == other.recvs
            && self.recvs == other.sends
    }

    /// `toward` names the partner ("rank 2", "this rank").
    fn describe(&self, toward: &str) -> String {
        let mut s = KINDS
            .get(self.kind as usize)
            .copied()
            .unwrap_or("an unknown operation")
            .to_owned();
        if let Some(d) = DType::from_code(self.dtype) {
            s += &format!(" of {d}");
        }
        if let Some(r) = REDUCE_OPS.iter().find(|r| r.code() == self.redop) {
            s += &format!(" ({r})");
        }
        if self.root != NO_ROOT {
            s += &format!(" with root {}", self.root);
        }
        let part = |t: &Traffic| match t.messages {
            1 => format!("{} bytes", t.bytes),
            m => format!("{m} messages of {} bytes in all", t.bytes),
        };
        format!(
            "{s}, sending {} to {toward} and receiving {} from it",
            part(&self.sends),
            part(&self.recvs)
        )
    }
}

/// This rank's view of `op` toward every rank (its own entry is never compared).
fn views(op: &Op<'_>, me: usize, n: usize) -> Vec<View> {
    let kind = |name: &str| KINDS.iter().position(|k| *k == name).unwrap_or(KINDS.len()) as u8;
    let none = Traffic::default();
    let view = |name: &str, dtype: Option<DType>, redop: Option<u8>, root: Option<usize>| View {
        kind: kind(name),
        dtype: dtype.map_or(NONE8, |d| d as u8),
        redop: redop.unwrap_or(NONE8),
        root: root.map_or(NO_ROOT, |r| r as u32),
        sends: none,
        recvs: none,
    };
    let both = |v: View, t: Traffic| View {
        sends: t,
        recvs: t,
        ..v
    };
    (0..n)
        .map(|p| match op {
            Op::AllReduce { buf, op: r } => both(
                view("all_reduce", Some(buf.dtype()), Some(r.code()), None),
                Traffic::one(buf.dtype(), buf.byte_len()),
            ),
            Op::Reduce { buf, op: r, root } => both(
                view("reduce", Some(buf.dtype()), Some(r.code()), Some(*root)),
                Traffic::one(buf.dtype(), buf.byte_len()),
            ),
            Op::Broadcast { buf, root } => both(
                view("broadcast", Some(buf.dtype()), None, Some(*root)),
                Traffic::one(buf.dtype(), buf.byte_len()),
            ),
            Op::AllGather { input, outputs } => View {
                sends: Traffic::one(input.dtype(), input.byte_len()),
                recvs: Traffic::one(outputs[p].dtype(), outputs[p].byte_len()),
                ..view("all_gather", Some(input.dtype()), None, None)
            },
            Op::ReduceScatter { inputs, output, op: r } => View {
                sends: Traffic::one(inputs[p].dtype(), inputs[p].byte_len()),
                recvs: Traffic::one(output.dtype(), output.byte_len()),
                ..view("reduce_scatter", Some(output.dtype()), Some(r.code()), None)
            },
            Op::AllToAll { inputs, outputs } => View {
                sends: Traffic::one(inputs[p].dtype(), inputs[p].byte_len()),
                recvs: Traffic::one(outputs[p].dtype(), outputs[p].byte_len()),
                ..view("all_to_all", Some(outputs[me].dtype()), None, None)
            },
            Op::Scatter { inputs, output, root } => {
                let v = view("scatter", Some(output.dtype()), None, Some(*root));
                match inputs {
                    Some(ins) => View {
                        sends: Traffic::one(ins[p].dtype(), ins[p].byte_len()),
                        ..v
                    },
                    None if p == *root => View {
                        recvs: Traffic::one(output.dtype(), output.byte_len()),
                        ..v
                    },
                    None => v,
                }
            }
            Op::Gather { input, outputs, root } => {
                let v = view("gather", Some(input.dtype()), None, Some(*root));
                match outputs {
                    Some(outs) => View {
                        recvs: Traffic::one(outs[p].dtype(), outs[p].byte_len()),
                        ..v
                    },
                    None if p == *root => View {
                        sends: Traffic::one(input.dtype(), input.byte_len()),
                        ..v
                    },
                    None => v,
                }
            }
            Op::Barrier => view("barrier", None, None, None),
            Op::Batch(list) => View {
                sends: Traffic::of(list.iter().filter_map(|x| match x {
                    P2p::Send { buf, peer } if *peer == p => Some((buf.dtype(), buf.byte_len())),
                    _ => None,
                })),
                recvs: Traffic::of(list.iter().filter_map(|x| match x {
                    P2p::Recv { buf, peer } if *peer == p => Some((buf.dtype(), buf.byte_len())),
                    _ => None,
                })),
                ..view("send/recv", None, None, None)
            },
            // The root field carries the row length, which every rank must share.
            Op::AllReduceRmsNorm(f) => both(
                view(
                    "all_reduce_residual_rmsnorm",
                    Some(f.x.dtype()),
                    Some(f.out.dtype() as u8),
                    Some(f.hidden),
                ),
                Traffic::one(f.x.dtype(), f.x.byte_len()),
            ),
            // Per-peer traffic depends on the routing; the shape is what must agree.
            Op::MoeDispatch(m) => view(
                "moe_dispatch",
                m.send
                    .as_ref()
                    .map(|s| s.tokens.dtype())
                    .or(m.recv.as_ref().map(|r| r.tokens.dtype())),
                Some(u8::from(m.send.is_some()) | u8::from(m.recv.is_some()) << 1),
                Some(m.shape.hidden),
            ),
            Op::MoeCombine(m) => view(
                "moe_combine",
                m.send
                    .as_ref()
                    .map(|s| s.expert_out.dtype())
                    .or(m.recv.as_ref().map(|r| r.out.dtype())),
                Some(u8::from(m.send.is_some()) | u8::from(m.recv.is_some()) << 1),
                Some(m.shape.hidden),
            ),
        })
        .collect()
}

/// How a rank describes the mismatch of its pair with `p`: `theirs` is p's view of it.
fn pair_error(name: &'static str, p: usize, mine: &View, theirs: &View) -> Error {
    let detail = format!(
        "rank {p} called {}; this rank called {}",
        theirs.describe("this rank"),
        mine.describe(&format!("rank {p}"))
    );
    Error::Mismatch {
        op: name,
        peer: p,
        detail,
    }
}

/// Exchanges what this rank is about to do in `op` with its partners and fails the call with
/// `Error::Mismatch` unless every pair agrees (see the module comment).
pub(crate) fn check(b: &dyn Backend, op: &Op<'_>, me: usize, n: usize, timeout: Duration) -> Result<()> {
    let name = op.name();
    let mine = views(op, me, n);
    let hints = BTreeMap::new();
    let opts = RunOptions {
        timeout,
        hints: &hints,
        stream: 0,
        fence: None,
    };
    let sent: Vec<[u8; VIEW_BYTES]> = mine.iter().map(View::encode).collect();
    let mut got = vec![[0u8; VIEW_BYTES]; n];
    let batch = matches!(op, Op::Batch(_));
    let peers: Vec<usize> = match op {
        Op::Batch(list) => {
            let mut peers: Vec<usize> = list
                .iter()
                .map(|x| match x {
                    P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
                })
                .filter(|&p| p != me)
                .collect();
            peers.sort_unstable();
            peers.dedup();
            if peers.is_empty() {
                // Only sends to itself: nobody to disagree with.
                return Ok(());
            }
            let mut exchange = Vec::with_capacity(2 * peers.len());
            for (p, (s, g)) in sent.iter().zip(got.iter_mut()).enumerate() {
                if peers.binary_search(&p).is_ok() {
                    exchange.push(P2p::Send {
                        buf: Buf::from_host_bytes(s, DType::U8),
                        peer: p,
                    });
                    exchange.push(P2p::Recv {
                        buf: BufMut::from_host_bytes(g, DType::U8),
                        peer: p,
                    });
                }
            }
            b.run(&mut Op::Batch(exchange), &opts)?;
            peers
        }
        _ => {
            let mut exchange = Op::AllToAll {
                inputs: sent.iter().map(|s| Buf::from_host_bytes(s, DType::U8)).collect(),
                outputs: got.iter_mut().map(|g| BufMut::from_host_bytes(g, DType::U8)).collect(),
            };
            b.run(&mut exchange, &opts)?;
            (0..n).filter(|&p| p != me).collect()
        }
    };
    let bad = peers
        .iter()
        .map(|&p| (p, View::decode(&got[p])))
        .find(|(p, theirs)| !mine[*p].agrees(theirs));
    if batch {
        // Only the batch's partners take part, so the verdict is each pair's own.
        return bad.map_or(Ok(()), |(p, theirs)| Err(pair_error(name, p, &mine[p], &theirs)));
    }
    // Every rank judged its own pairs; the first bad pair of all fails the call everywhere,
    // also on ranks whose own pairs agree.
    let code = bad.map_or(u64::MAX, |(p, _)| (me.min(p) * n + me.max(p)) as u64);
    let mut first = code.to_le_bytes();
    b.run(
        &mut Op::AllReduce {
            buf: BufMut::from_host_bytes(&mut first, DType::U64),
            op: ReduceOp::Min,
        },
        &opts,
    )?;
    let first = u64::from_le_bytes(first);
    match bad {
        Some((p, theirs)) => Err(pair_error(name, p, &mine[p], &theirs)),
        None if first == u64::MAX => Ok(()),
        None => {
            let (i, j) = ((first / n as u64) as usize, (first % n as u64) as usize);
            Err(Error::Mismatch {
                op: name,
                peer: i,
                detail: format!("ranks {i} and {j} made different calls (their own errors say how)"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_reduce(buf: &mut [f32]) -> Op<'_> {
        Op::AllReduce {
            buf: BufMut::new(buf),
            op: ReduceOp::Sum,
        }
    }

    #[test]
    fn views_round_trip_through_their_encoding() {
        let mut a = [0f32; 5];
        let v = views(&all_reduce(&mut a), 0, 2)[1];
        assert_eq!(View::decode(&v.encode()), v);
        assert_eq!(v.sends.bytes, 20);
    }

    #[test]
    fn equal_calls_agree_and_other_sizes_do_not() {
        let (mut a, mut b, mut c) = ([0f32; 5], [0f32; 5], [0f32; 6]);
        let va = views(&all_reduce(&mut a), 0, 2)[1];
        let vb = views(&all_reduce(&mut b), 1, 2)[0];
        let vc = views(&all_reduce(&mut c), 1, 2)[0];
        assert!(va.agrees(&vb));
        assert!(!va.agrees(&vc));
        assert!(
            vc.describe("this rank").contains("24 bytes"),
            "{}",
            vc.describe("this rank")
        );
    }

    #[test]
    fn batches_pair_sends_with_receives_in_order() {
        let (x, y) = ([0u8; 4], [0u8; 8]);
        let (mut rx, mut ry) = ([0u8; 4], [0u8; 8]);
        let sender = Op::Batch(vec![
            P2p::Send {
                buf: Buf::new(&x),
                peer: 1,
            },
            P2p::Send {
                buf: Buf::new(&y),
                peer: 1,
            },
        ]);
        let s = views(&sender, 0, 2)[1];
        let in_order = Op::Batch(vec![
            P2p::Recv {
                buf: BufMut::new(&mut rx),
                peer: 0,
            },
            P2p::Recv {
                buf: BufMut::new(&mut ry),
                peer: 0,
            },
        ]);
        assert!(s.agrees(&views(&in_order, 1, 2)[0]));
        let swapped = Op::Batch(vec![
            P2p::Recv {
                buf: BufMut::new(&mut ry),
                peer: 0,
            },
            P2p::Recv {
                buf: BufMut::new(&mut rx),
                peer: 0,
            },
        ]);
        let r = views(&swapped, 1, 2)[0];
        assert_eq!((r.recvs.messages, r.recvs.bytes), (2, 12));
        assert!(!s.agrees(&r), "same totals, other order");
    }
}
