//! The device backend's own path for collectives on device buffers until its kernels arrive:
//! copy the buffers to the host, run the operation on the CPU engine (the reference
//! implementation), copy the results back. Correct everywhere, including several ranks on one
//! GPU, where NCCL refuses to run; slow, so NCCL takes over wherever it can.

use crate::backend::cpu::CpuBackend;
use crate::contracts::backend::{Backend, RunOptions};
use crate::contracts::error::{Error, Result};
use crate::contracts::inference::{
    CombineRecv, CombineSend, DispatchRecv, DispatchSend, MoeCombine, MoeDispatch, RmsNormFusion,
};
use crate::contracts::ops::{Buf, BufMut, DeviceBytes, Op, P2p};
use crate::gpu::cuda::{self, copy, stream::Event};

pub(crate) fn run(host: &CpuBackend, op: &mut Op<'_>, opts: &RunOptions) -> Result<()> {
    let name = op.name();
    if cuda::stream::is_capturing(opts.stream)? {
        return Err(Error::invalid(
            name,
            "the device backend without NCCL copies through the host, which a CUDA graph cannot \
             capture; install NCCL or issue this operation outside the capture",
        ));
    }
    // Copies run on the issuing stream, after its earlier work on the buffers, and never on
    // the legacy stream, whose implicit synchronization with other streams could wait for
    // another rank's kernel that waits for this rank.
    let stream = opts.stream;
    // Waits, bounded, for what is on the stream so far (an event: the stream may be shared).
    let settle = || Event::record_on(opts.stream)?.wait(name, opts.timeout);
    // The stream's earlier work first: a copy to pageable memory would otherwise wait for it
    // without a deadline.
    settle()?;
    let mut ins: Vec<Option<DeviceBytes>> = Vec::new();
    let mut out_ranges: Vec<Option<DeviceBytes>> = Vec::new();
    op.for_each_buffer(
        |b| ins.push(b.device_bytes()),
        // Outputs are downloaded too: in-place operations read them, and ranks that receive
        // nothing must keep their contents.
        |b| out_ranges.push(b.device_bytes()),
    );
    let download = |d: Option<DeviceBytes>| download(d, stream);
    let ins: Vec<Vec<u8>> = ins.into_iter().map(download).collect::<Result<_>>()?;
    let mut outs: Vec<(DeviceBytes, Vec<u8>)> = out_ranges
        .into_iter()
        .map(|d| Ok((d.ok_or_else(mixed)?, download(d)?)))
        .collect::<Result<_>>()?;
    {
        let mut in_iter = ins.iter();
        let mut out_iter = outs.iter_mut();
        let mut host_op = on_host(op, &mut in_iter, &mut out_iter);
        let host_opts = RunOptions {
            stream: 0,
            fence: None,
            ..*opts
        };
        host.run(&mut host_op, &host_opts)?;
    }
    for (dst, bytes) in &outs {
        // SAFETY: `dst` is the device range the caller borrowed; `bytes` has its length (a
        // copy from pageable memory has read it when the call returns).
        unsafe { copy::host_to_device(dst.ptr, bytes, stream) }?;
    }
    // Returns when the results are in the buffers, as the synchronous call promises.
    settle()
}

fn mixed() -> Error {
    Error::invalid("staged collective", "a host buffer among device buffers")
}

/// Copies `d` to the host on `stream`, after the stream's earlier work.
fn download(d: Option<DeviceBytes>, stream: u64) -> Result<Vec<u8>> {
    let d = d.ok_or_else(mixed)?;
    let mut v = vec![0u8; d.len];
    // SAFETY: `d` is a device range the caller borrowed; `v` has its length. A copy to
    // pageable memory returns once it is complete, so `v` may go at once, even on an error.
    unsafe { copy::device_to_host(&mut v, d.ptr, stream) }?;
    Ok(v)
}

/// The same operation on the host copies, taken in `Op::for_each_buffer`'s order.
fn on_host<'b>(
    op: &Op<'_>,
    ins: &mut std::slice::Iter<'b, Vec<u8>>,
    outs: &mut std::slice::IterMut<'b, (DeviceBytes, Vec<u8>)>,
) -> Op<'b> {
    let mut i = |b: &Buf| Buf::from_host_bytes(ins.next().map_or(&[][..], |v| &v[..]), b.dtype());
    let mut o = |b: &BufMut| BufMut::from_host_bytes(outs.next().map_or(&mut [][..], |v| &mut v.1[..]), b.dtype());
    match op {
        Op::AllReduce { buf, op } => Op::AllReduce { buf: o(buf), op: *op },
        Op::Reduce { buf, op, root } => Op::Reduce {
            buf: o(buf),
            op: *op,
            root: *root,
        },
        Op::Broadcast { buf, root } => Op::Broadcast {
            buf: o(buf),
            root: *root,
        },
        Op::AllGather { input, outputs } => Op::AllGather {
            input: i(input),
            outputs: outputs.iter().map(o).collect(),
        },
        Op::ReduceScatter { inputs, output, op } => Op::ReduceScatter {
            inputs: inputs.iter().map(&mut i).collect(),
            output: o(output),
            op: *op,
        },
        Op::AllToAll { inputs, outputs } => Op::AllToAll {
            inputs: inputs.iter().map(i).collect(),
            outputs: outputs.iter().map(o).collect(),
        },
        Op::Scatter { inputs, output, root } => Op::Scatter {
            inputs: inputs.as_ref().map(|v| v.iter().map(&mut i).collect()),
            output: o(output),
            root: *root,
        },
        Op::Gather { input, outputs, root } => Op::Gather {
            input: i(input),
            outputs: outputs.as_ref().map(|v| v.iter().map(o).collect()),
            root: *root,
        },
        Op::Barrier => Op::Barrier,
        Op::Batch(list) => Op::Batch(
            list.iter()
                .map(|p| match p {
                    P2p::Send { buf, peer } => P2p::Send {
                        buf: i(buf),
                        peer: *peer,
                    },
                    P2p::Recv { buf, peer } => P2p::Recv {
                        buf: o(buf),
                        peer: *peer,
                    },
                })
                .collect(),
        ),
        Op::AllReduceRmsNorm(f) => {
            // for_each_buffer's order: x, gamma, then residual, out, scales.
            let (x, gamma) = (i(&f.x), i(&f.gamma));
            let (residual, out) = (o(&f.residual), o(&f.out));
            Op::AllReduceRmsNorm(RmsNormFusion {
                x,
                residual,
                gamma,
                out,
                scales: f.scales.as_ref().map(o),
                hidden: f.hidden,
                eps: f.eps,
            })
        }
        Op::MoeDispatch(m) => {
            let send = m.send.as_ref().map(|s| DispatchSend {
                tokens: i(&s.tokens),
                scales: s.scales.as_ref().map(&mut i),
                topk_idx: i(&s.topk_idx),
            });
            let recv = m.recv.as_ref().map(|r| DispatchRecv {
                tokens: o(&r.tokens),
                scales: r.scales.as_ref().map(&mut o),
                counts: o(&r.counts),
                src: o(&r.src),
            });
            Op::MoeDispatch(MoeDispatch {
                shape: m.shape,
                send,
                recv,
            })
        }
        Op::MoeCombine(m) => {
            let send = m.send.as_ref().map(|s| CombineSend {
                expert_out: i(&s.expert_out),
                src: i(&s.src),
                counts: i(&s.counts),
            });
            let recv = m.recv.as_ref().map(|r| CombineRecv {
                topk_idx: i(&r.topk_idx),
                topk_weights: i(&r.topk_weights),
                out: o(&r.out),
            });
            Op::MoeCombine(MoeCombine {
                shape: m.shape,
                send,
                recv,
            })
        }
    }
}
