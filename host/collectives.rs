//! The collective vocabulary, written once: [`Collectives`] is implemented by [`Comm`]
//! (synchronous: each call returns when done) and by `&Scope` (asynchronous: each call returns a
//! [`Work`]). Both check the same arguments and build the same [`Op`].

use crate::comm::Comm;
use crate::dtype::{Element, ReduceOp};
use crate::error::Result;
use crate::ops::{equal_counts, split_counts, split_counts_mut, Buf, BufMut, Op, P2p};
use crate::options::OpOptions;
use crate::work::{Scope, Work};

pub trait Collectives<'a>: Sized {
    /// `()` for synchronous calls, [`Work`] for asynchronous ones.
    type Output;

    /// The communicator the calls go to.
    fn comm(&self) -> &Comm;
    /// Issues a built operation.
    fn issue(&self, op: Op<'a>, opts: &OpOptions) -> Result<Self::Output>;
    /// Options used by the convenience calls below.
    fn op_options(&self) -> OpOptions {
        OpOptions::default()
    }

    /// The same calls with a per-operation timeout or hints.
    fn with_options(&self, opts: OpOptions) -> WithOptions<'_, Self> {
        WithOptions { inner: self, opts }
    }

    fn call(&self, op: Op<'a>) -> Result<Self::Output> {
        self.issue(op, &self.op_options())
    }

    /// Reduces `buf` across ranks in place; every rank gets the result.
    fn all_reduce<T: Element>(&self, buf: &'a mut [T], op: ReduceOp) -> Result<Self::Output> {
        self.call(Op::AllReduce {
            buf: BufMut::new(buf),
            op,
        })
    }

    /// Reduces into `root`'s `buf`; other ranks' buffers are unchanged.
    fn reduce<T: Element>(&self, buf: &'a mut [T], op: ReduceOp, root: usize) -> Result<Self::Output> {
        self.call(Op::Reduce {
            buf: BufMut::new(buf),
            op,
            root,
        })
    }

    /// Copies `root`'s `buf` to every rank's `buf`.
    fn broadcast<T: Element>(&self, buf: &'a mut [T], root: usize) -> Result<Self::Output> {
        self.call(Op::Broadcast {
            buf: BufMut::new(buf),
            root,
        })
    }

    /// `output` (size × input) receives every rank's `input` in rank order.
    fn all_gather<T: Element>(&self, output: &'a mut [T], input: &'a [T]) -> Result<Self::Output> {
        let counts = equal_counts("all_gather", output.len(), self.comm().size())?;
        self.call(Op::AllGather {
            input: Buf::new(input),
            outputs: split_counts_mut("all_gather", output, &counts)?,
        })
    }

    /// `outputs[r]` receives rank r's `input`.
    fn all_gather_list<T: Element>(&self, outputs: Vec<&'a mut [T]>, input: &'a [T]) -> Result<Self::Output> {
        self.call(Op::AllGather {
            input: Buf::new(input),
            outputs: outputs.into_iter().map(BufMut::new).collect(),
        })
    }

    /// Rank r contributes `counts[r]` elements; `output` holds them all in rank order.
    fn all_gather_v<T: Element>(&self, output: &'a mut [T], input: &'a [T], counts: &[usize]) -> Result<Self::Output> {
        self.call(Op::AllGather {
            input: Buf::new(input),
            outputs: split_counts_mut("all_gather_v", output, counts)?,
        })
    }

    /// `input` (size × output) is reduced across ranks; rank r gets block r.
    fn reduce_scatter<T: Element>(&self, output: &'a mut [T], input: &'a [T], op: ReduceOp) -> Result<Self::Output> {
        let counts = equal_counts("reduce_scatter", input.len(), self.comm().size())?;
        self.call(Op::ReduceScatter {
            inputs: split_counts("reduce_scatter", input, &counts)?,
            output: BufMut::new(output),
            op,
        })
    }

    /// Rank r gets the reduction of every rank's `inputs[r]`.
    fn reduce_scatter_list<T: Element>(
        &self,
        output: &'a mut [T],
        inputs: Vec<&'a [T]>,
        op: ReduceOp,
    ) -> Result<Self::Output> {
        self.call(Op::ReduceScatter {
            inputs: inputs.into_iter().map(Buf::new).collect(),
            output: BufMut::new(output),
            op,
        })
    }

    /// Like `reduce_scatter` with block r of `counts[r]` elements.
    fn reduce_scatter_v<T: Element>(
        &self,
        output: &'a mut [T],
        input: &'a [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Self::Output> {
        self.call(Op::ReduceScatter {
            inputs: split_counts("reduce_scatter_v", input, counts)?,
            output: BufMut::new(output),
            op,
        })
    }

    /// Block r of `input` goes to rank r; block r of `output` comes from rank r (equal blocks).
    fn all_to_all<T: Element>(&self, output: &'a mut [T], input: &'a [T]) -> Result<Self::Output> {
        let size = self.comm().size();
        let (ic, oc) = (
            equal_counts("all_to_all", input.len(), size)?,
            equal_counts("all_to_all", output.len(), size)?,
        );
        self.call(Op::AllToAll {
            inputs: split_counts("all_to_all", input, &ic)?,
            outputs: split_counts_mut("all_to_all", output, &oc)?,
        })
    }

    fn all_to_all_list<T: Element>(&self, outputs: Vec<&'a mut [T]>, inputs: Vec<&'a [T]>) -> Result<Self::Output> {
        self.call(Op::AllToAll {
            inputs: inputs.into_iter().map(Buf::new).collect(),
            outputs: outputs.into_iter().map(BufMut::new).collect(),
        })
    }

    /// Block sizes per peer: `input_counts[r]` elements go to rank r, `output_counts[r]` come
    /// from it.
    fn all_to_all_v<T: Element>(
        &self,
        output: &'a mut [T],
        input: &'a [T],
        output_counts: &[usize],
        input_counts: &[usize],
    ) -> Result<Self::Output> {
        self.call(Op::AllToAll {
            inputs: split_counts("all_to_all_v", input, input_counts)?,
            outputs: split_counts_mut("all_to_all_v", output, output_counts)?,
        })
    }

    /// `root`'s `input` (size × output, `None` elsewhere) is split; rank r gets block r.
    fn scatter<T: Element>(&self, output: &'a mut [T], input: Option<&'a [T]>, root: usize) -> Result<Self::Output> {
        let inputs = match input {
            Some(i) if self.comm().rank() == root => {
                let counts = equal_counts("scatter", i.len(), self.comm().size())?;
                Some(split_counts("scatter", i, &counts)?)
            }
            _ => None,
        };
        self.call(Op::Scatter {
            inputs,
            output: BufMut::new(output),
            root,
        })
    }

    /// Every rank's `input` lands in block r of `root`'s `output` (`None` elsewhere).
    fn gather<T: Element>(&self, output: Option<&'a mut [T]>, input: &'a [T], root: usize) -> Result<Self::Output> {
        let outputs = match output {
            Some(o) if self.comm().rank() == root => {
                let counts = equal_counts("gather", o.len(), self.comm().size())?;
                Some(split_counts_mut("gather", o, &counts)?)
            }
            _ => None,
        };
        self.call(Op::Gather {
            input: Buf::new(input),
            outputs,
            root,
        })
    }

    fn barrier(&self) -> Result<Self::Output> {
        self.call(Op::Barrier)
    }

    /// Sends `buf` to `peer`, which must call `recv` (or a batch recv) for it.
    fn send<T: Element>(&self, buf: &'a [T], peer: usize) -> Result<Self::Output> {
        self.call(Op::Batch(vec![P2p::Send {
            buf: Buf::new(buf),
            peer,
        }]))
    }

    fn recv<T: Element>(&self, buf: &'a mut [T], peer: usize) -> Result<Self::Output> {
        self.call(Op::Batch(vec![P2p::Recv {
            buf: BufMut::new(buf),
            peer,
        }]))
    }

    /// Point-to-point calls that run together (in any order without deadlock) on `issue()`.
    fn batch(&self) -> Batch<'a, '_, Self> {
        Batch {
            to: self,
            list: Vec::new(),
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
    pub fn send<T: Element>(mut self, buf: &'a [T], peer: usize) -> Self {
        self.list.push(P2p::Send {
            buf: Buf::new(buf),
            peer,
        });
        self
    }
    pub fn recv<T: Element>(mut self, buf: &'a mut [T], peer: usize) -> Self {
        self.list.push(P2p::Recv {
            buf: BufMut::new(buf),
            peer,
        });
        self
    }
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
}

impl<'a> Collectives<'a> for Comm {
    type Output = ();
    fn comm(&self) -> &Comm {
        self
    }
    fn issue(&self, op: Op<'a>, opts: &OpOptions) -> Result<()> {
        self.run(op, opts)
    }
}

impl<'scope, 'env> Collectives<'scope> for &'scope Scope<'scope, 'env> {
    type Output = Work<'scope>;
    fn comm(&self) -> &Comm {
        self.comm
    }
    fn issue(&self, op: Op<'scope>, opts: &OpOptions) -> Result<Work<'scope>> {
        self.start(op, opts)
    }
}
