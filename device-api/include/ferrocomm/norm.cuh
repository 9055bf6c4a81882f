// Building blocks of fused norm kernels (ferrocomm's own all_reduce + residual + RMSNorm in
// kernels/fused_norm.cu is made of them), for users' kernels that fuse a norm with their own
// communication:
//
// - fp8 e4m3's per-row scale (`e4m3_scale`; the type itself, `E4M3`, is in fp8.cuh);
// - row groups (`RowGroups`, `load_group`, `store_group`, `reduce_group`): how a block cuts a row of `n`
//   elements among its threads: groups of V = 16 / sizeof(element) consecutive elements,
//   group g to thread g % blockDim.x. The cut does not depend on alignment: `vec` only picks
//   one 16-byte access per group instead of V scalar ones, so the arithmetic order, and the
//   bits, are the same either way; `reduce_group` sums one group over every rank's segment
//   in rank order;
// - block reductions (`block_sum`, `block_max`): every thread's value combined in a fixed
//   order (each thread's partial, a butterfly within each warp, then the warps in order), so
//   the same inputs give the same bits on every rank that launches the same block size;
// - `rmsnorm_row`: `out = s / sqrt(mean(s^2) + eps) * gamma` of one f32 row, rounded to the
//   output type, or quantised to fp8 with a per-row scale.
//
// Every function that takes a block does so at block scope: all threads of the block call it
// (the block size a multiple of the warp size). Element types are those of dtype.cuh plus E4M3.
#pragma once
#include "ferrocomm/dtype.cuh"
#include "ferrocomm/fp8.cuh"
#include "ferrocomm/reduce_copy.cuh"

namespace ferrocomm {

// ---- fp8 e4m3 scales ----

// The per-row scale that maps a row's largest magnitude `amax` onto 448: amax / 448, or 1 for a
// row of zeros or with a non-finite amax (whose quantised values are then their own).
FERROCOMM_DEVICE_INLINE float e4m3_scale(float amax) {
  const bool finite = (__float_as_uint(amax) & 0x7f800000u) != 0x7f800000u;
  return amax > 0.0f && finite ? amax / E4M3_MAX : 1.0f;
}

// ---- row groups ----

// The cut of a row of `n` elements of E among a block's threads: groups of V consecutive
// elements (the last one may be short), group g to thread g % blockDim.x. Loop with
// `for (u64 g = threadIdx.x; g < RowGroups<E>::count(n); g += blockDim.x)`.
template <class E>
struct RowGroups {
  static constexpr u32 V = 16 / sizeof(typename E::Raw);
  static FERROCOMM_DEVICE_INLINE u64 count(u64 n) { return (n + V - 1) / V; }
  // Elements in group g.
  static FERROCOMM_DEVICE_INLINE u32 size(u64 n, u64 g) { return static_cast<u32>(min(static_cast<u64>(V), n - g * V)); }
};

namespace detail {

// B bytes at p (B a multiple of 4; p aligned to min(B, 16)) as 32-bit words, and back.
template <u32 B>
FERROCOMM_DEVICE_INLINE void load_words(const void* p, u32 (&w)[B / 4]) {
  if constexpr (B >= 16) {
#pragma unroll
    for (u32 i = 0; i < B / 16; ++i) {
      const uint4 v = static_cast<const uint4*>(p)[i];
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (u32 i = 0; i < B / 4; ++i) w[i] = static_cast<const u32*>(p)[i];
  }
}

template <u32 B>
FERROCOMM_DEVICE_INLINE void store_words(void* p, const u32 (&w)[B / 4]) {
  if constexpr (B >= 16) {
#pragma unroll
    for (u32 i = 0; i < B / 16; ++i) {
      static_cast<uint4*>(p)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    }
  } else {
#pragma unroll
    for (u32 i = 0; i < B / 4; ++i) static_cast<u32*>(p)[i] = w[i];
  }
}

}  // namespace detail

// v[k] = element g * V + k of `row` as f32, for k < RowGroups::size (the rest 0). With `vec`
// a whole group is one access of V * sizeof(element) bytes: the row must be aligned to that
// (16 bytes at most) and its groups whole where vec is used, which the short last group is not.
template <class E, u32 V>
FERROCOMM_DEVICE_INLINE void load_group(const typename E::Raw* row, u64 n, u64 g, bool vec, float (&v)[V]) {
  using Raw = typename E::Raw;
  constexpr u32 B = V * sizeof(Raw);
  const u64 j = g * V;
  static_assert(B % 4 == 0, "a group is whole 32-bit words");
  if (vec && j + V <= n) {
    u32 w[B / 4];
    detail::load_words<B>(row + j, w);
#pragma unroll
    for (u32 k = 0; k < V; ++k) {
      const u32 word = w[k * sizeof(Raw) / 4], shift = (k * sizeof(Raw) % 4) * 8;
      v[k] = E::get(static_cast<Raw>(sizeof(Raw) == 4 ? word : (word >> shift) & ((1u << (8 * sizeof(Raw))) - 1u)));
    }
    return;
  }
#pragma unroll
  for (u32 k = 0; k < V; ++k) v[k] = j + k < n ? E::get(row[j + k]) : 0.0f;
}

// Element g * V + k of `row` = v[k] rounded to E, for k < RowGroups::size; `vec` as for load_group.
template <class E, u32 V>
FERROCOMM_DEVICE_INLINE void store_group(typename E::Raw* row, u64 n, u64 g, bool vec, const float (&v)[V]) {
  using Raw = typename E::Raw;
  constexpr u32 B = V * sizeof(Raw);
  const u64 j = g * V;
  static_assert(B % 4 == 0, "a group is whole 32-bit words");
  if (vec && j + V <= n) {
    u32 w[B / 4] = {};
#pragma unroll
    for (u32 k = 0; k < V; ++k) {
      const u32 shift = (k * sizeof(Raw) % 4) * 8;
      w[k * sizeof(Raw) / 4] |= static_cast<u32>(E::put(v[k])) << shift;
    }
    detail::store_words<B>(row + j, w);
    return;
  }
#pragma unroll
  for (u32 k = 0; k < V; ++k) {
    if (j + k < n) row[j + k] = E::put(v[k]);
  }
}

// acc[k] = the sum over ranks r = 0, 1, ..., size - 1, in that order, in f32 from 0, of element
// g * V + k of the row of `n` elements of E at byte `offset` of rank r's segment (k <
// RowGroups::size): the reduction of one group of a row-wise all_reduce. `vec` as for
// load_group (the offset keeps the row aligned). Read a peer's row only after an acquire that
// observed its release of it (reduce_copy.cuh).
template <class E, u32 V>
FERROCOMM_DEVICE_INLINE void reduce_group(const Window& w, u64 offset, u64 n, u64 g, bool vec, float (&acc)[V]) {
#pragma unroll
  for (u32 k = 0; k < V; ++k) acc[k] = 0.0f;
  for (i32 r = 0; r < w.size(); ++r) {
    float v[V];
    load_group<E>(w.peer_ptr<const typename E::Raw>(r, offset), n, g, vec, v);
#pragma unroll
    for (u32 k = 0; k < V; ++k) acc[k] += v[k];
  }
}

// ---- block reductions ----

// The value of lane (this lane ^ m) of the warp; every lane calls.
FERROCOMM_DEVICE_INLINE float shfl_xor(float v, u32 m) {
#if FERROCOMM_HIP
  return __shfl_xor(v, static_cast<int>(m));
#elif FERROCOMM_HOST
  return __shfl_sync(0xffffffffu, v, static_cast<int>(coop_warp().thread_rank() ^ m));  // (block_reduce avoids it)
#else
  return __shfl_xor_sync(0xffffffffu, v, static_cast<int>(m));
#endif
}

// `v` combined (REDUCE_SUM or REDUCE_MAX) over every thread of the block; every thread gets
// the same bits. A butterfly within each warp (at step m, lanes i and i ^ m combine the same
// two values, so all lanes agree: lane 0's tree, v[i] with v[i + m] for m = W/2, ..., 1), then
// the warps in order 0, 1, ...; the order depends only on the block size.
template <u32 OP>
FERROCOMM_DEVICE_INLINE float block_reduce(float v) {
  constexpr u32 W = FERROCOMM_WARP_SIZE;
  const u32 t = coop_block().thread_rank();
  const u32 warps = (coop_block().size() + W - 1) / W;
#if FERROCOMM_HOST
  // The same tree from shared memory: a shuffle costs the host device two warp barriers.
  using Values = float[1024];
  FERROCOMM_SHARED(Values, values);
  values[t] = v;
  FERROCOMM_SYNC_BLOCK();
  float all = 0.0f;
  for (u32 w = 0; w < warps; ++w) {
    float lane[W];
    for (u32 i = 0; i < W; ++i) lane[i] = values[w * W + i];
    for (u32 m = W / 2; m > 0; m /= 2) {
      for (u32 i = 0; i < m; ++i) lane[i] = combine<OP>(lane[i], lane[i + m]);
    }
    all = w == 0 ? lane[0] : combine<OP>(all, lane[0]);
  }
#else
  using Partials = float[1024 / W];
  FERROCOMM_SHARED(Partials, partials);
#pragma unroll
  for (u32 m = W / 2; m > 0; m /= 2) v = combine<OP>(v, shfl_xor(v, m));
  if (t % W == 0) partials[t / W] = v;
  FERROCOMM_SYNC_BLOCK();
  float all = partials[0];
  for (u32 w = 1; w < warps; ++w) all = combine<OP>(all, partials[w]);
#endif
  // Every thread has read the shared values before a next call writes them.
  FERROCOMM_SYNC_BLOCK();
  return all;
}

FERROCOMM_DEVICE_INLINE float block_sum(float v) { return block_reduce<REDUCE_SUM>(v); }
// The largest value (fmaxf: a NaN loses to any number).
FERROCOMM_DEVICE_INLINE float block_max(float v) { return block_reduce<REDUCE_MAX>(v); }

// ---- RMSNorm ----

// One row of RMSNorm at block scope: y[j] = s[j] * (1 / sqrt(mean_j s[j]^2 + eps)) * gamma[j]
// in f32 (the mean square summed per thread with fmaf over its groups in order, then
// block_sum), written to `out` rounded to O. With O = E4M3 the row is quantised: scale =
// e4m3_scale(max_j |y[j]|), out[j] = e4m3(y[j] / scale); the scale is returned (1 otherwise).
//
// `s` is f32, `gamma` of E (f32, f16 or bf16), `out` of O (E's type or E4M3); all `n`
// elements. The row is cut as RowGroups<E> cuts it, and every thread reads only the elements
// of s in its own groups: a caller that wrote s with the same cut needs no barrier before.
// `vec`: s, gamma and out aligned for whole-group accesses (load_group) and n a multiple of V.
template <class E, class O>
FERROCOMM_DEVICE_INLINE float rmsnorm_row(const float* s, const typename E::Raw* gamma, typename O::Raw* out, u64 n,
                                          float eps, bool vec) {
  using G = RowGroups<E>;
  constexpr u32 V = G::V;
  const u64 groups = G::count(n);
  float square = 0.0f;
  for (u64 g = threadIdx.x; g < groups; g += blockDim.x) {
    float v[V];
    load_group<F32>(reinterpret_cast<const u32*>(s), n, g, vec, v);
    const u32 c = G::size(n, g);
    for (u32 k = 0; k < c; ++k) square = fmaf(v[k], v[k], square);
  }
  const float inv = 1.0f / sqrtf(block_sum(square) / static_cast<float>(n) + eps);
  // y of group g, recomputed by each pass from the same inputs (the same bits).
  auto y = [&](u64 g, float(&v)[V]) {
    float gm[V];
    load_group<F32>(reinterpret_cast<const u32*>(s), n, g, vec, v);
    load_group<E>(gamma, n, g, vec, gm);
#pragma unroll
    for (u32 k = 0; k < V; ++k) v[k] = v[k] * inv * gm[k];
  };
  float scale = 1.0f;
  if (sizeof(typename O::Raw) == 1) {
    float amax = 0.0f;
    for (u64 g = threadIdx.x; g < groups; g += blockDim.x) {
      float v[V];
      y(g, v);
      const u32 c = G::size(n, g);
      for (u32 k = 0; k < c; ++k) amax = fmaxf(amax, fabsf(v[k]));
    }
    scale = e4m3_scale(block_max(amax));
  }
  for (u64 g = threadIdx.x; g < groups; g += blockDim.x) {
    float v[V];
    y(g, v);
    if (sizeof(typename O::Raw) == 1) {
#pragma unroll
      for (u32 k = 0; k < V; ++k) v[k] /= scale;
    }
    store_group<O>(out, n, g, vec, v);
  }
  return scale;
}

}  // namespace ferrocomm
