//! Rows of f32, f16, bf16 or fp8 e4m3 elements in byte buffers, read as and written from f32.

use crate::contracts::dtype::DType;
use crate::contracts::fp8::F8E4M3;
use half::{bf16, f16};

/// `acc[j] += src[j]` for a row of `dtype` elements in `src`'s bytes, in f32.
pub(crate) fn add_into(acc: &mut [f32], src: &[u8], dtype: DType) {
    debug_assert_eq!(src.len(), acc.len() * dtype.size());
    match dtype {
        DType::F32 => zip(acc, src, 4, |a, b| *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::F16 => zip(acc, src, 2, |a, b| *a += f16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::BF16 => zip(acc, src, 2, |a, b| *a += bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::F8E4M3 => zip(acc, src, 1, |a, b| *a += F8E4M3::from_bits(b[0]).to_f32()),
        other => unreachable!("rows of {other} are refused by the operations' validation"),
    }
}

/// `acc[j] = fma(w, src[j], acc[j])` in f32: one rounding per term, as the device kernels'
/// `fmaf` (kernels/moe.cu), so both backends' combines give the same bits.
pub(crate) fn add_scaled_into(acc: &mut [f32], src: &[u8], dtype: DType, w: f32) {
    match dtype {
        DType::F32 => zip(acc, src, 4, |a, b| {
            *a = w.mul_add(f32::from_le_bytes([b[0], b[1], b[2], b[3]]), *a)
        }),
        DType::F16 => zip(acc, src, 2, |a, b| {
            *a = w.mul_add(f16::from_le_bytes([b[0], b[1]]).to_f32(), *a)
        }),
        DType::BF16 => zip(acc, src, 2, |a, b| {
            *a = w.mul_add(bf16::from_le_bytes([b[0], b[1]]).to_f32(), *a)
        }),
        DType::F8E4M3 => zip(acc, src, 1, |a, b| *a = w.mul_add(F8E4M3::from_bits(b[0]).to_f32(), *a)),
        other => unreachable!("rows of {other} are refused by the operations' validation"),
    }
}

/// Writes `vals` rounded to `dtype` (to nearest even; fp8 saturates) into `dst`'s bytes.
pub(crate) fn store(dst: &mut [u8], vals: &[f32], dtype: DType) {
    debug_assert_eq!(dst.len(), vals.len() * dtype.size());
    match dtype {
        DType::F32 => put(dst, vals, 4, |d, v| d.copy_from_slice(&v.to_le_bytes())),
        DType::F16 => put(dst, vals, 2, |d, v| d.copy_from_slice(&f16::from_f32(v).to_le_bytes())),
        DType::BF16 => put(dst, vals, 2, |d, v| d.copy_from_slice(&bf16::from_f32(v).to_le_bytes())),
        DType::F8E4M3 => put(dst, vals, 1, |d, v| d[0] = F8E4M3::from_f32(v).to_bits()),
        other => unreachable!("rows of {other} are refused by the operations' validation"),
    }
}

/// The f32 values of a row.
pub(crate) fn load(src: &[u8], dtype: DType) -> Vec<f32> {
    let mut v = vec![0f32; src.len() / dtype.size()];
    add_into(&mut v, src, dtype);
    v
}

#[inline(always)]
fn zip(acc: &mut [f32], src: &[u8], width: usize, f: impl Fn(&mut f32, &[u8])) {
    for (a, b) in acc.iter_mut().zip(src.chunks_exact(width)) {
        f(a, b);
    }
}

#[inline(always)]
fn put(dst: &mut [u8], vals: &[f32], width: usize, f: impl Fn(&mut [u8], f32)) {
    for (d, &v) in dst.chunks_exact_mut(width).zip(vals) {
        f(d, v);
    }
}
