//! The owned form of every collective and point-to-point call: [`Comm::owned`] takes the
//! buffers by value ([`OwnedBuffer`]: `Vec<T>`, `Box<[T]>`, cudarc `CudaSlice<T>`) and returns
//! a [`Work`] that hands them back on `wait` (torchcomms' `async_op=True`). Each call is
//! [`Comm::start`] around the borrowed call of the same name, so the checks, the errors and the
//! results are the borrowed call's. MoE dispatch and combine, whose buffers are structs of
//! their own, go through [`Comm::start`] directly.

use crate::buffer::{InputBuffer, OutputBuffer, OwnedBuffer};
use crate::collectives::Collectives;
use crate::comm::Comm;
use crate::contracts::dtype::ReduceOp;
use crate::contracts::error::Result;
use crate::contracts::fp8::F8E4M3;
use crate::contracts::options::OpOptions;
use crate::owned_work::{Starter, Work};

/// The calls of [`Collectives`] on owned buffers, each returning a [`Work`]; made by
/// [`Comm::owned`]. Outputs and inputs come back from [`Work::wait`] in the order the call
/// takes them.
///
/// ```
/// use ferrocomm::prelude::*;
///
/// // A DDP-style step: start the gradient all_reduce, compute, then wait at the optimizer.
/// let comms = Comm::new_group("cpu", &[Device::Cpu; 2], "owned-calls", CommOptions::from_env()?)?;
/// std::thread::scope(|s| {
///     for c in &comms {
///         s.spawn(move || -> ferrocomm::Result<()> {
///             let grads = vec![c.rank() as f32 + 1.0; 1024];
///             let work = c.owned().all_reduce(grads, ReduceOp::Avg)?;
///             let other = (0..1000u64).sum::<u64>(); // computation overlapping the all_reduce
///             let grads = work.wait()?;
///             assert!(grads.iter().all(|&g| g == 1.5) && other > 0);
///
///             // Every form: all_gather hands back (output, input).
///             let (all, _mine) = c.owned().all_gather(vec![0u8; 2], vec![c.rank() as u8])?.wait()?;
///             assert_eq!(all, [0, 1]);
///             Ok(())
///         });
///     }
/// });
/// # Ok::<(), ferrocomm::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Owned<'c> {
    comm: &'c Comm,
    opts: OpOptions,
}

/// Owned asynchronous calls.
impl Comm {
    /// The owned form of every call: see [`Owned`].
    pub fn owned(&self) -> Owned<'_> {
        Owned {
            comm: self,
            opts: OpOptions::default(),
        }
    }
}

impl<'c> Owned<'c> {
    /// The same calls with a per-operation timeout or hints.
    pub fn with_options(self, opts: OpOptions) -> Self {
        Owned { opts, ..self }
    }

    fn start<B, F>(&self, buffers: B, issue: F) -> Result<Work<B>>
    where
        B: Send + 'static,
        F: for<'b> FnOnce(&Starter<'b>, &'b mut B) -> Result<()>,
    {
        self.comm.start_with(&self.opts, buffers, issue)
    }

    /// [`Collectives::all_reduce`] on an owned buffer.
    pub fn all_reduce<B: OwnedBuffer>(&self, buf: B, op: ReduceOp) -> Result<Work<B>> {
        self.start(buf, move |s, b| s.all_reduce(s.output(b)?, op))
    }

    /// [`Collectives::reduce`] on an owned buffer.
    pub fn reduce<B: OwnedBuffer>(&self, buf: B, op: ReduceOp, root: usize) -> Result<Work<B>> {
        self.start(buf, move |s, b| s.reduce(s.output(b)?, op, root))
    }

    /// [`Collectives::broadcast`] on an owned buffer.
    pub fn broadcast<B: OwnedBuffer>(&self, buf: B, root: usize) -> Result<Work<B>> {
        self.start(buf, move |s, b| s.broadcast(s.output(b)?, root))
    }

    /// [`Collectives::all_gather`]; `wait` hands back `(output, input)`.
    pub fn all_gather<O, I>(&self, output: O, input: I) -> Result<Work<(O, I)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        self.start((output, input), |s, (o, i)| s.all_gather(s.output(o)?, s.input(&*i)?))
    }

    /// [`Collectives::all_gather_list`]; `wait` hands back `(outputs, input)`.
    pub fn all_gather_list<O, I>(&self, outputs: Vec<O>, input: I) -> Result<Work<(Vec<O>, I)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        self.start((outputs, input), |s, (o, i)| {
            s.all_gather_list(outs(s, o)?, s.input(&*i)?)
        })
    }

    /// [`Collectives::all_gather_v`]; `wait` hands back `(output, input)`.
    pub fn all_gather_v<O, I>(&self, output: O, input: I, counts: &[usize]) -> Result<Work<(O, I)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        let counts = counts.to_vec();
        self.start((output, input), move |s, (o, i)| {
            s.all_gather_v(s.output(o)?, s.input(&*i)?, &counts)
        })
    }

    /// [`Collectives::reduce_scatter`]; `wait` hands back `(output, input)`.
    pub fn reduce_scatter<O, I>(&self, output: O, input: I, op: ReduceOp) -> Result<Work<(O, I)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        self.start((output, input), move |s, (o, i)| {
            s.reduce_scatter(s.output(o)?, s.input(&*i)?, op)
        })
    }

    /// [`Collectives::reduce_scatter_list`]; `wait` hands back `(output, inputs)`.
    pub fn reduce_scatter_list<O, I>(&self, output: O, inputs: Vec<I>, op: ReduceOp) -> Result<Work<(O, Vec<I>)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        self.start((output, inputs), move |s, (o, i)| {
            s.reduce_scatter_list(s.output(o)?, ins(s, i)?, op)
        })
    }

    /// [`Collectives::reduce_scatter_v`]; `wait` hands back `(output, input)`.
    pub fn reduce_scatter_v<O, I>(&self, output: O, input: I, counts: &[usize], op: ReduceOp) -> Result<Work<(O, I)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        let counts = counts.to_vec();
        self.start((output, input), move |s, (o, i)| {
            s.reduce_scatter_v(s.output(o)?, s.input(&*i)?, &counts, op)
        })
    }

    /// [`Collectives::all_to_all`]; `wait` hands back `(output, input)`.
    pub fn all_to_all<O, I>(&self, output: O, input: I) -> Result<Work<(O, I)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        self.start((output, input), |s, (o, i)| s.all_to_all(s.output(o)?, s.input(&*i)?))
    }

    /// [`Collectives::all_to_all_list`]; `wait` hands back `(outputs, inputs)`.
    pub fn all_to_all_list<O, I>(&self, outputs: Vec<O>, inputs: Vec<I>) -> Result<Work<(Vec<O>, Vec<I>)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        self.start((outputs, inputs), |s, (o, i)| {
            s.all_to_all_list(outs(s, o)?, ins(s, i)?)
        })
    }

    /// [`Collectives::all_to_all_v`]; `wait` hands back `(output, input)`.
    pub fn all_to_all_v<O, I>(
        &self,
        output: O,
        input: I,
        output_counts: &[usize],
        input_counts: &[usize],
    ) -> Result<Work<(O, I)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        let (oc, ic) = (output_counts.to_vec(), input_counts.to_vec());
        self.start((output, input), move |s, (o, i)| {
            s.all_to_all_v(s.output(o)?, s.input(&*i)?, &oc, &ic)
        })
    }

    /// [`Collectives::scatter`]; `wait` hands back `(output, input)`.
    pub fn scatter<O, I>(&self, output: O, input: Option<I>, root: usize) -> Result<Work<(O, Option<I>)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        self.start((output, input), move |s, (o, i)| {
            let i = i.as_ref().map(|i| s.input(i)).transpose()?;
            s.scatter(s.output(o)?, i, root)
        })
    }

    /// [`Collectives::gather`]; `wait` hands back `(output, input)`.
    pub fn gather<O, I>(&self, output: Option<O>, input: I, root: usize) -> Result<Work<(Option<O>, I)>>
    where
        O: OwnedBuffer,
        I: OwnedBuffer<Elem = O::Elem>,
    {
        self.start((output, input), move |s, (o, i)| {
            let o = o.as_mut().map(|o| s.output(o)).transpose()?;
            s.gather(o, s.input(&*i)?, root)
        })
    }

    /// [`Collectives::all_reduce_residual_rmsnorm`]; `wait` hands back
    /// `(x, residual, gamma, out)`.
    pub fn all_reduce_residual_rmsnorm<X, R, G, O>(
        &self,
        x: X,
        residual: R,
        gamma: G,
        out: O,
        eps: f32,
    ) -> Result<Work<(X, R, G, O)>>
    where
        X: OwnedBuffer,
        R: OwnedBuffer<Elem = X::Elem>,
        G: OwnedBuffer<Elem = X::Elem>,
        O: OwnedBuffer<Elem = X::Elem>,
    {
        self.start((x, residual, gamma, out), move |s, (x, r, g, o)| {
            s.all_reduce_residual_rmsnorm(s.input(&*x)?, s.output(r)?, s.input(&*g)?, s.output(o)?, eps)
        })
    }

    /// [`Collectives::all_reduce_residual_rmsnorm_fp8`]; `wait` hands back
    /// `(x, residual, gamma, out, scales)`.
    #[allow(clippy::type_complexity)] // the five buffers, as the call takes them
    pub fn all_reduce_residual_rmsnorm_fp8<X, R, G, O, S>(
        &self,
        x: X,
        residual: R,
        gamma: G,
        out: O,
        scales: S,
        eps: f32,
    ) -> Result<Work<(X, R, G, O, S)>>
    where
        X: OwnedBuffer,
        R: OwnedBuffer<Elem = X::Elem>,
        G: OwnedBuffer<Elem = X::Elem>,
        O: OwnedBuffer<Elem = F8E4M3>,
        S: OwnedBuffer<Elem = f32>,
    {
        self.start((x, residual, gamma, out, scales), move |s, (x, r, g, o, sc)| {
            s.all_reduce_residual_rmsnorm_fp8(
                s.input(&*x)?,
                s.output(r)?,
                s.input(&*g)?,
                s.output(o)?,
                s.output(sc)?,
                eps,
            )
        })
    }

    /// [`Collectives::barrier`] as a [`Work`] (of no buffers).
    pub fn barrier(&self) -> Result<Work<()>> {
        self.start((), |s, ()| s.barrier())
    }

    /// [`Collectives::send`] of an owned buffer.
    pub fn send<B: OwnedBuffer>(&self, buf: B, peer: usize) -> Result<Work<B>> {
        self.start(buf, move |s, b| s.send(s.input(&*b)?, peer))
    }

    /// [`Collectives::recv`] into an owned buffer.
    pub fn recv<B: OwnedBuffer>(&self, buf: B, peer: usize) -> Result<Work<B>> {
        self.start(buf, move |s, b| s.recv(s.output(b)?, peer))
    }

    /// [`Collectives::batch`] of owned buffers of one type; `wait` hands them back in the order
    /// they were added.
    pub fn batch<B: OwnedBuffer>(&self) -> OwnedBatch<'c, B> {
        OwnedBatch {
            to: self.clone(),
            list: Vec::new(),
            peers: Vec::new(),
        }
    }
}

/// See [`Owned::batch`].
#[must_use = "a batch does nothing until issued"]
pub struct OwnedBatch<'c, B> {
    to: Owned<'c>,
    list: Vec<B>,
    /// Per buffer: whether it is sent, and the peer.
    peers: Vec<(bool, usize)>,
}

impl<B: OwnedBuffer> OwnedBatch<'_, B> {
    /// Adds a send of `buf` to `peer`.
    pub fn send(mut self, buf: B, peer: usize) -> Self {
        self.list.push(buf);
        self.peers.push((true, peer));
        self
    }

    /// Adds a receive into `buf` from `peer`.
    pub fn recv(mut self, buf: B, peer: usize) -> Self {
        self.list.push(buf);
        self.peers.push((false, peer));
        self
    }

    /// Starts every transfer together, as one [`Work`].
    pub fn issue(self) -> Result<Work<Vec<B>>> {
        let peers = self.peers;
        self.to.start(self.list, move |s, bufs| {
            let mut batch = s.batch();
            for (b, &(send, peer)) in bufs.iter_mut().zip(&peers) {
                batch = match send {
                    true => batch.send(s.input(&*b)?, peer),
                    false => batch.recv(s.output(b)?, peer),
                };
            }
            batch.issue()
        })
    }
}

/// Every buffer of a list as an output.
fn outs<'b, B: OwnedBuffer>(s: &Starter<'b>, list: &'b mut [B]) -> Result<Vec<impl OutputBuffer<'b, Elem = B::Elem>>> {
    list.iter_mut().map(|b| s.output(b)).collect()
}

/// Every buffer of a list as an input.
fn ins<'b, B: OwnedBuffer>(s: &Starter<'b>, list: &'b [B]) -> Result<Vec<impl InputBuffer<'b, Elem = B::Elem>>> {
    list.iter().map(|b| s.input(b)).collect()
}
