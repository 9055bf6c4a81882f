// The two 8-bit float types, as CUDA has them (__nv_fp8_e4m3, __nv_fp8_e5m2), by bit
// manipulation (no cuda_fp8.h), so nvcc, NVRTC, hipcc and the host device give the same bits
// as the host's reference (host/contracts/fp8.rs):
//
// - fp8 e4m3 (`E4M3`, `f32_to_e4m3`, `e4m3_to_f32`): the OCP "fn" variant: no infinities, one
//   NaN per sign, largest finite value 448;
// - fp8 e5m2 (`E5M2`, `f32_to_e5m2`, `e5m2_to_f32`): the upper byte of an f16, infinities and
//   NaNs included, largest finite value 57344.
//
// Conversions from f32 round to nearest even, once (e5m2 is not rounded through f16, which
// would round twice), and saturate to the largest finite value, infinities too, as CUDA's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...) does; NaN stays NaN (the NaN code of x's
// sign). Decoding is exact. The element types are dtype.cuh's kind: `Raw` is the byte.
#pragma once
#include "ferrocomm/dtype.cuh"

namespace ferrocomm {

using u8 = unsigned char;

// ---- fp8 e4m3 ----

// fp8 e4m3's largest finite value.
constexpr float E4M3_MAX = 448.0f;

// `x` rounded to nearest (ties to even) to e4m3, saturating to +-448 (infinities too); NaN
// gives the NaN code of x's sign. Scaling by powers of two is exact and rintf rounds to nearest
// even, so this is host/contracts/fp8.rs's F8E4M3::from_f32 step by step.
FERROCOMM_DEVICE_INLINE u8 f32_to_e4m3(float x) {
  const u32 bits = __float_as_uint(x);
  const u32 sign = (bits >> 24) & 0x80u, abits = bits & 0x7fffffffu;
  if (abits > 0x7f800000u) return static_cast<u8>(sign | 0x7fu);
  const float a = __uint_as_float(abits);
  if (a >= E4M3_MAX) return static_cast<u8>(sign | 0x7eu);
  // Below 2^-6 e4m3 is subnormal: multiples of 2^-9 (a code of 8 is the smallest normal).
  if (abits < 0x3c800000u) return static_cast<u8>(sign | static_cast<u32>(rintf(a * 512.0f)));
  i32 e = static_cast<i32>(abits >> 23) - 127;                                     // -6..8
  u32 q = static_cast<u32>(rintf(a * __uint_as_float(static_cast<u32>(127 + 3 - e) << 23)));  // 8..16
  if (q == 16) {
    q = 8;
    e += 1;
  }
  const u32 code = (static_cast<u32>(e + 7) << 3) | (q - 8);
  return static_cast<u8>(sign | (code < 0x7eu ? code : 0x7eu));
}

// The value of an e4m3 code (exact).
FERROCOMM_DEVICE_INLINE float e4m3_to_f32(u8 b) {
  const u32 sign = static_cast<u32>(b & 0x80u) << 24;
  const u32 exp = (b >> 3) & 0xfu, man = b & 7u;
  if (exp == 15 && man == 7) return __uint_as_float(sign | 0x7fc00000u);
  if (exp == 0) {
    const float v = static_cast<float>(man) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// fp8 e4m3 as an element type (next to dtype.cuh's F32, F16, Bf16, I16, U16).
struct E4M3 {
  using Raw = u8;
  static FERROCOMM_DEVICE_INLINE float get(Raw r) { return e4m3_to_f32(r); }
  static FERROCOMM_DEVICE_INLINE Raw put(float f) { return f32_to_e4m3(f); }
  static FERROCOMM_DEVICE_INLINE Raw avg(float sum, i32 ranks) { return put(sum / static_cast<float>(ranks)); }
};

// ---- fp8 e5m2 ----

// fp8 e5m2's largest finite value.
constexpr float E5M2_MAX = 57344.0f;

// `x` rounded to nearest (ties to even) to e5m2, saturating to +-57344 (infinities too); NaN
// gives the NaN code of x's sign. host/contracts/fp8.rs's F8E5M2::from_f32 step by step, as
// f32_to_e4m3 is F8E4M3's.
FERROCOMM_DEVICE_INLINE u8 f32_to_e5m2(float x) {
  const u32 bits = __float_as_uint(x);
  const u32 sign = (bits >> 24) & 0x80u, abits = bits & 0x7fffffffu;
  if (abits > 0x7f800000u) return static_cast<u8>(sign | 0x7fu);
  const float a = __uint_as_float(abits);
  if (a >= E5M2_MAX) return static_cast<u8>(sign | 0x7bu);
  // Below 2^-14 e5m2 is subnormal: multiples of 2^-16 (a code of 4 is the smallest normal).
  if (abits < 0x38800000u) return static_cast<u8>(sign | static_cast<u32>(rintf(a * 65536.0f)));
  i32 e = static_cast<i32>(abits >> 23) - 127;                                     // -14..15
  u32 q = static_cast<u32>(rintf(a * __uint_as_float(static_cast<u32>(127 + 2 - e) << 23)));  // 4..8
  if (q == 8) {
    q = 4;
    e += 1;
  }
  const u32 code = (static_cast<u32>(e + 15) << 2) | (q - 4);
  return static_cast<u8>(sign | (code < 0x7bu ? code : 0x7bu));
}

// The value of an e5m2 code (exact): the f16 whose upper byte it is.
FERROCOMM_DEVICE_INLINE float e5m2_to_f32(u8 b) { return f16_to_f32(static_cast<u16>(static_cast<u16>(b) << 8)); }

// fp8 e5m2 as an element type.
struct E5M2 {
  using Raw = u8;
  static FERROCOMM_DEVICE_INLINE float get(Raw r) { return e5m2_to_f32(r); }
  static FERROCOMM_DEVICE_INLINE Raw put(float f) { return f32_to_e5m2(f); }
  static FERROCOMM_DEVICE_INLINE Raw avg(float sum, i32 ranks) { return put(sum / static_cast<float>(ranks)); }
};

}  // namespace ferrocomm
