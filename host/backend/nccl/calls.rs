//! An [`Op`] on device buffers as NCCL calls, issued inside one group on one stream.
//!
//! Collectives whose per-rank parts are equal and contiguous map onto NCCL's own collective;
//! every other shape (v-forms, lists, scatter, gather, all-to-all) becomes grouped
//! broadcasts, reduces or send/receive pairs, which NCCL runs concurrently.

use super::comm::NcclComm;
use crate::contracts::dtype::{DType, ReduceOp};
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::{Buf, BufMut, DeviceBytes, Op, P2p};
use crate::gpu::nccl_library::{CommPtr, Stream, SCALAR_HOST_IMMEDIATE};
use half::{bf16, f16};
use std::ffi::{c_int, c_void};

/// NCCL's type for `d`, where it has one: none for bool, i16 and u16.
fn nccl_type(d: DType) -> Option<c_int> {
    Some(match d {
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::I64 => 4,
        DType::U64 => 5,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
        // ncclFloat8e4m3 and ncclFloat8e5m2 (NCCL 2.24+, reductions on sm_90 and later only).
        DType::F8E4M3 => 10,
        DType::F8E5M2 => 11,
        DType::Bool | DType::I16 | DType::U16 => return None,
    })
}

/// `count` elements of `d` as NCCL moves them: (NCCL's count, NCCL's type). Types NCCL lacks
/// move as bytes (ncclUint8): a copy does not look at the values.
fn moved(d: DType, count: usize) -> (usize, c_int) {
    match nccl_type(d) {
        Some(t) => (count, t),
        None => (count * d.size(), 1),
    }
}

/// NCCL's type for reducing `d` (where [`reduces`] holds): bool is ncclUint8, whose min and
/// max are and and or on 0 and 1.
fn reduced(d: DType) -> c_int {
    nccl_type(d).unwrap_or(1)
}

/// Whether NCCL reduces `d` with `op` (see `redop`): not bitwise ops, but for bool's and / or;
/// not i16 or u16, which NCCL has no type for.
pub(crate) fn reduces(d: DType, op: ReduceOp) -> bool {
    match d {
        DType::I16 | DType::U16 => false,
        DType::Bool => !matches!(op, ReduceOp::BXor),
        _ => !op.is_bitwise(),
    }
}

/// NCCL's reduction for `op`. premul_sum makes a per-call operator, recorded in `made` for the
/// caller to destroy once the group is enqueued.
fn redop(
    nccl: &NcclComm,
    comm: CommPtr,
    name: &'static str,
    op: ReduceOp,
    d: DType,
    made: &mut Vec<c_int>,
) -> Result<c_int> {
    let unsupported = || Error::UnsupportedReduce {
        op: name,
        reduce: format!("{op} (on the nccl backend)"),
        dtype: d.name(),
    };
    if !reduces(d, op) {
        return Err(unsupported());
    }
    if d == DType::Bool {
        // Logical, as on the CPU (ReduceOp::check refused avg and premul_sum): or is max and
        // and is min on bytes of 0 and 1.
        return Ok(match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => 2,
            _ => 3,
        });
    }
    Ok(match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
        ReduceOp::PremulSum(s) => {
            // The scalar in the element type, read from host memory during the call.
            let mut scalar = [0u8; 8];
            match d {
                DType::F32 => scalar[..4].copy_from_slice(&(s as f32).to_ne_bytes()),
                DType::F64 => scalar.copy_from_slice(&s.to_ne_bytes()),
                DType::F16 => scalar[..2].copy_from_slice(&f16::from_f64(s).to_ne_bytes()),
                DType::BF16 => scalar[..2].copy_from_slice(&bf16::from_f64(s).to_ne_bytes()),
                // Integers scale by the scalar converted to the element type, as on the CPU.
                DType::I8 => scalar[..1].copy_from_slice(&(s as i8).to_ne_bytes()),
                DType::U8 => scalar[..1].copy_from_slice(&(s as u8).to_ne_bytes()),
                DType::I32 => scalar[..4].copy_from_slice(&(s as i32).to_ne_bytes()),
                DType::U32 => scalar[..4].copy_from_slice(&(s as u32).to_ne_bytes()),
                DType::I64 => scalar.copy_from_slice(&(s as i64).to_ne_bytes()),
                DType::U64 => scalar.copy_from_slice(&(s as u64).to_ne_bytes()),
                DType::F8E4M3 => scalar[0] = crate::contracts::fp8::F8E4M3::from_f32(s as f32).to_bits(),
                DType::F8E5M2 => scalar[0] = crate::contracts::fp8::F8E5M2::from_f32(s as f32).to_bits(),
                DType::Bool | DType::I16 | DType::U16 => return Err(unsupported()),
            }
            let mut out = 0;
            // SAFETY: NCCL reads the scalar now (host immediate) and writes the operator.
            let r = unsafe {
                (nccl.lib.api.ncclRedOpCreatePreMulSum)(
                    &mut out,
                    scalar.as_mut_ptr().cast(),
                    reduced(d),
                    SCALAR_HOST_IMMEDIATE,
                    comm,
                )
            };
            nccl.lib.check("ncclRedOpCreatePreMulSum", r, comm)?;
            made.push(out);
            out
        }
        // NCCL has no bitwise reductions (`reduces` refused them above).
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => return Err(unsupported()),
    })
}

fn dev(b: &Buf) -> DeviceBytes {
    b.device_bytes().expect("checked by the backend: device buffers only")
}

fn dev_mut(b: &BufMut) -> DeviceBytes {
    b.device_bytes().expect("checked by the backend: device buffers only")
}

fn ptr(d: DeviceBytes) -> *mut c_void {
    d.ptr as *mut c_void
}

/// Whether `parts` are `n` equal blocks laid out back to back.
fn contiguous(parts: &[DeviceBytes]) -> bool {
    let first = parts[0];
    parts
        .iter()
        .enumerate()
        .all(|(i, p)| p.len == first.len && p.ptr == first.ptr + (i * first.len) as u64)
}

/// Issues `op` on `stream` as one NCCL group. Returns after the calls are enqueued (and, in
/// nonblocking mode, accepted).
pub(crate) fn issue(
    nccl: &NcclComm,
    op: &Op<'_>,
    rank: usize,
    stream: Stream,
    timeout: std::time::Duration,
) -> Result<()> {
    let name = op.name();
    let api = &nccl.lib.api;
    // Operators made for this call; destroyed once the group is enqueued.
    let mut made: Vec<c_int> = Vec::new();
    let r = nccl.with(name, |c| {
        let check = |call: &str, r: c_int| nccl.lib.check(call, r, c);
        // SAFETY (send, recv, and every call below): device pointers of the operation's buffers,
        // which the caller borrows for the call and which stay valid in stream order; counts in
        // elements of the declared dtype, as validated by `Op::validate`.
        let send = |b: &Buf, peer: usize| {
            // SAFETY: as stated above for every call.
            check("ncclSend", unsafe {
                let (n, t) = moved(b.dtype(), b.count());
                (api.ncclSend)(ptr(dev(b)), n, t, peer as c_int, c, stream)
            })
        };
        let recv = |b: &BufMut, peer: usize| {
            // SAFETY: as stated above for every call.
            check("ncclRecv", unsafe {
                let (n, t) = moved(b.dtype(), b.count());
                (api.ncclRecv)(ptr(dev_mut(b)), n, t, peer as c_int, c, stream)
            })
        };
        // SAFETY: as stated above for every call.
        unsafe {
            check("ncclGroupStart", (api.ncclGroupStart)())?;
            let body = (|| -> Result<()> {
                match op {
                    Op::AllReduce { buf, op } => {
                        let (b, d) = (dev_mut(buf), buf.dtype());
                        let o = redop(nccl, c, name, *op, d, &mut made)?;
                        check(
                            "ncclAllReduce",
                            (api.ncclAllReduce)(ptr(b), ptr(b), buf.count(), reduced(d), o, c, stream),
                        )
                    }
                    Op::Reduce { buf, op, root } => {
                        let (b, d) = (dev_mut(buf), buf.dtype());
                        let o = redop(nccl, c, name, *op, d, &mut made)?;
                        check(
                            "ncclReduce",
                            (api.ncclReduce)(ptr(b), ptr(b), buf.count(), reduced(d), o, *root as c_int, c, stream),
                        )
                    }
                    Op::Broadcast { buf, root } => {
                        let b = dev_mut(buf);
                        let (n, t) = moved(buf.dtype(), buf.count());
                        check(
                            "ncclBroadcast",
                            (api.ncclBroadcast)(ptr(b), ptr(b), n, t, *root as c_int, c, stream),
                        )
                    }
                    Op::AllGather { input, outputs } => {
                        let outs: Vec<DeviceBytes> = outputs.iter().map(dev_mut).collect();
                        if contiguous(&outs) && outs[0].len == input.byte_len() {
                            let (n, t) = moved(input.dtype(), input.count());
                            return check(
                                "ncclAllGather",
                                (api.ncclAllGather)(ptr(dev(input)), ptr(outs[0]), n, t, c, stream),
                            );
                        }
                        for (r, (o, b)) in outs.iter().zip(outputs).enumerate() {
                            let src = if r == rank { ptr(dev(input)) } else { ptr(*o) };
                            let (n, t) = moved(b.dtype(), b.count());
                            check(
                                "ncclBroadcast",
                                (api.ncclBroadcast)(src, ptr(*o), n, t, r as c_int, c, stream),
                            )?;
                        }
                        Ok(())
                    }
                    Op::ReduceScatter { inputs, output, op } => {
                        let ins: Vec<DeviceBytes> = inputs.iter().map(dev).collect();
                        let d = output.dtype();
                        let o = redop(nccl, c, name, *op, d, &mut made)?;
                        if contiguous(&ins) && ins[0].len == output.byte_len() {
                            return check(
                                "ncclReduceScatter",
                                (api.ncclReduceScatter)(
                                    ptr(ins[0]),
                                    ptr(dev_mut(output)),
                                    output.count(),
                                    reduced(d),
                                    o,
                                    c,
                                    stream,
                                ),
                            );
                        }
                        for (r, (i, b)) in ins.iter().zip(inputs).enumerate() {
                            // The receive buffer matters at the root only.
                            let dst = if r == rank { ptr(dev_mut(output)) } else { ptr(*i) };
                            check(
                                "ncclReduce",
                                (api.ncclReduce)(ptr(*i), dst, b.count(), reduced(d), o, r as c_int, c, stream),
                            )?;
                        }
                        Ok(())
                    }
                    Op::AllToAll { inputs, outputs } => {
                        for (r, (i, o)) in inputs.iter().zip(outputs).enumerate() {
                            send(i, r)?;
                            recv(o, r)?;
                        }
                        Ok(())
                    }
                    Op::Scatter { inputs, output, root } => {
                        if let Some(inputs) = inputs.as_ref().filter(|_| rank == *root) {
                            for (r, i) in inputs.iter().enumerate() {
                                send(i, r)?;
                            }
                        }
                        recv(output, *root)
                    }
                    Op::Gather { input, outputs, root } => {
                        send(input, *root)?;
                        if let Some(outputs) = outputs.as_ref().filter(|_| rank == *root) {
                            for (r, o) in outputs.iter().enumerate() {
                                recv(o, r)?;
                            }
                        }
                        Ok(())
                    }
                    Op::Batch(list) => list.iter().try_for_each(|p| match p {
                        P2p::Send { buf, peer } => send(buf, *peer),
                        P2p::Recv { buf, peer } => recv(buf, *peer),
                    }),
                    Op::Barrier => Err(Error::invalid(name, "a barrier has no buffers; the backend runs it")),
                    // The fused norm is its steps around an all_reduce (backend/norm_pass.rs),
                    // issued one by one: never a call of its own here.
                    Op::AllReduceRmsNorm(_) => Err(Error::invalid(name, "the backend runs it as its steps")),
                    Op::MoeDispatch(_) | Op::MoeCombine(_) => Err(Error::Unavailable {
                        backend: "nccl".into(),
                        reason: format!(
                            "{name} on device buffers runs on the device backend (its own kernels, with NCCL \
                             underneath where it helps); the nccl backend runs it on host buffers only"
                        ),
                    }),
                }
            })();
            // The group is always closed, also after an error inside it.
            let end = (api.ncclGroupEnd)();
            body?;
            Ok(end)
        }
    });
    let settled = r.and_then(|end| nccl.settle("ncclGroupEnd", end, timeout));
    let _ = nccl.with(name, |c| {
        for x in made {
            // SAFETY: operators made above on this communicator; NCCL keeps them alive for
            // the work already enqueued.
            unsafe { (api.ncclRedOpDestroy)(x, c) };
        }
        Ok(())
    });
    settled
}
