//! The buffers of a MoE dispatch or combine, gathered with typed builders ([`Dispatch`],
//! [`Combine`]) before [`Collectives::moe_dispatch`](crate::Collectives::moe_dispatch) /
//! [`moe_combine`](crate::Collectives::moe_combine) take them.

use crate::buffer::{InputBuffer, OutputBuffer};
use crate::contracts::inference::{
    CombineRecv, CombineSend, DispatchRecv, DispatchSend, MoeCombine, MoeDispatch, MoeShape,
};

/// The buffers of a MoE dispatch: its send half ([`Dispatch::send`]), its receive half
/// ([`Dispatch::recv`]) or both. See [`MoeDispatch`] for the semantics.
#[derive(Debug, Default)]
pub struct Dispatch<'a> {
    send: Option<DispatchSend<'a>>,
    recv: Option<DispatchRecv<'a>>,
}

impl<'a> Dispatch<'a> {
    /// The send half: `tokens` `[T, hidden]` (f32, f16, bf16 or [`F8E4M3`](crate::F8E4M3))
    /// and `topk_idx` `[T, topk]` (i32 or i64 expert ids, -1 for none).
    pub fn send<T: InputBuffer<'a>, I: InputBuffer<'a>>(tokens: T, topk_idx: I) -> Self {
        Dispatch {
            send: Some(DispatchSend {
                tokens: tokens.into_buf(),
                scales: None,
                topk_idx: topk_idx.into_buf(),
            }),
            recv: None,
        }
    }

    /// With fp8 tokens: their f32 scales, `[T, hidden / 128]`.
    pub fn scales<S: InputBuffer<'a, Elem = f32>>(mut self, scales: S) -> Self {
        if let Some(s) = &mut self.send {
            s.scales = Some(scales.into_buf());
        }
        self
    }

    /// Only the receive half (of a dispatch whose send half ran before).
    pub fn recv_only() -> Self {
        Dispatch::default()
    }

    /// The receive half: `tokens` `[local experts, capacity, hidden]`, `counts` `[local
    /// experts]` and `src` `[local experts, capacity, 3]`.
    pub fn recv<T, C, S>(mut self, tokens: T, counts: C, src: S) -> Self
    where
        T: OutputBuffer<'a>,
        C: OutputBuffer<'a, Elem = i32>,
        S: OutputBuffer<'a, Elem = i32>,
    {
        self.recv = Some(DispatchRecv {
            tokens: tokens.into_buf_mut(),
            scales: None,
            counts: counts.into_buf_mut(),
            src: src.into_buf_mut(),
        });
        self
    }

    /// With fp8 tokens: where their scales land, `[local experts, capacity, hidden / 128]`.
    pub fn recv_scales<S: OutputBuffer<'a, Elem = f32>>(mut self, scales: S) -> Self {
        if let Some(r) = &mut self.recv {
            r.scales = Some(scales.into_buf_mut());
        }
        self
    }

    pub(crate) fn into_op(self, shape: MoeShape) -> MoeDispatch<'a> {
        MoeDispatch {
            shape,
            send: self.send,
            recv: self.recv,
        }
    }
}

/// The buffers of a MoE combine: its send half ([`Combine::send`]), its receive half
/// ([`Combine::recv`]) or both. See [`MoeCombine`] for the semantics.
#[derive(Debug, Default)]
pub struct Combine<'a> {
    send: Option<CombineSend<'a>>,
    recv: Option<CombineRecv<'a>>,
}

impl<'a> Combine<'a> {
    /// The send half: the experts' outputs `[local experts, capacity, hidden]`, with the
    /// dispatch's `src` and `counts`.
    pub fn send<O, S, C>(expert_out: O, src: S, counts: C) -> Self
    where
        O: InputBuffer<'a>,
        S: InputBuffer<'a, Elem = i32>,
        C: InputBuffer<'a, Elem = i32>,
    {
        Combine {
            send: Some(CombineSend {
                expert_out: expert_out.into_buf(),
                src: src.into_buf(),
                counts: counts.into_buf(),
            }),
            recv: None,
        }
    }

    /// Only the receive half (of a combine whose send half ran before).
    pub fn recv_only() -> Self {
        Combine::default()
    }

    /// The receive half: the dispatch's `topk_idx`, f32 `topk_weights` `[T, topk]`, and
    /// `out` `[T, hidden]`.
    pub fn recv<I, W, O>(mut self, topk_idx: I, topk_weights: W, out: O) -> Self
    where
        I: InputBuffer<'a>,
        W: InputBuffer<'a, Elem = f32>,
        O: OutputBuffer<'a>,
    {
        self.recv = Some(CombineRecv {
            topk_idx: topk_idx.into_buf(),
            topk_weights: topk_weights.into_buf(),
            out: out.into_buf_mut(),
        });
        self
    }

    pub(crate) fn into_op(self, shape: MoeShape) -> MoeCombine<'a> {
        MoeCombine {
            shape,
            send: self.send,
            recv: self.recv,
        }
    }
}
