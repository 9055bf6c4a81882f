// Building blocks of reductions and copies over a window's segments, the ones ferrocomm's own
// collectives (one-shot, two-shot, multimem, all_to_all) are made of, for users' fused kernels:
//
// - reduce ops: REDUCE_SUM / MIN / MAX / AVG, `combine<OP>` on f32 values and `finish<E, OP>`
//   (the element from the f32 accumulator: `E::avg` for averages, else `E::put`);
// - `reduce_one<E, OP>` and `reduce_vec<E, OP>`: the reduction over every rank's segment, in
//   rank order 0, 1, ..., size - 1 (so every rank computes the same bits), of one element or
//   of one 16-byte group, with `word_of` / `set_word` / `lane` to take a uint4 apart
//   (elements of 2 or 4 bytes);
// - `Share`, `share_of`, `copy_share`, `Slices`, `reduce_share`: how a grid cuts `n` elements
//   into per-block shares of whole 16-byte groups (only the last block has a scalar tail), and
//   block-wide copies and reductions over one share.
//
// These are data movement only (weak loads and stores through peer pointers): they read a
// peer's segment safely only after an acquire that observed the peer's release of that data
// (wait_signal, barrier; docs/memory-model.md). The share functions are block scope: every
// thread of the block calls, and the cut follows blockIdx / gridDim.
#pragma once
#include "ferrocomm/dtype.cuh"
#include "ferrocomm/window.cuh"

namespace ferrocomm {

enum : u32 { REDUCE_SUM = 0, REDUCE_MIN = 1, REDUCE_MAX = 2, REDUCE_AVG = 3 };

template <u32 OP>
FERROCOMM_DEVICE_INLINE float combine(float a, float b) {
  if (OP == REDUCE_MIN) return fminf(a, b);
  if (OP == REDUCE_MAX) return fmaxf(a, b);
  return a + b;
}

// The element of a reduction whose f32 accumulator over `ranks` values is `acc`.
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE typename E::Raw finish(float acc, i32 ranks) {
  return OP == REDUCE_AVG ? E::avg(acc, ranks) : E::put(acc);
}

// The reduction of element `base + i` over every rank's segment, in rank order.
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE typename E::Raw reduce_one(const Window& w, u64 base, u64 i) {
  float acc = E::get(w.peer_ptr<typename E::Raw>(0, 0)[base + i]);
  for (i32 r = 1; r < w.size(); ++r) acc = combine<OP>(acc, E::get(w.peer_ptr<typename E::Raw>(r, 0)[base + i]));
  return finish<E, OP>(acc, w.size());
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
    const u32 bits = static_cast<u32>(finish<E, OP>(acc[k], w.size()));
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

}  // namespace ferrocomm
