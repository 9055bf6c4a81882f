//! The residual add and RMSNorm of one token row, as `RmsNormFusion` defines them: the f32
//! sum over ranks plus the residual is written back (rounded) as the new residual; the norm
//! reads the f32 sum. Every sum here runs in a fixed order, so the same inputs give the same
//! bits on every rank.

use crate::compute::rows;
use crate::contracts::dtype::DType;
use crate::contracts::fp8::F8E4M3;

/// One row's parameters.
pub(crate) struct Norm<'a> {
    /// The weight, `hidden` elements of `dtype`.
    pub gamma: &'a [f32],
    pub eps: f32,
    /// The activations' dtype (residual, gamma).
    pub dtype: DType,
    /// `out`'s dtype: `dtype`, or `F8E4M3`.
    pub out_dtype: DType,
}

impl Norm<'_> {
    /// `acc` holds the row's sum over ranks. Adds the residual row (bytes of `dtype`) to it,
    /// overwrites the residual with the rounded result, writes the normalised row to `out` and
    /// returns the fp8 scale (1 when `out` is not fp8).
    pub(crate) fn row(&self, acc: &mut [f32], residual: &mut [u8], out: &mut [u8]) -> f32 {
        rows::add_into(acc, residual, self.dtype);
        rows::store(residual, acc, self.dtype);
        // Plain multiply and add (no fused multiply-add): without the `fma` target feature
        // `mul_add` is a library call per element.
        let square = acc.iter().fold(0f32, |s, &v| s + v * v);
        let inv = 1.0 / (square / acc.len() as f32 + self.eps).sqrt();
        for (v, g) in acc.iter_mut().zip(self.gamma) {
            *v = *v * inv * g;
        }
        let scale = if self.out_dtype == DType::F8E4M3 {
            let amax = acc.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = fp8_scale(amax);
            acc.iter_mut().for_each(|v| *v /= scale);
            scale
        } else {
            1.0
        };
        rows::store(out, acc, self.out_dtype);
        scale
    }
}

/// The per-token scale that maps the row's largest magnitude onto fp8's largest value
/// (1 for a row of zeros, or of non-finite values, whose quantised form is then theirs).
pub(crate) fn fp8_scale(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        amax / F8E4M3::MAX
    } else {
        1.0
    }
}
