// What the library's collective kernels share (kernels/oneshot.cu, twoshot.cu,
// alltoall.cu): element types and their f32 conversions, rank-ordered reductions over a
// window's segments with 16-byte accesses, how a grid cuts a message into per-block shares,
// and the per-block epoch protocol.
//
// Synchronisation follows docs/memory-model.md. A collective window's signal ids come in
// groups of MAX_BLOCKS, one id per block: READY_ID + b says "my part b is in my segment"
// (epoch e), DONE_ID + b "I have read your part b of epoch e", REDUCED_ID + b (two-shot) "my
// reduced slice b of epoch e is in my segment"; FILLED_ID and CONSUMED_ID belong to the
// all_to_all kernel's own protocol and region. A call first waits until every peer has read
// what earlier calls left in our segment, so no segment is overwritten while it is still read.
// Epochs come from a per-rank, per-block counter in device memory that the kernels advance
// themselves: they only grow, and a CUDA graph replaying a kernel gets a fresh epoch each time.
// All of this assumes one call at a time per window: the host orders calls issued on
// different streams (host/backend/device/call_order.rs).
#pragma once
#include "ferrocomm/ferrocomm.cuh"

namespace ferrocomm {
namespace coll {

// host/backend/device/collectives.rs mirrors these.
constexpr u32 MAX_BLOCKS = 16;
constexpr u32 MAX_RANKS = 16;
constexpr u32 READY_ID = 0, DONE_ID = MAX_BLOCKS, REDUCED_ID = 2 * MAX_BLOCKS;
constexpr u32 FILLED_ID = 3 * MAX_BLOCKS, CONSUMED_ID = 4 * MAX_BLOCKS;

// One device pointer per rank, by value in the kernel's parameters (so a CUDA graph keeps it):
// the parts of an all_gather's output or a reduce_scatter's input may lie anywhere.
struct Parts {
  u64 ptr[MAX_RANKS];
};


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

// The reduction of element `base + i` over every rank's segment, in rank order.
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE typename E::Raw reduce_one(const Window& w, u64 base, u64 i) {
  float acc = E::get(w.peer_ptr<typename E::Raw>(0, 0)[base + i]);
  for (i32 r = 1; r < w.size(); ++r) acc = combine<OP>(acc, E::get(w.peer_ptr<typename E::Raw>(r, 0)[base + i]));
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

// The same for the 16 bytes at group g after element `base` (16 / sizeof(Raw) elements;
// `base` keeps the groups 16-byte aligned).
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE uint4 reduce_vec(const Window& w, u64 base, u64 g) {
  using Raw = typename E::Raw;
  constexpr int V = 16 / sizeof(Raw);
  float acc[V];
  const uint4 first = reinterpret_cast<const uint4*>(w.peer_ptr<Raw>(0, 0) + base)[g];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = E::get(lane<Raw>(first, k));
  for (i32 r = 1; r < w.size(); ++r) {
    const uint4 v = reinterpret_cast<const uint4*>(w.peer_ptr<Raw>(r, 0) + base)[g];
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

// One block's share of `n` elements of `V` per 16 bytes starting at element `off` (a multiple
// of V): whole 16-byte groups, so only the last block has a tail. Vectors cover [lo, vhi),
// scalars [vhi, hi), in absolute element indices.
struct Share {
  u64 lo, vhi, hi;
};

template <u64 V>
FERROCOMM_DEVICE_INLINE Share share_of(u64 n, u32 vectors, u64 off = 0) {
  const u64 groups = (n + V - 1) / V;
  const u64 per = (groups + gridDim.x - 1) / gridDim.x;
  const u64 lo = min(n, blockIdx.x * per * V), hi = min(n, (blockIdx.x + 1) * per * V);
  return Share{off + lo, off + (vectors ? max(lo, min(hi, (n / V) * V)) : lo), off + hi};
}

// dst[i] = src[i] over the share (both 16-byte aligned where vectors are used).
template <class Raw>
FERROCOMM_DEVICE_INLINE void copy_share(Raw* dst, const Raw* src, Share s) {
  constexpr u64 V = 16 / sizeof(Raw);
  for (u64 g = s.lo / V + threadIdx.x; g < s.vhi / V; g += blockDim.x) {
    reinterpret_cast<uint4*>(dst)[g] = reinterpret_cast<const uint4*>(src)[g];
  }
  for (u64 i = s.vhi + threadIdx.x; i < s.hi; i += blockDim.x) dst[i] = src[i];
}

// The cut of the two-shot and multimem all_reduce: one slice of whole 16-byte groups per rank
// of the `n` elements. Block b handles share b of every slice, so READY / REDUCED of block b
// cover exactly the bytes block b of each peer reads.
template <u64 V>
struct Slices {
  u64 n, slice;
  u32 vectors;
  FERROCOMM_DEVICE_INLINE Slices(u64 n_, u64 ranks, u32 vectors_)
      : n(n_), slice(((n_ + V - 1) / V + ranks - 1) / ranks * V), vectors(vectors_) {}
  // This block's share of slice r.
  FERROCOMM_DEVICE_INLINE Share share(u64 r) const {
    const u64 lo = min(n, r * slice);
    return share_of<V>(min(n, lo + slice) - lo, vectors, lo);
  }
};

// The synchronisation of one block of a one- or two-shot collective (see the top of the file).
struct Step {
  u64 epoch;
  u32 ready, done, reduced;
};

// Takes this block's epoch, then waits until every peer has read what any block of an earlier
// call left in our segment: the blocks of the last call that used block j's share signalled
// DONE_j with epoch counters[j]. Calls with fewer blocks cut the segment differently, so one
// block's own DONE would not cover the bytes it is about to overwrite. The threads wait on the
// (peer, block) pairs in parallel.
FERROCOMM_DEVICE_INLINE bool begin(const Window& w, u64* counters, Step& s) {
  s = Step{load_relaxed(&counters[blockIdx.x]) + 1, READY_ID + blockIdx.x, DONE_ID + blockIdx.x,
           REDUCED_ID + blockIdx.x};
  bool ok = true;
  const u32 pairs = static_cast<u32>(w.size()) * MAX_BLOCKS;
  for (u32 k = threadIdx.x; k < pairs; k += blockDim.x) {
    const i32 p = static_cast<i32>(k / MAX_BLOCKS);
    const u32 j = k % MAX_BLOCKS;
    // Another block may advance counters[j] meanwhile: either value is safe to wait for.
    const u64 last = load_relaxed(&counters[j]);
    if (p != w.rank() && last != 0) ok &= w.wait_signal(coop_thread(), DONE_ID + j, p, Cmp::Ge, last).ok;
  }
  return FERROCOMM_SYNC_BLOCK_AND(ok);
}

// Every peer gets `id` = this epoch from us, then we wait for theirs.
FERROCOMM_DEVICE_INLINE bool exchange(const Window& w, const Step& s, u32 id) {
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != w.rank()) w.signal(coop_block(), p, id, SignalOp::Set, s.epoch);
  }
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != w.rank() && !w.wait_signal(coop_block(), id, p, Cmp::Ge, s.epoch).ok) return false;
  }
  return true;
}

// We have read every peer's part of this epoch.
FERROCOMM_DEVICE_INLINE void end(const Window& w, u64* counters, const Step& s) {
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != w.rank()) w.signal(coop_block(), p, s.done, SignalOp::Set, s.epoch);
  }
  if (threadIdx.x == 0) store_release(&counters[blockIdx.x], s.epoch);
}

// out[i] (and also[i] unless null) = the reduction of element `base + i` over every rank's
// segment, over the share.
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void reduce_share(const Window& w, u64 base, void* out, void* also, Share sh) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  Raw* dst = static_cast<Raw*>(out);
  Raw* dst2 = static_cast<Raw*>(also);
  for (u64 g = sh.lo / V + threadIdx.x; g < sh.vhi / V; g += blockDim.x) {
    const uint4 v = reduce_vec<E, OP>(w, base, g);
    reinterpret_cast<uint4*>(dst)[g] = v;
    if (dst2) reinterpret_cast<uint4*>(dst2)[g] = v;
  }
  for (u64 i = sh.vhi + threadIdx.x; i < sh.hi; i += blockDim.x) {
    const Raw v = reduce_one<E, OP>(w, base, i);
    dst[i] = v;
    if (dst2) dst2[i] = v;
  }
}

}  // namespace coll
}  // namespace ferrocomm

// Every (name suffix, element type, reduce op) the reducing kernels are built for; the host
// (host/backend/device/collectives.rs, `suffix`) loads them by these suffixes.
#define FERROCOMM_FOR_EACH_REDUCTION(M) \
  M(f32_sum, F32, REDUCE_SUM)           \
  M(f32_min, F32, REDUCE_MIN)           \
  M(f32_max, F32, REDUCE_MAX)           \
  M(f32_avg, F32, REDUCE_AVG)           \
  M(f16_sum, F16, REDUCE_SUM)           \
  M(f16_min, F16, REDUCE_MIN)           \
  M(f16_max, F16, REDUCE_MAX)           \
  M(f16_avg, F16, REDUCE_AVG)           \
  M(bf16_sum, Bf16, REDUCE_SUM)         \
  M(bf16_min, Bf16, REDUCE_MIN)         \
  M(bf16_max, Bf16, REDUCE_MAX)         \
  M(bf16_avg, Bf16, REDUCE_AVG)
