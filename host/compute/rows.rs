//! Rows of f32, f16, bf16 or fp8 e4m3 elements in byte buffers, read as and written from f32.
//! Each function runs its AVX2 copy where it can (see `wide_where_possible!`).

use crate::contracts::dtype::DType;
use crate::contracts::fp8::F8E4M3;
use half::f16;

wide_where_possible! {
    /// `acc[j] += src[j]` for a row of `dtype` elements in `src`'s bytes, in f32.
    fn add_into(acc: &mut [f32], src: &[u8], dtype: DType) = add_into_body
}

#[inline(always)]
fn add_into_body(acc: &mut [f32], src: &[u8], dtype: DType) {
    debug_assert_eq!(src.len(), acc.len() * dtype.size());
    match dtype {
        DType::F32 => zip(acc, src, 4, |a, b| *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::F16 => zip(acc, src, 2, |a, b| *a += f16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::BF16 => zip(acc, src, 2, |a, b| *a += bf16_to_f32([b[0], b[1]])),
        DType::F8E4M3 => zip(acc, src, 1, |a, b| *a += F8E4M3::from_bits(b[0]).to_f32()),
        other => unreachable!("rows of {other} are refused by the operations' validation"),
    }
}

wide_where_possible! {
    /// `acc[j] = src[j]` for a row of `dtype` elements, each exactly as f32 (an f32 row keeps
    /// its bits; unlike `load`, which adds to zeros, -0.0 stays -0.0).
    fn load_into(acc: &mut [f32], src: &[u8], dtype: DType) = load_into_body
}

#[inline(always)]
fn load_into_body(acc: &mut [f32], src: &[u8], dtype: DType) {
    debug_assert_eq!(src.len(), acc.len() * dtype.size());
    match dtype {
        DType::F32 => zip(acc, src, 4, |a, b| *a = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::F16 => zip(acc, src, 2, |a, b| *a = f16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::BF16 => zip(acc, src, 2, |a, b| *a = bf16_to_f32([b[0], b[1]])),
        DType::F8E4M3 => zip(acc, src, 1, |a, b| *a = F8E4M3::from_bits(b[0]).to_f32()),
        other => unreachable!("rows of {other} are refused by the operations' validation"),
    }
}

wide_where_possible! {
    /// `acc[j] = fma(w, src[j], acc[j])` in f32: one rounding per term, as the device kernels'
    /// `fmaf` (kernels/moe.cu), so both backends' combines give the same bits.
    fn add_scaled_into(acc: &mut [f32], src: &[u8], dtype: DType, w: f32) = add_scaled_body
}

#[inline(always)]
fn add_scaled_body(acc: &mut [f32], src: &[u8], dtype: DType, w: f32) {
    debug_assert_eq!(src.len(), acc.len() * dtype.size());
    match dtype {
        DType::F32 => zip(acc, src, 4, |a, b| {
            *a = w.mul_add(f32::from_le_bytes([b[0], b[1], b[2], b[3]]), *a)
        }),
        DType::F16 => zip(acc, src, 2, |a, b| {
            *a = w.mul_add(f16::from_le_bytes([b[0], b[1]]).to_f32(), *a)
        }),
        DType::BF16 => zip(acc, src, 2, |a, b| *a = w.mul_add(bf16_to_f32([b[0], b[1]]), *a)),
        DType::F8E4M3 => zip(acc, src, 1, |a, b| *a = w.mul_add(F8E4M3::from_bits(b[0]).to_f32(), *a)),
        other => unreachable!("rows of {other} are refused by the operations' validation"),
    }
}

wide_where_possible! {
    /// Writes `vals` rounded to `dtype` (to nearest even; fp8 saturates) into `dst`'s bytes.
    fn store(dst: &mut [u8], vals: &[f32], dtype: DType) = store_body
}

#[inline(always)]
fn store_body(dst: &mut [u8], vals: &[f32], dtype: DType) {
    debug_assert_eq!(dst.len(), vals.len() * dtype.size());
    match dtype {
        DType::F32 => put(dst, vals, 4, |d, v| d.copy_from_slice(&v.to_le_bytes())),
        DType::F16 => put(dst, vals, 2, |d, v| d.copy_from_slice(&f16::from_f32(v).to_le_bytes())),
        DType::BF16 => put(dst, vals, 2, |d, v| d.copy_from_slice(&f32_to_bf16(v))),
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

/// A bf16's value: `half::bf16::to_f32` (a NaN gets its quiet bit) without a branch, so that
/// a row's loop vectorises.
#[inline(always)]
fn bf16_to_f32(le: [u8; 2]) -> f32 {
    let h = u16::from_le_bytes(le) as u32;
    let nan = ((h & 0x7FFF) > 0x7F80) as u32;
    f32::from_bits((h | nan << 6) << 16)
}

/// `v` rounded to bf16 (to nearest even; a NaN keeps its top bits and gets the quiet bit), as
/// `half::bf16::from_f32` computes it, without a branch.
#[inline(always)]
fn f32_to_bf16(v: f32) -> [u8; 2] {
    let x = v.to_bits();
    let nan = (x & 0x7FFF_FFFF) > 0x7F80_0000;
    // Round up when the dropped half is above a half unit, or exactly half and the kept part odd.
    let up = ((x & 0x8000) != 0) & ((x & 0x1_7FFF) != 0);
    let rounded = (x >> 16) + up as u32;
    let bits = if nan { (x >> 16) | 0x40 } else { rounded };
    (bits as u16).to_le_bytes()
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Every bf16 code widens as `half` widens it, NaNs included.
    #[test]
    fn bf16_widening_is_halfs_for_every_code() {
        for h in 0..=u16::MAX {
            let want = bf16::from_bits(h).to_f32().to_bits();
            assert_eq!(bf16_to_f32(h.to_le_bytes()).to_bits(), want, "code {h:#06x}");
        }
    }

    /// f32 values round to bf16 as `half` rounds them: every top half with the low halves that
    /// decide the rounding (0, just below, at and just above a half unit, the odd/even tie,
    /// the largest), and a stride through all 2^32 bit patterns.
    #[test]
    fn bf16_rounding_is_halfs() {
        let lows = [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF];
        let check = |x: u32| {
            let v = f32::from_bits(x);
            let want = bf16::from_f32(v).to_bits();
            assert_eq!(u16::from_le_bytes(f32_to_bf16(v)), want, "f32 bits {x:#010x}");
        };
        for high in 0..=0xFFFFu32 {
            lows.iter().for_each(|&low| check(high << 16 | low));
        }
        (0..=u32::MAX).step_by(9973).for_each(check);
    }

    /// Random rows with specials: the wide copy and the baseline body give the same bits.
    #[test]
    fn the_wide_copies_give_the_baseline_bits() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 32) as u32
        };
        let specials = [
            0u32,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0001,
            0x7F80_0001,
            1,
            0x0080_0000,
        ];
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F8E4M3] {
            for n in [1usize, 7, 64, 1000] {
                let vals: Vec<f32> = (0..n)
                    .map(|i| match i % 5 {
                        0 => f32::from_bits(specials[(next() as usize) % specials.len()]),
                        1 => f32::from_bits(next()),
                        _ => (next() as f32 / u32::MAX as f32 - 0.5) * 1000.0,
                    })
                    .collect();
                let src: Vec<u8> = (0..n * dtype.size()).map(|_| next() as u8).collect();
                let w = f32::from_bits(next() & 0x3FFF_FFFF);
                let (mut a, mut b) = (vals.clone(), vals.clone());
                add_into(&mut a, &src, dtype);
                add_into_body(&mut b, &src, dtype);
                assert_eq!(bits(&a), bits(&b), "add_into {dtype} {n}");
                add_scaled_into(&mut a, &src, dtype, w);
                add_scaled_body(&mut b, &src, dtype, w);
                assert_eq!(bits(&a), bits(&b), "add_scaled_into {dtype} {n}");
                load_into(&mut a, &src, dtype);
                load_into_body(&mut b, &src, dtype);
                assert_eq!(bits(&a), bits(&b), "load_into {dtype} {n}");
                let (mut da, mut db) = (vec![0u8; n * dtype.size()], vec![1u8; n * dtype.size()]);
                store(&mut da, &vals, dtype);
                store_body(&mut db, &vals, dtype);
                assert_eq!(da, db, "store {dtype} {n}");
            }
        }
    }

    /// The bits of each element, every NaN as one: where both operands of an add are NaN,
    /// IEEE 754 lets either one's payload and sign through, and an optimised build may swap the
    /// operands of one path and not the other's (seen in a release build: the wide add kept
    /// the source's NaN 0xFFE80000, the baseline the accumulator's 0x7FC00001).
    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter()
            .map(|x| if x.is_nan() { f32::NAN.to_bits() } else { x.to_bits() })
            .collect()
    }
}
