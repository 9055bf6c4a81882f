// One-shot all_reduce on a window (the device backend's own path for small messages).
//
// Each rank copies its input into its own segment, signals every peer, waits for every peer's
// signal, then reads all segments and reduces them in rank order 0, 1, ..., n-1, so every rank
// computes the same bits. Accumulation is in f32 (f16 and bf16 are widened), accesses are 16
// bytes wide where the buffers allow it.
//
// Synchronisation follows docs/memory-model.md: per block b, signal id b says "my part b is in
// my segment" (epoch e), id FERROCOMM_COLL_MAX_BLOCKS + b says "I have read your part b of
// epoch e". A call first waits until every peer has read the previous epoch's part, so no
// segment is overwritten while it is still being read. Epochs come from a per-rank,
// per-block counter in device memory that the kernel itself advances: they only grow, and a
// CUDA graph replaying the kernel gets a fresh epoch each time.

#include "ferrocomm/ferrocomm.cuh"

using namespace ferrocomm;

#define FERROCOMM_COLL_MAX_BLOCKS 16

namespace {

using u16 = unsigned short;

enum : u32 { REDUCE_SUM = 0, REDUCE_MIN = 1, REDUCE_MAX = 2, REDUCE_AVG = 3 };

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
};
struct F16 {
  using Raw = u16;
  static FERROCOMM_DEVICE_INLINE float get(Raw r) { return f16_to_f32(r); }
  static FERROCOMM_DEVICE_INLINE Raw put(float f) { return f32_to_f16(f); }
};
struct Bf16 {
  using Raw = u16;
  static FERROCOMM_DEVICE_INLINE float get(Raw r) { return bf16_to_f32(r); }
  static FERROCOMM_DEVICE_INLINE Raw put(float f) { return f32_to_bf16(f); }
};

template <u32 OP>
FERROCOMM_DEVICE_INLINE float combine(float a, float b) {
  if (OP == REDUCE_MIN) return fminf(a, b);
  if (OP == REDUCE_MAX) return fmaxf(a, b);
  return a + b;
}

// The reduction of element i over every rank's segment, in rank order.
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE typename E::Raw reduce_one(const Window& w, u64 i) {
  float acc = E::get(w.peer_ptr<typename E::Raw>(0, 0)[i]);
  for (i32 r = 1; r < w.size(); ++r) acc = combine<OP>(acc, E::get(w.peer_ptr<typename E::Raw>(r, 0)[i]));
  if (OP == REDUCE_AVG) acc /= static_cast<float>(w.size());
  return E::put(acc);
}

// Element k of 16 bytes, and the 32-bit word that holds elements k (and k + 1 for 16-bit
// types); indices are compile-time after unrolling, so everything stays in registers.
FERROCOMM_DEVICE_INLINE u32 word_of(const uint4& v, int w) { return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w; }
FERROCOMM_DEVICE_INLINE void set_word(uint4& v, int w, u32 x) {
  if (w == 0) v.x = x;
  else if (w == 1) v.y = x;
  else if (w == 2) v.z = x;
  else v.w = x;
}
template <class Raw>
FERROCOMM_DEVICE_INLINE Raw lane(const uint4& v, int k) {
  if (sizeof(Raw) == 4) return static_cast<Raw>(word_of(v, k));
  const u32 w = word_of(v, k >> 1);
  return static_cast<Raw>((k & 1) ? (w >> 16) : (w & 0xffffu));
}

// The same for the 16 bytes at group g (16 / sizeof(Raw) elements).
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE uint4 reduce_vec(const Window& w, u64 g) {
  using Raw = typename E::Raw;
  constexpr int V = 16 / sizeof(Raw);
  float acc[V];
  const uint4 first = w.peer_ptr<const uint4>(0, 0)[g];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = E::get(lane<Raw>(first, k));
  for (i32 r = 1; r < w.size(); ++r) {
    const uint4 v = w.peer_ptr<const uint4>(r, 0)[g];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = combine<OP>(acc[k], E::get(lane<Raw>(v, k)));
  }
  uint4 o = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (OP == REDUCE_AVG) acc[k] /= static_cast<float>(w.size());
    const u32 bits = static_cast<u32>(E::put(acc[k]));
    if (sizeof(Raw) == 4) {
      set_word(o, k, bits);
    } else {
      set_word(o, k >> 1, word_of(o, k >> 1) | ((k & 1) ? bits << 16 : bits));
    }
  }
  return o;
}

template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void oneshot(const ferrocomm_window_handle& h, const void* in, void* out, u64 n,
                                     u64* counters, u32 vectors) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  const Window w(h);
  const auto block = coop_block();
  const u32 b = blockIdx.x;
  const i32 me = w.rank();

  // This block's elements: whole 16-byte groups, so only the last block has a tail.
  const u64 groups = (n + V - 1) / V;
  const u64 per = (groups + gridDim.x - 1) / gridDim.x;
  const u64 lo = min(n, b * per * V), hi = min(n, (b + 1) * per * V);
  // Vector part [lo, vhi), scalar tail [vhi, hi).
  const u64 vhi = vectors ? max(lo, min(hi, (n / V) * V)) : lo;

  // Only this block of this rank writes its counter, at its very end.
  const u64 epoch = counters[b] + 1;
  const u32 ready = b, done = FERROCOMM_COLL_MAX_BLOCKS + b;

  // 1. Every peer has finished reading our part of the previous epoch.
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != me && !w.wait_signal(block, done, p, Cmp::Ge, epoch - 1).ok) return;
  }
  // 2. Our contribution into our segment, then tell every peer.
  Raw* mine = w.local_ptr<Raw>(0);
  const Raw* src = static_cast<const Raw*>(in);
  for (u64 g = lo / V + threadIdx.x; g < vhi / V; g += blockDim.x) {
    reinterpret_cast<uint4*>(mine)[g] = reinterpret_cast<const uint4*>(src)[g];
  }
  for (u64 i = vhi + threadIdx.x; i < hi; i += blockDim.x) mine[i] = src[i];
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != me) w.signal(block, p, ready, SignalOp::Set, epoch);
  }
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != me && !w.wait_signal(block, ready, p, Cmp::Ge, epoch).ok) return;
  }
  // 3. Reduce every rank's part in rank order.
  Raw* dst = static_cast<Raw*>(out);
  for (u64 g = lo / V + threadIdx.x; g < vhi / V; g += blockDim.x) {
    reinterpret_cast<uint4*>(dst)[g] = reduce_vec<E, OP>(w, g);
  }
  for (u64 i = vhi + threadIdx.x; i < hi; i += blockDim.x) dst[i] = reduce_one<E, OP>(w, i);
  // 4. We have read every peer's part of this epoch.
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != me) w.signal(block, p, done, SignalOp::Set, epoch);
  }
  if (threadIdx.x == 0) counters[b] = epoch;
}

}  // namespace

#define FERROCOMM_ONESHOT(name, E, OP)                                                                  \
  extern "C" __global__ void __launch_bounds__(256, 1) ferrocomm_allreduce_oneshot_##name(                \
      ferrocomm_window_handle h, const void* in, void* out, u64 n, u64* counters, u32 vectors) {       \
    oneshot<E, OP>(h, in, out, n, counters, vectors);                                                    \
  }

FERROCOMM_ONESHOT(f32_sum, F32, REDUCE_SUM)
FERROCOMM_ONESHOT(f32_min, F32, REDUCE_MIN)
FERROCOMM_ONESHOT(f32_max, F32, REDUCE_MAX)
FERROCOMM_ONESHOT(f32_avg, F32, REDUCE_AVG)
FERROCOMM_ONESHOT(f16_sum, F16, REDUCE_SUM)
FERROCOMM_ONESHOT(f16_min, F16, REDUCE_MIN)
FERROCOMM_ONESHOT(f16_max, F16, REDUCE_MAX)
FERROCOMM_ONESHOT(f16_avg, F16, REDUCE_AVG)
FERROCOMM_ONESHOT(bf16_sum, Bf16, REDUCE_SUM)
FERROCOMM_ONESHOT(bf16_min, Bf16, REDUCE_MIN)
FERROCOMM_ONESHOT(bf16_max, Bf16, REDUCE_MAX)
FERROCOMM_ONESHOT(bf16_avg, Bf16, REDUCE_AVG)
