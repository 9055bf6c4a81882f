//! Operations as data. Every public call of a communicator (`Comm`) becomes an [`Op`] that borrows the
//! caller's buffers; a backend executes it. Per-rank parts (all_gather outputs, all_to_all
//! inputs, ...) are always resolved into one buffer per rank before a backend sees them, so the
//! single-buffer, list and v-forms of a collective are one operation.

pub use crate::contracts::bufs::{Buf, BufMut, DeviceBytes, Location};
use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::{Error, Result};
use crate::contracts::inference::{MoeCombine, MoeDispatch, RmsNormFusion};
use std::cell::Cell;

/// One point-to-point transfer of a batch.
#[derive(Debug)]
#[non_exhaustive]
pub enum P2p<'a> {
    /// Send `buf` to rank `peer`, which posts a matching [`P2p::Recv`].
    Send {
        /// The bytes to send.
        buf: Buf<'a>,
        /// The receiving rank.
        peer: usize,
    },
    /// Receive into `buf` from rank `peer`, which posts a matching [`P2p::Send`] of the same
    /// length.
    Recv {
        /// Where the message lands; its length must equal the sender's.
        buf: BufMut<'a>,
        /// The sending rank.
        peer: usize,
    },
}

/// A communication operation with its buffers, as a backend receives it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Op<'a> {
    /// `buf` is reduced in place over all ranks; every rank gets the same result.
    AllReduce {
        /// This rank's contribution, overwritten with the result.
        buf: BufMut<'a>,
        /// How elements combine.
        op: ReduceOp,
    },
    /// The result lands in `root`'s buffer; the other ranks' buffers are left unchanged.
    Reduce {
        /// This rank's contribution; on `root`, overwritten with the result.
        buf: BufMut<'a>,
        /// How elements combine.
        op: ReduceOp,
        /// The rank that receives the result.
        root: usize,
    },
    /// `root`'s `buf` is copied into every other rank's `buf`.
    Broadcast {
        /// The data on `root`; the destination elsewhere (same length on every rank).
        buf: BufMut<'a>,
        /// The rank whose buffer is sent.
        root: usize,
    },
    /// `outputs[r]` receives rank r's `input`.
    AllGather {
        /// This rank's contribution.
        input: Buf<'a>,
        /// One buffer per rank, in rank order; `outputs[r]` has rank r's input length.
        outputs: Vec<BufMut<'a>>,
    },
    /// `output` receives the reduction over ranks of their `inputs[rank]`.
    ReduceScatter {
        /// One part per rank, in rank order; part r is reduced into rank r's `output`.
        inputs: Vec<Buf<'a>>,
        /// This rank's part of the reduced result.
        output: BufMut<'a>,
        /// How elements combine.
        op: ReduceOp,
    },
    /// `outputs[r]` receives rank r's `inputs[rank]`.
    AllToAll {
        /// One part per rank: `inputs[r]` goes to rank r.
        inputs: Vec<Buf<'a>>,
        /// One part per rank: `outputs[r]` comes from rank r.
        outputs: Vec<BufMut<'a>>,
    },
    /// Root's `inputs[r]` goes to rank r's `output`; `inputs` is `None` off the root.
    Scatter {
        /// On `root`, one part per rank, in rank order; `None` elsewhere.
        inputs: Option<Vec<Buf<'a>>>,
        /// This rank's part.
        output: BufMut<'a>,
        /// The rank that holds the parts.
        root: usize,
    },
    /// Rank r's `input` goes to root's `outputs[r]`; `outputs` is `None` off the root.
    Gather {
        /// This rank's contribution.
        input: Buf<'a>,
        /// On `root`, one buffer per rank, in rank order; `None` elsewhere.
        outputs: Option<Vec<BufMut<'a>>>,
        /// The rank that collects.
        root: usize,
    },
    /// Returns on each rank once every rank has entered it.
    Barrier,
    /// Point-to-point transfers progressed together; never deadlocks whatever their order.
    Batch(Vec<P2p<'a>>),
    /// all_reduce, residual add and RMSNorm in one operation (see [`RmsNormFusion`]).
    AllReduceRmsNorm(RmsNormFusion<'a>),
    /// Mixture-of-experts dispatch, or one of its halves (see [`MoeDispatch`]).
    MoeDispatch(MoeDispatch<'a>),
    /// Mixture-of-experts combine, or one of its halves (see [`MoeCombine`]).
    MoeCombine(MoeCombine<'a>),
}

impl Op<'_> {
    /// Whether a rank that refuses this operation for its arguments still tells its peers,
    /// where its backend can (`Backend::refuse`): the fused norm and the send halves of MoE
    /// dispatch and combine, which every rank exchanges with every rank. (The other
    /// collectives fail on the rank alone, as NCCL's do.)
    pub(crate) fn refused_in_band(&self) -> bool {
        match self {
            Op::AllReduceRmsNorm(_) => true,
            Op::MoeDispatch(m) => m.send.is_some(),
            Op::MoeCombine(m) => m.send.is_some(),
            _ => false,
        }
    }

    /// The name used in errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Op::AllReduce { .. } => "all_reduce",
            Op::Reduce { .. } => "reduce",
            Op::Broadcast { .. } => "broadcast",
            Op::AllGather { .. } => "all_gather",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllToAll { .. } => "all_to_all",
            Op::Scatter { .. } => "scatter",
            Op::Gather { .. } => "gather",
            Op::Barrier => "barrier",
            Op::Batch(v) => match v.as_slice() {
                [P2p::Send { .. }] => "send",
                [P2p::Recv { .. }] => "recv",
                _ => "batch_p2p",
            },
            Op::AllReduceRmsNorm(_) => "all_reduce_residual_rmsnorm",
            Op::MoeDispatch(_) => "moe_dispatch",
            Op::MoeCombine(_) => "moe_combine",
        }
    }

    /// Where the operation's buffers live (`None` for an operation without buffers); an error
    /// if they are not all in one place.
    pub fn location(&self) -> Result<Option<Location>> {
        // No allocation and no dynamic call: this runs on every call of every backend.
        let (first, other) = (Cell::new(None), Cell::new(None));
        let see = |l: Location| match first.get() {
            None => first.set(Some(l)),
            Some(f) if f != l && other.get().is_none() => other.set(Some(l)),
            Some(_) => {}
        };
        self.for_each_buffer(|b| see(b.location()), |b| see(b.location()));
        if let (Some(first), Some(other)) = (first.get(), other.get()) {
            return Err(Error::invalid(
                self.name(),
                format!(
                    "buffers in {first:?} and {other:?} memory: all of an operation's buffers must be in one place"
                ),
            ));
        }
        Ok(first.get())
    }

    /// The CUDA device of the first buffer in device memory, if any: what a host-memory
    /// backend refuses. Cheaper than `location`, which also finds buffers in two places.
    pub(crate) fn device_ordinal(&self) -> Option<usize> {
        let found = Cell::new(None);
        let see = |l: Location| {
            if let (Location::Cuda(ordinal), None) = (l, found.get()) {
                found.set(Some(ordinal));
            }
        };
        self.for_each_buffer(|b| see(b.location()), |b| see(b.location()));
        found.get()
    }

    /// The larger of the bytes this rank reads and the bytes it writes: the message size that
    /// algorithm choices go by.
    pub fn message_bytes(&self) -> usize {
        let (mut read, mut written) = (0, 0);
        self.for_each_buffer(|b| read += b.byte_len(), |b| written += b.byte_len());
        read.max(written)
    }

    /// Visits every buffer in a fixed order: inputs with `input`, outputs (also in-place ones)
    /// with `output`.
    pub(crate) fn for_each_buffer(&self, mut input: impl FnMut(&Buf), mut output: impl FnMut(&BufMut)) {
        match self {
            Op::AllReduce { buf, .. } | Op::Reduce { buf, .. } | Op::Broadcast { buf, .. } => output(buf),
            Op::AllGather { input: i, outputs } => {
                input(i);
                outputs.iter().for_each(&mut output);
            }
            Op::ReduceScatter { inputs, output: o, .. } => {
                inputs.iter().for_each(&mut input);
                output(o);
            }
            Op::AllToAll { inputs, outputs } => {
                inputs.iter().for_each(&mut input);
                outputs.iter().for_each(&mut output);
            }
            Op::Scatter { inputs, output: o, .. } => {
                inputs.iter().flatten().for_each(&mut input);
                output(o);
            }
            Op::Gather { input: i, outputs, .. } => {
                input(i);
                outputs.iter().flatten().for_each(&mut output);
            }
            Op::Barrier => {}
            Op::Batch(v) => v.iter().for_each(|p| match p {
                P2p::Send { buf, .. } => input(buf),
                P2p::Recv { buf, .. } => output(buf),
            }),
            Op::AllReduceRmsNorm(f) => {
                input(&f.x);
                input(&f.gamma);
                output(&f.residual);
                output(&f.out);
                f.scales.iter().for_each(&mut output);
            }
            Op::MoeDispatch(m) => {
                if let Some(s) = &m.send {
                    input(&s.tokens);
                    s.scales.iter().for_each(&mut input);
                    input(&s.topk_idx);
                }
                if let Some(r) = &m.recv {
                    output(&r.tokens);
                    r.scales.iter().for_each(&mut output);
                    output(&r.counts);
                    output(&r.src);
                }
            }
            Op::MoeCombine(m) => {
                if let Some(s) = &m.send {
                    input(&s.expert_out);
                    input(&s.src);
                    input(&s.counts);
                }
                if let Some(r) = &m.recv {
                    input(&r.topk_idx);
                    input(&r.topk_weights);
                    output(&r.out);
                }
            }
        }
    }

    /// Visits every output buffer (also in-place ones), for writing, in `for_each_buffer`'s
    /// order.
    pub(crate) fn for_each_output_mut(&mut self, output: &mut dyn FnMut(&mut BufMut<'_>)) {
        match self {
            Op::AllReduce { buf, .. } | Op::Reduce { buf, .. } | Op::Broadcast { buf, .. } => output(buf),
            Op::AllGather { outputs, .. } | Op::AllToAll { outputs, .. } => outputs.iter_mut().for_each(output),
            Op::ReduceScatter { output: o, .. } | Op::Scatter { output: o, .. } => output(o),
            Op::Gather { outputs, .. } => outputs.iter_mut().flatten().for_each(output),
            Op::Barrier => {}
            Op::Batch(v) => v.iter_mut().for_each(|p| {
                if let P2p::Recv { buf, .. } = p {
                    output(buf)
                }
            }),
            Op::AllReduceRmsNorm(f) => {
                output(&mut f.residual);
                output(&mut f.out);
                f.scales.iter_mut().for_each(output);
            }
            Op::MoeDispatch(m) => {
                if let Some(r) = &mut m.recv {
                    output(&mut r.tokens);
                    r.scales.iter_mut().for_each(&mut *output);
                    output(&mut r.counts);
                    output(&mut r.src);
                }
            }
            Op::MoeCombine(m) => {
                if let Some(r) = &mut m.recv {
                    output(&mut r.out);
                }
            }
        }
    }

    /// Makes every host output hold valid values of its element type again, whatever bytes
    /// the backend (or a peer through it) left there: `bool` bytes other than 0 or 1 become 1
    /// (see [`Element`](crate::Element)). Device buffers are left as they are.
    pub(crate) fn normalise_outputs(&mut self) {
        self.for_each_output_mut(&mut |b| {
            if b.dtype() == DType::Bool && b.location() == Location::Host {
                crate::contracts::dtype::normalise(b.dtype(), b.host_bytes_mut());
            }
        });
    }

    /// Checks everything that can be checked locally: ranks, part counts, dtypes, reduce ops
    /// and this rank's own sizes. Cross-rank consistency is checked by the backend's protocol.
    pub fn validate(&self, rank: usize, size: usize) -> Result<()> {
        let name = self.name();
        let check_rank = |r: usize| {
            if r < size {
                Ok(())
            } else {
                Err(Error::InvalidRank {
                    op: name,
                    rank: r,
                    size,
                })
            }
        };
        // A per-rank list: one part per rank, all of `dtype`, our own part of `own` elements.
        // Looked at in place, and generic over the list (no dynamic call per part): this runs
        // on every call.
        fn per_rank(
            (name, rank, size): (&'static str, usize, usize),
            what: &str,
            parts: impl ExactSizeIterator<Item = (DType, usize)>,
            dtype: DType,
            own: usize,
        ) -> Result<()> {
            if parts.len() != size {
                return Err(Error::SizeMismatch {
                    op: name,
                    what: format!("number of {what}"),
                    expected: size,
                    actual: parts.len(),
                });
            }
            let mut own_count = 0;
            for (r, (d, count)) in parts.enumerate() {
                if d != dtype {
                    return Err(Error::DTypeMismatch {
                        op: name,
                        expected: dtype.name(),
                        actual: d.name(),
                    });
                }
                if r == rank {
                    own_count = count;
                }
            }
            if own_count != own {
                return Err(Error::SizeMismatch {
                    op: name,
                    what: format!("{what}[{rank}] (own slot)"),
                    expected: own,
                    actual: own_count,
                });
            }
            Ok(())
        }
        let call = (name, rank, size);
        fn shape<'s>(v: &'s [Buf<'_>]) -> impl ExactSizeIterator<Item = (DType, usize)> + 's {
            v.iter().map(|b| (b.dtype(), b.count()))
        }
        fn shape_mut<'s>(v: &'s [BufMut<'_>]) -> impl ExactSizeIterator<Item = (DType, usize)> + 's {
            v.iter().map(|b| (b.dtype(), b.count()))
        }
        // This rank's own part is looked up below: a rank outside the world has none.
        check_rank(rank)?;
        match self {
            Op::AllReduce { buf, op } => op.check(name, buf.dtype()),
            Op::Reduce { buf, op, root } => {
                check_rank(*root)?;
                op.check(name, buf.dtype())
            }
            Op::Broadcast { root, .. } => check_rank(*root),
            Op::AllGather { input, outputs } => {
                per_rank(call, "outputs", shape_mut(outputs), input.dtype(), input.count())
            }
            Op::ReduceScatter { inputs, output, op } => {
                per_rank(call, "inputs", shape(inputs), output.dtype(), output.count())?;
                op.check(name, output.dtype())
            }
            Op::AllToAll { inputs, outputs } => {
                let dtype = inputs.first().map_or(DType::U8, |b| b.dtype());
                let own = inputs.get(rank).map_or(0, |b| b.count());
                per_rank(call, "inputs", shape(inputs), dtype, own)?;
                per_rank(call, "outputs", shape_mut(outputs), dtype, own)
            }
            Op::Scatter { inputs, output, root } => {
                check_rank(*root)?;
                match (inputs, rank == *root) {
                    (Some(inputs), true) => per_rank(call, "inputs", shape(inputs), output.dtype(), output.count()),
                    (None, true) => Err(Error::invalid(name, "the root must pass the input buffer")),
                    (_, false) => Ok(()),
                }
            }
            Op::Gather { input, outputs, root } => {
                check_rank(*root)?;
                match (outputs, rank == *root) {
                    (Some(outputs), true) => {
                        per_rank(call, "outputs", shape_mut(outputs), input.dtype(), input.count())
                    }
                    (None, true) => Err(Error::invalid(name, "the root must pass the output buffer")),
                    (_, false) => Ok(()),
                }
            }
            Op::Barrier => Ok(()),
            Op::Batch(v) => v.iter().try_for_each(|p| match p {
                P2p::Send { peer, .. } | P2p::Recv { peer, .. } => check_rank(*peer),
            }),
            Op::AllReduceRmsNorm(f) => f.validate(),
            Op::MoeDispatch(m) => m.validate(size),
            Op::MoeCombine(m) => m.validate(size),
        }
    }
}
