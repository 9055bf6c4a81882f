//! The collective vocabulary, written once: [`Collectives`] is implemented by [`Comm`]
//! (synchronous: each call returns when done) and by `&Scope` (asynchronous: each call returns a
//! [`ScopedWork`]). Both check the same arguments and build the same [`Op`].

use crate::buffer::{InputBuffer, OutputBuffer};
use crate::comm::Comm;
use crate::contracts::dtype::ReduceOp;
use crate::contracts::error::{Error, Result};
use crate::contracts::fp8::F8E4M3;
use crate::contracts::inference::{MoeShape, RmsNormFusion};
use crate::contracts::ops::{Op, P2p};
use crate::contracts::options::OpOptions;
use crate::inference::{Combine, Dispatch};
use crate::work::{Scope, ScopedWork};

/// Every collective and point-to-point call, for [`Comm`] (synchronous), `&Scope`
/// (asynchronous, see [`Comm::scope`]) and [`WithOptions`] (a per-operation timeout or hints).
///
/// Buffers are host slices, vectors and arrays of an [`Element`](crate::Element) type, or
/// views of GPU memory ([`DeviceSlice`](crate::device::DeviceSlice) /
/// [`DeviceSliceMut`](crate::device::DeviceSliceMut)). Every call checks its arguments
/// locally before anything moves (`Error::SizeMismatch`, `InvalidRank`, `UnsupportedReduce`,
/// ...) and is collective: every rank of the communicator makes the same calls in the same
/// order, each with its own buffers. Reductions combine in rank order, so every rank gets
/// bit-identical results.
///
/// ```
/// use ferrocomm::prelude::*;
///
/// // Four ranks as threads of this process.
/// let comms = Comm::new_group("cpu", &[Device::Cpu; 4], "sums", CommOptions::from_env()?)?;
/// let rank_main = |c: &Comm| -> ferrocomm::Result<()> {
///     let (rank, size) = (c.rank() as f32, c.size());
///
///     // all_reduce: in place, every rank gets the sum 1 + 2 + 3 + 4.
///     let mut x = vec![rank + 1.0; 1024];
///     c.all_reduce(&mut x, ReduceOp::Sum)?;
///     assert!(x.iter().all(|&v| v == 10.0));
///
///     // reduce_scatter: rank r gets block r of the sum over ranks.
///     let input: Vec<f32> = (0..2 * size).map(|i| i as f32 * (rank + 1.0)).collect();
///     let mut mine = [0f32; 2];
///     c.reduce_scatter(&mut mine, &input, ReduceOp::Sum)?;
///     let r = c.rank() as f32;
///     assert_eq!(mine, [2.0 * r * 10.0, (2.0 * r + 1.0) * 10.0]);
///
///     // broadcast from rank 2, with a per-operation timeout.
///     let mut b = [rank as u8; 3];
///     c.with_options(OpOptions::new().timeout(std::time::Duration::from_secs(30)))
///         .broadcast(&mut b, 2)?;
///     assert_eq!(b, [2, 2, 2]);
///     Ok(())
/// };
/// std::thread::scope(|s| {
///     let ranks: Vec<_> = comms.iter().map(|c| s.spawn(move || rank_main(c))).collect();
///     ranks.into_iter().try_for_each(|h| h.join().unwrap())
/// })?;
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub trait Collectives<'a>: Sized {
    /// `()` for synchronous calls, [`ScopedWork`] for scoped asynchronous ones.
    type Output;

    /// The communicator the calls go to.
    fn comm(&self) -> &Comm;
    /// Issues a built operation.
    fn issue(&self, op: Op<'a>, opts: &OpOptions) -> Result<Self::Output>;
    /// Options used by the convenience calls below.
    fn op_options(&self) -> OpOptions {
        OpOptions::default()
    }

    /// The same calls with a per-operation timeout or hints; the hints override the
    /// communicator's (`CommOptions::hints`) key by key.
    fn with_options(&self, opts: OpOptions) -> WithOptions<'_, Self> {
        WithOptions { inner: self, opts }
    }

    /// Issues a built operation with [`op_options`](Self::op_options): what every call below
    /// ends in.
    fn call(&self, op: Op<'a>) -> Result<Self::Output> {
        self.issue(op, &self.op_options())
    }

    /// Reduces `buf` across ranks in place; every rank gets the result.
    fn all_reduce<B: OutputBuffer<'a>>(&self, buf: B, op: ReduceOp) -> Result<Self::Output> {
        self.call(Op::AllReduce {
            buf: buf.into_buf_mut(),
            op,
        })
    }

    /// Reduces into `root`'s `buf`; other ranks' buffers are unchanged.
    fn reduce<B: OutputBuffer<'a>>(&self, buf: B, op: ReduceOp, root: usize) -> Result<Self::Output> {
        self.call(Op::Reduce {
            buf: buf.into_buf_mut(),
            op,
            root,
        })
    }

    /// Copies `root`'s `buf` to every rank's `buf`.
    fn broadcast<B: OutputBuffer<'a>>(&self, buf: B, root: usize) -> Result<Self::Output> {
        self.call(Op::Broadcast {
            buf: buf.into_buf_mut(),
            root,
        })
    }

    /// `output` (size × input) receives every rank's `input` in rank order.
    fn all_gather<O, I>(&self, output: O, input: I) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        self.call(Op::AllGather {
            input: input.into_buf(),
            outputs: output.into_buf_mut().split_equal("all_gather", self.comm().size())?,
        })
    }

    /// `outputs[r]` receives rank r's `input`.
    fn all_gather_list<O, I>(&self, outputs: Vec<O>, input: I) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        self.call(Op::AllGather {
            input: input.into_buf(),
            outputs: outputs.into_iter().map(O::into_buf_mut).collect(),
        })
    }

    /// Rank r contributes `counts[r]` elements; `output` holds them all in rank order.
    fn all_gather_v<O, I>(&self, output: O, input: I, counts: &[usize]) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        self.call(Op::AllGather {
            input: input.into_buf(),
            outputs: output.into_buf_mut().split("all_gather_v", counts)?,
        })
    }

    /// `input` (size × output) is reduced across ranks; rank r gets block r.
    fn reduce_scatter<O, I>(&self, output: O, input: I, op: ReduceOp) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        self.call(Op::ReduceScatter {
            inputs: input.into_buf().split_equal("reduce_scatter", self.comm().size())?,
            output: output.into_buf_mut(),
            op,
        })
    }

    /// Rank r gets the reduction of every rank's `inputs[r]`.
    fn reduce_scatter_list<O, I>(&self, output: O, inputs: Vec<I>, op: ReduceOp) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        self.call(Op::ReduceScatter {
            inputs: inputs.into_iter().map(I::into_buf).collect(),
            output: output.into_buf_mut(),
            op,
        })
    }

    /// Like `reduce_scatter` with block r of `counts[r]` elements.
    fn reduce_scatter_v<O, I>(&self, output: O, input: I, counts: &[usize], op: ReduceOp) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        self.call(Op::ReduceScatter {
            inputs: input.into_buf().split("reduce_scatter_v", counts)?,
            output: output.into_buf_mut(),
            op,
        })
    }

    /// Block r of `input` goes to rank r; block r of `output` comes from rank r (equal blocks).
    fn all_to_all<O, I>(&self, output: O, input: I) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        let size = self.comm().size();
        let (input, output) = (input.into_buf(), output.into_buf_mut());
        self.call(Op::AllToAll {
            inputs: input.split_equal("all_to_all", size)?,
            outputs: output.split_equal("all_to_all", size)?,
        })
    }

    /// `inputs[r]` goes to rank r; `outputs[r]` receives rank r's `inputs[rank]` (one buffer
    /// per rank each way, of any sizes that match pairwise).
    fn all_to_all_list<O, I>(&self, outputs: Vec<O>, inputs: Vec<I>) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        self.call(Op::AllToAll {
            inputs: inputs.into_iter().map(I::into_buf).collect(),
            outputs: outputs.into_iter().map(O::into_buf_mut).collect(),
        })
    }

    /// Block sizes per peer: `input_counts[r]` elements go to rank r, `output_counts[r]` come
    /// from it.
    fn all_to_all_v<O, I>(
        &self,
        output: O,
        input: I,
        output_counts: &[usize],
        input_counts: &[usize],
    ) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        self.call(Op::AllToAll {
            inputs: input.into_buf().split("all_to_all_v", input_counts)?,
            outputs: output.into_buf_mut().split("all_to_all_v", output_counts)?,
        })
    }

    /// `root`'s `input` (size × output, `None` elsewhere) is split; rank r gets block r.
    fn scatter<O, I>(&self, output: O, input: Option<I>, root: usize) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        let inputs = match input {
            Some(i) if self.comm().rank() == root => Some(i.into_buf().split_equal("scatter", self.comm().size())?),
            _ => None,
        };
        self.call(Op::Scatter {
            inputs,
            output: output.into_buf_mut(),
            root,
        })
    }

    /// Every rank's `input` lands in block r of `root`'s `output` (`None` elsewhere).
    fn gather<O, I>(&self, output: Option<O>, input: I, root: usize) -> Result<Self::Output>
    where
        O: OutputBuffer<'a>,
        I: InputBuffer<'a, Elem = O::Elem>,
    {
        let outputs = match output {
            Some(o) if self.comm().rank() == root => Some(o.into_buf_mut().split_equal("gather", self.comm().size())?),
            _ => None,
        };
        self.call(Op::Gather {
            input: input.into_buf(),
            outputs,
            root,
        })
    }

    /// The end of a tensor-parallel layer in one operation (TensorRT-LLM's and FlashInfer's
    /// all_reduce fusion `RESIDUAL_RMS_NORM`): `residual += Σ_ranks x`, then
    /// `out = rmsnorm(residual) * gamma` with `eps`. `x`, `residual` and `out` are
    /// `[tokens, hidden]`, `gamma` is `[hidden]`, all of one type (f32, f16 or bf16). Sums run
    /// in f32, over ranks in rank order, so every rank gets the same bits; the norm reads the
    /// f32 sum (see [`RmsNormFusion`](crate::RmsNormFusion)). The hint `algorithm` =
    /// `oneshot` / `twoshot` overrides the choice by size. On the CPU backend (and where the
    /// device backend runs it on the CPU engine) a rank whose arguments fail its checks still
    /// tells the others: they fail at once with `Error::InvalidArgument` naming it and its
    /// reason, and the communicator stays usable (so do MoE dispatch and combine, on every
    /// backend that runs them).
    ///
    /// ```
    /// use ferrocomm::prelude::*;
    ///
    /// let comms = Comm::new_group("cpu", &[Device::Cpu; 2], "tp", CommOptions::from_env()?)?;
    /// std::thread::scope(|s| {
    ///     for c in &comms {
    ///         s.spawn(move || -> ferrocomm::Result<()> {
    ///             let hidden = 4;
    ///             let x = vec![1.0f32; 2 * hidden]; // this rank's partial sums, 2 tokens
    ///             let mut residual = vec![1.0f32; 2 * hidden];
    ///             let (gamma, mut y) = (vec![2.0f32; hidden], vec![0f32; 2 * hidden]);
    ///             c.all_reduce_residual_rmsnorm(&x, &mut residual, &gamma, &mut y, 0.0)?;
    ///             assert_eq!(residual, vec![3.0; 2 * hidden]); // 1 + 1 (two ranks) + 1
    ///             assert_eq!(y, vec![2.0; 2 * hidden]); // 3 / rms(3) * 2
    ///             Ok(())
    ///         });
    ///     }
    /// });
    /// # Ok::<(), ferrocomm::Error>(())
    /// ```
    fn all_reduce_residual_rmsnorm<X, R, G, O>(
        &self,
        x: X,
        residual: R,
        gamma: G,
        out: O,
        eps: f32,
    ) -> Result<Self::Output>
    where
        X: InputBuffer<'a>,
        R: OutputBuffer<'a, Elem = X::Elem>,
        G: InputBuffer<'a, Elem = X::Elem>,
        O: OutputBuffer<'a, Elem = X::Elem>,
    {
        let f = RmsNormFusion::new(
            x.into_buf(),
            residual.into_buf_mut(),
            gamma.into_buf(),
            out.into_buf_mut(),
            eps,
        );
        self.call(Op::AllReduceRmsNorm(f))
    }

    /// [`all_reduce_residual_rmsnorm`](Self::all_reduce_residual_rmsnorm) with the output
    /// quantised to fp8 e4m3 (`RESIDUAL_RMS_NORM_QUANT_FP8`): each token's row is divided by
    /// its scale `max |y| / 448`, written to `scales` (one f32 per token), so `y ≈ out * scale`.
    fn all_reduce_residual_rmsnorm_fp8<X, R, G, O, S>(
        &self,
        x: X,
        residual: R,
        gamma: G,
        out: O,
        scales: S,
        eps: f32,
    ) -> Result<Self::Output>
    where
        X: InputBuffer<'a>,
        R: OutputBuffer<'a, Elem = X::Elem>,
        G: InputBuffer<'a, Elem = X::Elem>,
        O: OutputBuffer<'a, Elem = F8E4M3>,
        S: OutputBuffer<'a, Elem = f32>,
    {
        let f = RmsNormFusion::new(
            x.into_buf(),
            residual.into_buf_mut(),
            gamma.into_buf(),
            out.into_buf_mut(),
            eps,
        )
        .with_scales(scales.into_buf_mut());
        self.call(Op::AllReduceRmsNorm(f))
    }

    /// Mixture-of-experts dispatch (DeepEP's `dispatch`): each token goes once to every rank
    /// that owns one of its `topk` experts, and lands in a `[local experts, capacity, hidden]`
    /// buffer in (source rank, token, k) order, with counts and each row's source. Either half
    /// may run alone: a [`Dispatch::send`] without `recv` returns once the rows are on their
    /// way (on the CPU backend: there), a later [`Dispatch::recv_only`] receives them, and the
    /// rank computes in between. More rows for an expert than `shape.capacity` is
    /// `Error::CapacityExceeded` on the receiving rank (the counts say how many came). A rank
    /// that refuses its send half (an expert id out of range, a buffer of the wrong size) fails
    /// every rank at once (the others with `Error::InvalidArgument` naming it; on the device
    /// backend's kernels, whose send half alone does not wait for peers, the others' receive
    /// half); nothing is written and the communicator stays usable. Ranks must call with one
    /// `shape` and element type: otherwise every rank gets `Error::Mismatch` naming the field.
    fn moe_dispatch(&self, shape: MoeShape, buffers: Dispatch<'a>) -> Result<Self::Output> {
        self.call(Op::MoeDispatch(buffers.into_op(shape)))
    }

    /// Mixture-of-experts combine (DeepEP's `combine`): each expert row goes back to its
    /// token's rank, and `out[t] = Σ_k weight[t, k] * row(t, k)` in f32, k in order (the same
    /// bits on every run). A token whose row did not come back (its dispatch exceeded an
    /// expert's capacity) or whose expert id is out of range keeps its old `out` bits, and the
    /// call fails with `Error::InvalidArgument` saying why (of lost rows, the first in token
    /// order); every other token is combined, to the same bits on every backend.
    fn moe_combine(&self, shape: MoeShape, buffers: Combine<'a>) -> Result<Self::Output> {
        self.call(Op::MoeCombine(buffers.into_op(shape)))
    }

    /// Returns once every rank has entered it (on device buffers' backends, also after the
    /// current stream's earlier work).
    fn barrier(&self) -> Result<Self::Output> {
        self.call(Op::Barrier)
    }

    /// Sends `buf` to `peer`, which must call `recv` (or a batch recv) for it. It may return
    /// only once the peer has taken the message (a large one between ranks of one host waits
    /// for that where it goes by reference, `FERROCOMM_SHM_PULL_BYTES`): two ranks that send to
    /// each other put both sends and receives in one `batch()`.
    fn send<I: InputBuffer<'a>>(&self, buf: I, peer: usize) -> Result<Self::Output> {
        self.call(Op::Batch(vec![P2p::Send {
            buf: buf.into_buf(),
            peer,
        }]))
    }

    /// Receives into `buf` from `peer`, which must `send` (or batch-send) exactly `buf`'s length
    /// (on the CPU engine a message of another length is `Error::Mismatch` at the receiver).
    fn recv<O: OutputBuffer<'a>>(&self, buf: O, peer: usize) -> Result<Self::Output> {
        self.call(Op::Batch(vec![P2p::Recv {
            buf: buf.into_buf_mut(),
            peer,
        }]))
    }

    /// Point-to-point calls that run together (in any order without deadlock) on `issue()`.
    ///
    /// ```
    /// use ferrocomm::prelude::*;
    ///
    /// // A ring shift: every rank sends to its right neighbour and receives from its left one.
    /// let comms = Comm::new_group("cpu", &[Device::Cpu; 3], "ring", CommOptions::from_env()?)?;
    /// let rank_main = |c: &Comm| -> ferrocomm::Result<()> {
    ///     let (rank, n) = (c.rank(), c.size());
    ///     let mine = [rank as i64; 4];
    ///     let mut from_left = [-1i64; 4];
    ///     c.batch().send(&mine, (rank + 1) % n).recv(&mut from_left, (rank + n - 1) % n).issue()?;
    ///     assert_eq!(from_left, [((rank + n - 1) % n) as i64; 4]);
    ///     Ok(())
    /// };
    /// std::thread::scope(|s| {
    ///     let ranks: Vec<_> = comms.iter().map(|c| s.spawn(move || rank_main(c))).collect();
    ///     ranks.into_iter().try_for_each(|h| h.join().unwrap())
    /// })?;
    /// # Ok::<(), ferrocomm::Error>(())
    /// ```
    fn batch(&self) -> Batch<'a, '_, Self> {
        Batch {
            to: self,
            // Room for a send and a receive, the most common batch, without a regrowth.
            list: Vec::with_capacity(2),
        }
    }
}

/// See [`Collectives::batch`].
#[must_use = "a batch does nothing until issued"]
pub struct Batch<'a, 'c, C: Collectives<'a>> {
    to: &'c C,
    list: Vec<P2p<'a>>,
}

impl<'a, C: Collectives<'a>> Batch<'a, '_, C> {
    /// Adds a send of `buf` to `peer`.
    pub fn send<I: InputBuffer<'a>>(mut self, buf: I, peer: usize) -> Self {
        self.list.push(P2p::Send {
            buf: buf.into_buf(),
            peer,
        });
        self
    }
    /// Adds a receive into `buf` from `peer`.
    pub fn recv<O: OutputBuffer<'a>>(mut self, buf: O, peer: usize) -> Self {
        self.list.push(P2p::Recv {
            buf: buf.into_buf_mut(),
            peer,
        });
        self
    }
    /// Runs every transfer of the batch together: `()` once all are done on a `Comm`, one
    /// [`ScopedWork`] for the whole batch in a scope.
    pub fn issue(self) -> Result<C::Output> {
        self.to.call(Op::Batch(self.list))
    }
}

/// See [`Collectives::with_options`].
pub struct WithOptions<'c, C> {
    inner: &'c C,
    opts: OpOptions,
}

impl<'a, C: Collectives<'a>> Collectives<'a> for WithOptions<'_, C> {
    type Output = C::Output;
    fn comm(&self) -> &Comm {
        self.inner.comm()
    }
    fn issue(&self, op: Op<'a>, opts: &OpOptions) -> Result<C::Output> {
        self.inner.issue(op, opts)
    }
    fn op_options(&self) -> OpOptions {
        self.opts.clone()
    }
    fn call(&self, op: Op<'a>) -> Result<C::Output> {
        // Borrowed, not cloned per call.
        self.inner.issue(op, &self.opts)
    }
}

impl<'a> Collectives<'a> for Comm {
    type Output = ();
    fn comm(&self) -> &Comm {
        self
    }
    fn issue(&self, op: Op<'a>, opts: &OpOptions) -> Result<()> {
        self.run(op, opts)
    }
    fn call(&self, op: Op<'a>) -> Result<()> {
        // The default options, without building (and dropping) a value of them per call.
        static DEFAULT: OpOptions = OpOptions {
            timeout: None,
            hints: std::collections::BTreeMap::new(),
        };
        self.run(op, &DEFAULT)
    }
}

impl<'scope, 'env> Collectives<'scope> for &'scope Scope<'scope, 'env> {
    type Output = ScopedWork<'scope>;
    fn comm(&self) -> &Comm {
        self.comm
    }
    fn issue(&self, op: Op<'scope>, opts: &OpOptions) -> Result<ScopedWork<'scope>> {
        self.start(op, opts)
    }
}

/// MoE's normal mode, beside the collectives it is made of.
impl Comm {
    /// MoE's normal mode: how many rows each expert receives in a dispatch of `topk_idx`
    /// (`[T, topk]` expert ids, -1 for none) from every rank, summed over ranks (collective: an
    /// all_reduce of one count per expert). Every rank gets the same counts, so every rank can
    /// size its receive buffers with the same `MoeShape::capacity`, the largest count, before
    /// the dispatch; the low-latency mode instead fixes the capacity up front and keeps the
    /// counts on the device.
    ///
    /// ```
    /// use ferrocomm::prelude::*;
    /// let comms = Comm::new_group("cpu", &[Device::Cpu; 2], "moe-counts", CommOptions::from_env()?)?;
    /// std::thread::scope(|s| {
    ///     for c in &comms {
    ///         s.spawn(move || {
    ///             let counts = c.moe_expert_counts(4, &[0i32, 3, 3, -1]).unwrap();
    ///             assert_eq!(counts, vec![2, 0, 0, 4]); // two ranks' rows per expert
    ///         });
    ///     }
    /// });
    /// # Ok::<(), ferrocomm::Error>(())
    /// ```
    pub fn moe_expert_counts<T: Copy + Into<i64>>(&self, experts: usize, topk_idx: &[T]) -> Result<Vec<usize>> {
        let mut counts = vec![0u64; experts];
        for (i, &x) in topk_idx.iter().enumerate() {
            match x.into() {
                -1 => {}
                x if (0..experts as i64).contains(&x) => counts[x as usize] += 1,
                x => {
                    return Err(Error::InvalidArgument {
                        op: "moe_expert_counts",
                        reason: format!("topk_idx[{i}] = {x} is not an expert (0..{experts}) or -1"),
                    })
                }
            }
        }
        self.all_reduce(&mut counts, ReduceOp::Sum)?;
        Ok(counts.into_iter().map(|c| c as usize).collect())
    }
}
