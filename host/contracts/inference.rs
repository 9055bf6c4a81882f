//! The arguments of the inference collectives, as an [`Op`](crate::Op) carries them: the
//! fused all_reduce + residual add + RMSNorm of a tensor-parallel layer ([`RmsNormFusion`]),
//! and the dispatch and combine of a mixture-of-experts layer ([`MoeDispatch`],
//! [`MoeCombine`]). Their local checks live here; their arithmetic in `compute/`.

use crate::contracts::bufs::{Buf, BufMut};
use crate::contracts::dtype::DType;
use crate::contracts::error::{Error, Result};

/// `residual = Σ_ranks x + residual`, then `out = rmsnorm(residual) * gamma` (TensorRT-LLM's
/// `RESIDUAL_RMS_NORM` fusion; with an fp8 `out`, `RESIDUAL_RMS_NORM_QUANT_FP8`).
///
/// The sum runs over ranks in rank order in f32, then adds the residual; the norm reads that
/// f32 sum, not its rounded copy: `out[t, j] = s[t, j] / sqrt(mean_j s[t, j]² + eps) * gamma[j]`.
/// With an fp8 `out`, each token's row is quantised with the scale
/// `max_j |y[t, j]| / 448` (1 for a row of zeros), written to `scales[t]`: `y ≈ out * scale`.
#[derive(Debug)]
#[non_exhaustive]
pub struct RmsNormFusion<'a> {
    /// This rank's partial hidden states, `[tokens, hidden]` (f32, f16 or bf16).
    pub x: Buf<'a>,
    /// The residual stream `[tokens, hidden]`, x's dtype: read, then overwritten with the
    /// all-reduced sum plus itself.
    pub residual: BufMut<'a>,
    /// The norm's weight, `[hidden]`, x's dtype.
    pub gamma: Buf<'a>,
    /// The normalised output `[tokens, hidden]`: x's dtype, or `F8E4M3`.
    pub out: BufMut<'a>,
    /// With an fp8 `out`: one f32 scale per token. `None` otherwise.
    pub scales: Option<BufMut<'a>>,
    /// Elements per token row (`gamma`'s length).
    pub hidden: usize,
    /// Added to the mean square before the square root; finite and not negative.
    pub eps: f32,
}

impl<'a> RmsNormFusion<'a> {
    /// The operation on these buffers; `hidden` is `gamma`'s length.
    pub fn new(x: Buf<'a>, residual: BufMut<'a>, gamma: Buf<'a>, out: BufMut<'a>, eps: f32) -> Self {
        let hidden = gamma.count();
        RmsNormFusion {
            x,
            residual,
            gamma,
            out,
            scales: None,
            hidden,
            eps,
        }
    }

    /// With an fp8 `out`: where the per-token scales go.
    pub fn with_scales(mut self, scales: BufMut<'a>) -> Self {
        self.scales = Some(scales);
        self
    }

    /// Token rows.
    pub fn tokens(&self) -> usize {
        self.x.count().checked_div(self.hidden).unwrap_or(0)
    }

    /// Whether `out` is quantised to fp8.
    pub fn quantised(&self) -> bool {
        self.out.dtype() == DType::F8E4M3
    }

    pub(crate) fn validate(&self) -> Result<()> {
        const OP: &str = "all_reduce_residual_rmsnorm";
        let d = self.x.dtype();
        if !matches!(d, DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::invalid(
                OP,
                format!("x is {d}: the fused norm takes f32, f16 or bf16"),
            ));
        }
        for (what, got) in [("residual", self.residual.dtype()), ("gamma", self.gamma.dtype())] {
            if got != d {
                return Err(Error::invalid(
                    OP,
                    format!("{what} is {got}, x is {d}: they must agree"),
                ));
            }
        }
        if self.out.dtype() != d && self.out.dtype() != DType::F8E4M3 {
            return Err(Error::invalid(
                OP,
                format!("out is {}: it must be x's dtype ({d}) or f8e4m3", self.out.dtype()),
            ));
        }
        if self.hidden == 0 || self.hidden != self.gamma.count() {
            return Err(Error::invalid(
                OP,
                format!(
                    "hidden is {} but gamma has {} elements (and must have some)",
                    self.hidden,
                    self.gamma.count()
                ),
            ));
        }
        if self.x.count() % self.hidden != 0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "x has {} elements, not whole rows of hidden = {}",
                    self.x.count(),
                    self.hidden
                ),
            ));
        }
        let n = self.x.count();
        for (what, got) in [("residual", self.residual.count()), ("out", self.out.count())] {
            if got != n {
                return Err(Error::SizeMismatch {
                    op: OP,
                    what: what.into(),
                    expected: n,
                    actual: got,
                });
            }
        }
        match (&self.scales, self.quantised()) {
            (Some(s), true) if s.dtype() != DType::F32 => Err(Error::DTypeMismatch {
                op: OP,
                expected: "f32",
                actual: s.dtype().name(),
            }),
            (Some(s), true) if s.count() != self.tokens() => Err(Error::SizeMismatch {
                op: OP,
                what: "scales (one per token)".into(),
                expected: self.tokens(),
                actual: s.count(),
            }),
            (None, true) => Err(Error::invalid(
                OP,
                "an fp8 out needs a scales buffer (one f32 per token)",
            )),
            (Some(_), false) => Err(Error::invalid(OP, "scales are written only with an fp8 out")),
            _ if !(self.eps.is_finite() && self.eps >= 0.0) => Err(Error::invalid(
                OP,
                format!("eps = {} must be finite and not negative", self.eps),
            )),
            _ => Ok(()),
        }
    }
}

/// The shape every rank of a mixture-of-experts layer agrees on. Experts are spread evenly:
/// rank r owns experts `r * local ..= (r + 1) * local - 1`, `local = experts / world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    /// Experts over all ranks; a multiple of the world size.
    pub experts: usize,
    /// Experts each token is routed to (K: columns of `topk_idx`).
    pub topk: usize,
    /// Elements per token row.
    pub hidden: usize,
    /// Rows per local expert in the receive buffers. A dispatch that routes more tokens to one
    /// expert fails with `Error::CapacityExceeded` (its counts still say how many came).
    pub capacity: usize,
}

/// Elements per fp8 scale block along the hidden dimension (DeepEP's 128).
pub const FP8_BLOCK: usize = 128;

/// The send half of a dispatch: this rank's tokens and their routing.
#[derive(Debug)]
#[non_exhaustive]
pub struct DispatchSend<'a> {
    /// `[T, hidden]`: f32, f16, bf16, or f8e4m3 with `scales`.
    pub tokens: Buf<'a>,
    /// With fp8 tokens: f32 `[T, hidden / 128]`, one scale per 128-element block.
    pub scales: Option<Buf<'a>>,
    /// `[T, topk]` expert ids (i32 or i64); -1 skips the slot.
    pub topk_idx: Buf<'a>,
}

/// The receive half of a dispatch: per local expert, the rows that came.
#[derive(Debug)]
#[non_exhaustive]
pub struct DispatchRecv<'a> {
    /// `[local experts, capacity, hidden]`, the tokens' dtype; row i of expert e is valid for
    /// i < `counts[e]`.
    pub tokens: BufMut<'a>,
    /// With fp8 tokens: f32 `[local experts, capacity, hidden / 128]`.
    pub scales: Option<BufMut<'a>>,
    /// i32 `[local experts]`: rows routed to each local expert (also past the capacity).
    pub counts: BufMut<'a>,
    /// i32 `[local experts, capacity, 3]`: each row's source (rank, token, k), as combine
    /// needs it back.
    pub src: BufMut<'a>,
}

/// Dispatch: each token goes once to every rank that owns one of its experts; rows come out
/// per local expert in the order (source rank, token, k). Either half may be run alone (the
/// send half first), so a rank computes while its tokens travel.
#[derive(Debug)]
#[non_exhaustive]
pub struct MoeDispatch<'a> {
    /// The layer's shape.
    pub shape: MoeShape,
    /// The send half (`None`: run only the receive half of a dispatch already sent).
    pub send: Option<DispatchSend<'a>>,
    /// The receive half (`None`: run only the send half).
    pub recv: Option<DispatchRecv<'a>>,
}

/// The send half of a combine: this rank's experts' outputs, back to their tokens' ranks.
#[derive(Debug)]
#[non_exhaustive]
pub struct CombineSend<'a> {
    /// `[local experts, capacity, hidden]` (f32, f16 or bf16): row i of expert e answers
    /// `src[e, i]`.
    pub expert_out: Buf<'a>,
    /// The dispatch's `src`.
    pub src: Buf<'a>,
    /// The dispatch's `counts`.
    pub counts: Buf<'a>,
}

/// The receive half of a combine: each token's weighted sum.
#[derive(Debug)]
#[non_exhaustive]
pub struct CombineRecv<'a> {
    /// The dispatch's `topk_idx` (`[T, topk]`, i32 or i64).
    pub topk_idx: Buf<'a>,
    /// f32 `[T, topk]`.
    pub topk_weights: Buf<'a>,
    /// `[T, hidden]`, the expert outputs' dtype: `Σ_k weight[t, k] * expert_out(t, k)` in f32,
    /// k in order, rounded once.
    pub out: BufMut<'a>,
}

/// Combine: the inverse of a dispatch, with the weighted sum over each token's experts.
#[derive(Debug)]
#[non_exhaustive]
pub struct MoeCombine<'a> {
    /// The layer's shape (the dispatch's).
    pub shape: MoeShape,
    /// The send half (`None`: only receive).
    pub send: Option<CombineSend<'a>>,
    /// The receive half (`None`: only send).
    pub recv: Option<CombineRecv<'a>>,
}

impl MoeShape {
    /// Experts per rank.
    pub fn local_experts(&self, world: usize) -> usize {
        self.experts / world.max(1)
    }

    pub(crate) fn validate(&self, op: &'static str, world: usize) -> Result<()> {
        if self.experts == 0 || self.experts % world != 0 {
            return Err(Error::invalid(
                op,
                format!("{} experts do not spread evenly over {world} ranks", self.experts),
            ));
        }
        if self.topk == 0 || self.topk > self.experts {
            return Err(Error::invalid(
                op,
                format!("topk = {} must be in 1..={}", self.topk, self.experts),
            ));
        }
        if self.hidden == 0 || self.capacity == 0 {
            return Err(Error::invalid(op, "hidden and capacity must not be 0"));
        }
        // Sources are i32 on the wire and in `src`.
        if self.capacity > i32::MAX as usize {
            return Err(Error::invalid(op, "capacity must fit an i32"));
        }
        Ok(())
    }
}

fn expect(op: &'static str, what: &str, got: (DType, usize), dtype: &[DType], count: usize) -> Result<()> {
    if !dtype.contains(&got.0) {
        let names: Vec<_> = dtype.iter().map(|d| d.name()).collect();
        return Err(Error::invalid(
            op,
            format!("{what} is {}; expected {}", got.0, names.join(" or ")),
        ));
    }
    if got.1 != count {
        return Err(Error::SizeMismatch {
            op,
            what: what.into(),
            expected: count,
            actual: got.1,
        });
    }
    Ok(())
}

const IDX: [DType; 2] = [DType::I32, DType::I64];
const TOKEN: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F8E4M3];
const ACT: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn shape_of(b: &Buf) -> (DType, usize) {
    (b.dtype(), b.count())
}

fn shape_of_mut(b: &BufMut) -> (DType, usize) {
    (b.dtype(), b.count())
}

impl DispatchSend<'_> {
    /// Token rows.
    pub fn tokens_count(&self, hidden: usize) -> usize {
        self.tokens.count().checked_div(hidden).unwrap_or(0)
    }
}

impl MoeDispatch<'_> {
    pub(crate) fn validate(&self, world: usize) -> Result<()> {
        const OP: &str = "moe_dispatch";
        let s = self.shape;
        s.validate(OP, world)?;
        if self.send.is_none() && self.recv.is_none() {
            return Err(Error::invalid(OP, "neither half given"));
        }
        let blocks = s.hidden / FP8_BLOCK;
        if let Some(send) = &self.send {
            let d = send.tokens.dtype();
            let t = send.tokens_count(s.hidden);
            expect(
                OP,
                "tokens (whole rows of hidden)",
                shape_of(&send.tokens),
                &TOKEN,
                t * s.hidden,
            )?;
            expect(OP, "topk_idx", shape_of(&send.topk_idx), &IDX, t * s.topk)?;
            fp8_scales(OP, d, s.hidden, send.scales.as_ref().map(shape_of), t * blocks)?;
        }
        if let Some(recv) = &self.recv {
            let local = s.local_experts(world);
            let rows = local * s.capacity;
            let d = recv.tokens.dtype();
            expect(
                OP,
                "received tokens",
                shape_of_mut(&recv.tokens),
                &TOKEN,
                rows * s.hidden,
            )?;
            if let Some(send) = &self.send {
                if send.tokens.dtype() != d {
                    return Err(Error::DTypeMismatch {
                        op: OP,
                        expected: send.tokens.dtype().name(),
                        actual: d.name(),
                    });
                }
            }
            fp8_scales(OP, d, s.hidden, recv.scales.as_ref().map(shape_of_mut), rows * blocks)?;
            expect(OP, "counts", shape_of_mut(&recv.counts), &[DType::I32], local)?;
            expect(OP, "src", shape_of_mut(&recv.src), &[DType::I32], rows * 3)?;
        }
        Ok(())
    }
}

/// fp8 rows carry one f32 scale per 128 elements; other dtypes none.
fn fp8_scales(op: &'static str, d: DType, hidden: usize, scales: Option<(DType, usize)>, count: usize) -> Result<()> {
    match (d == DType::F8E4M3, scales) {
        (true, _) if hidden % FP8_BLOCK != 0 => Err(Error::invalid(
            op,
            format!("fp8 tokens need hidden to be a multiple of {FP8_BLOCK}, not {hidden}"),
        )),
        (true, Some(got)) => expect(op, "scales", got, &[DType::F32], count),
        (true, None) => Err(Error::invalid(op, "fp8 tokens need their block scales")),
        (false, Some(_)) => Err(Error::invalid(op, "scales go with fp8 tokens only")),
        (false, None) => Ok(()),
    }
}

impl MoeCombine<'_> {
    pub(crate) fn validate(&self, world: usize) -> Result<()> {
        const OP: &str = "moe_combine";
        let s = self.shape;
        s.validate(OP, world)?;
        if self.send.is_none() && self.recv.is_none() {
            return Err(Error::invalid(OP, "neither half given"));
        }
        let local = s.local_experts(world);
        let rows = local * s.capacity;
        if let Some(send) = &self.send {
            expect(OP, "expert_out", shape_of(&send.expert_out), &ACT, rows * s.hidden)?;
            expect(OP, "src", shape_of(&send.src), &[DType::I32], rows * 3)?;
            expect(OP, "counts", shape_of(&send.counts), &[DType::I32], local)?;
        }
        if let Some(recv) = &self.recv {
            let d = recv.out.dtype();
            let t = recv.out.count() / s.hidden;
            expect(OP, "out", shape_of_mut(&recv.out), &ACT, t * s.hidden)?;
            expect(OP, "topk_idx", shape_of(&recv.topk_idx), &IDX, t * s.topk)?;
            expect(
                OP,
                "topk_weights",
                shape_of(&recv.topk_weights),
                &[DType::F32],
                t * s.topk,
            )?;
            if let Some(send) = &self.send {
                if send.expert_out.dtype() != d {
                    return Err(Error::DTypeMismatch {
                        op: OP,
                        expected: send.expert_out.dtype().name(),
                        actual: d.name(),
                    });
                }
            }
        }
        Ok(())
    }
}
