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
        self.add_residual(acc, residual);
        self.normalise(acc, out)
    }

    /// The first half of `row`: `acc += residual`, and the residual overwritten with `acc`
    /// rounded to `dtype`.
    pub(crate) fn add_residual(&self, acc: &mut [f32], residual: &mut [u8]) {
        rows::add_into(acc, residual, self.dtype);
        rows::store(residual, acc, self.dtype);
    }

    /// The second half of `row`: `acc` (the sum plus the residual, in f32) normalised, scaled
    /// by gamma and written to `out`; returns the fp8 scale (1 when `out` is not fp8). `acc` is
    /// left holding the values before their rounding to `out`.
    pub(crate) fn normalise(&self, acc: &mut [f32], out: &mut [u8]) -> f32 {
        normalise(self, acc, out)
    }
}

wide_where_possible! {
    /// `Norm::normalise`.
    fn normalise(norm: &Norm<'_>, acc: &mut [f32], out: &mut [u8]) -> f32 = normalise_body
}

#[inline(always)]
fn normalise_body(norm: &Norm<'_>, acc: &mut [f32], out: &mut [u8]) -> f32 {
    // Plain multiply and add (no fused multiply-add), one element after the other.
    let square = acc.iter().fold(0f32, |s, &v| s + v * v);
    let inv = 1.0 / (square / acc.len() as f32 + norm.eps).sqrt();
    for (v, g) in acc.iter_mut().zip(norm.gamma) {
        *v = *v * inv * g;
    }
    let scale = if norm.out_dtype == DType::F8E4M3 {
        let amax = acc.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = fp8_scale(amax);
        acc.iter_mut().for_each(|v| *v /= scale);
        scale
    } else {
        1.0
    };
    rows::store(out, acc, norm.out_dtype);
    scale
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Random rows, with a zero row and huge values: the wide copy gives the baseline bits.
    #[test]
    fn the_wide_copy_gives_the_baseline_bits() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for out_dtype in [DType::F32, DType::BF16, DType::F8E4M3] {
            for (n, magnitude) in [(1, 1.0), (129, 3.0), (4096, 1.0), (1000, 0.0), (64, 1e30)] {
                let gamma: Vec<f32> = (0..n).map(|_| next() + 1.0).collect();
                let acc: Vec<f32> = (0..n).map(|_| next() * magnitude).collect();
                let norm = Norm {
                    gamma: &gamma,
                    eps: 1e-6,
                    dtype: DType::F32,
                    out_dtype,
                };
                let (mut a, mut b) = (acc.clone(), acc);
                let (mut oa, mut ob) = (vec![0u8; n * out_dtype.size()], vec![1u8; n * out_dtype.size()]);
                let sa = norm.normalise(&mut a, &mut oa);
                let sb = normalise_body(&norm, &mut b, &mut ob);
                assert_eq!(sa.to_bits(), sb.to_bits(), "{out_dtype} {n}: scale");
                assert_eq!(oa, ob, "{out_dtype} {n}: out");
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{out_dtype} {n}"
                );
            }
        }
    }
}
