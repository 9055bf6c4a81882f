// Element types of reductions as device code sees them: raw bits and their f32 value.
// `F32`, `F16`, `Bf16`, `I16` and `U16` each give `Raw` (the stored bits: u32 or u16), `get` /
// `put` (to and from f32, where every reduction computes) and `avg` (the average of `ranks`
// values from their f32 sum); f16_to_f32, f32_to_f16, bf16_to_f32 and f32_to_bf16 are the
// conversions beneath them. Plain integer code, no half-precision headers, so the same bits
// come out of nvcc, NVRTC, hipcc and the host device. Used by reduce_copy.cuh and by
// ferrocomm's own collective kernels; fp8.cuh adds the 8-bit float types.
//
// The 16-bit integers compute in f32 too, exactly: a sum of up to 256 of them is an integer
// below 2^24. `put` keeps the low 16 bits of the (integer) value, so sums wrap as the host's do
// (host/contracts/reduce.rs), and `avg` divides the wrapped sum, truncating, as the host does.
#pragma once
#include "ferrocomm/device.cuh"

namespace ferrocomm {

using u16 = unsigned short;

// f16 <-> f32 and bf16 <-> f32 by bit manipulation, identical on CUDA, HIP and NVRTC (no
// half-precision headers), rounding to nearest even like the host's `half` crate.
FERROCOMM_DEVICE_INLINE float f16_to_f32(u16 h) {
  const u32 sign = static_cast<u32>(h & 0x8000u) << 16;
  const u32 exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

FERROCOMM_DEVICE_INLINE u16 f32_to_f16(float f) {
  const u32 x = __float_as_uint(f);
  const u32 sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<u16>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return static_cast<u16>(sign | 0x7c00u);  // rounds to infinity
  if (ax < 0x38800000u) {
    // Subnormal (or zero) in f16: units of 2^-24, rounded to nearest even; 1024 is the
    // smallest normal, which the same bits encode.
    const u32 m = static_cast<u32>(rintf(__uint_as_float(ax) * 16777216.0f));
    return static_cast<u16>(sign | m);
  }
  u32 h = ((((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu));
  const u32 rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;  // a carry may reach infinity
  return static_cast<u16>(sign | h);
}

FERROCOMM_DEVICE_INLINE float bf16_to_f32(u16 b) { return __uint_as_float(static_cast<u32>(b) << 16); }

FERROCOMM_DEVICE_INLINE u16 f32_to_bf16(float f) {
  const u32 x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<u16>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<u16>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Element types as their raw bits and their f32 value.
struct F32 {
  using Raw = u32;
  static FERROCOMM_DEVICE_INLINE float get(Raw r) { return __uint_as_float(r); }
  static FERROCOMM_DEVICE_INLINE Raw put(float f) { return __float_as_uint(f); }
  static FERROCOMM_DEVICE_INLINE Raw avg(float sum, i32 ranks) { return put(sum / static_cast<float>(ranks)); }
};
struct F16 {
  using Raw = u16;
  static FERROCOMM_DEVICE_INLINE float get(Raw r) { return f16_to_f32(r); }
  static FERROCOMM_DEVICE_INLINE Raw put(float f) { return f32_to_f16(f); }
  static FERROCOMM_DEVICE_INLINE Raw avg(float sum, i32 ranks) { return put(sum / static_cast<float>(ranks)); }
};
struct Bf16 {
  using Raw = u16;
  static FERROCOMM_DEVICE_INLINE float get(Raw r) { return bf16_to_f32(r); }
  static FERROCOMM_DEVICE_INLINE Raw put(float f) { return f32_to_bf16(f); }
  static FERROCOMM_DEVICE_INLINE Raw avg(float sum, i32 ranks) { return put(sum / static_cast<float>(ranks)); }
};
// i16 as its bits; `put` takes an f32 that holds an integer.
struct I16 {
  using Raw = u16;
  static FERROCOMM_DEVICE_INLINE float get(Raw r) {
    return static_cast<float>(static_cast<i32>(r) - ((r & 0x8000u) ? 0x10000 : 0));
  }
  static FERROCOMM_DEVICE_INLINE Raw put(float f) { return static_cast<Raw>(static_cast<u32>(static_cast<i32>(f))); }
  static FERROCOMM_DEVICE_INLINE Raw avg(float sum, i32 ranks) {
    const i32 wrapped = static_cast<i32>(get(put(sum)));
    return static_cast<Raw>(static_cast<u32>(wrapped / ranks));
  }
};
struct U16 {
  using Raw = u16;
  static FERROCOMM_DEVICE_INLINE float get(Raw r) { return static_cast<float>(r); }
  static FERROCOMM_DEVICE_INLINE Raw put(float f) { return static_cast<Raw>(static_cast<u32>(static_cast<i32>(f))); }
  static FERROCOMM_DEVICE_INLINE Raw avg(float sum, i32 ranks) {
    return static_cast<Raw>(static_cast<u32>(put(sum)) / static_cast<u32>(ranks));
  }
};

}  // namespace ferrocomm
