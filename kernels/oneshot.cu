// One-shot collectives on a window (the device backend's own path for small messages):
// all_reduce, all_gather, reduce_scatter, all_to_all.
//
// Each rank copies its input into its own segment, signals every peer, waits for every peer's
// signal, then reads what it needs from every segment: all_reduce and reduce_scatter reduce in
// rank order 0, 1, ..., n-1, so every rank computes the same bits; all_gather copies. Reductions
// accumulate in f32 (f16 and bf16 are widened); accesses are 16 bytes wide where the buffers
// allow it.
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

// One block's share of `n` elements of `V` per 16 bytes: whole 16-byte groups, so only the
// last block has a tail. Vectors cover [lo, vhi), scalars [vhi, hi).
struct Share {
  u64 lo, vhi, hi;
};

template <u64 V>
FERROCOMM_DEVICE_INLINE Share share_of(u64 n, u32 vectors) {
  const u64 groups = (n + V - 1) / V;
  const u64 per = (groups + gridDim.x - 1) / gridDim.x;
  const u64 lo = min(n, blockIdx.x * per * V), hi = min(n, (blockIdx.x + 1) * per * V);
  return Share{lo, vectors ? max(lo, min(hi, (n / V) * V)) : lo, hi};
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

// The synchronisation of one block of a one-shot collective (see the top of the file).
struct Step {
  u64 epoch;
  u32 ready, done;
};

// Takes this block's epoch, then waits until every peer has read our part of the previous one.
FERROCOMM_DEVICE_INLINE bool begin(const Window& w, const u64* counters, Step& s) {
  // Only this block of this rank writes its counter, at its very end.
  s = Step{counters[blockIdx.x] + 1, blockIdx.x, FERROCOMM_COLL_MAX_BLOCKS + blockIdx.x};
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != w.rank() && !w.wait_signal(coop_block(), s.done, p, Cmp::Ge, s.epoch - 1).ok) return false;
  }
  return true;
}

// Our part is in our segment: tell every peer, then wait for theirs.
FERROCOMM_DEVICE_INLINE bool exchange(const Window& w, const Step& s) {
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != w.rank()) w.signal(coop_block(), p, s.ready, SignalOp::Set, s.epoch);
  }
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != w.rank() && !w.wait_signal(coop_block(), s.ready, p, Cmp::Ge, s.epoch).ok) return false;
  }
  return true;
}

// We have read every peer's part of this epoch.
FERROCOMM_DEVICE_INLINE void end(const Window& w, u64* counters, const Step& s) {
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != w.rank()) w.signal(coop_block(), p, s.done, SignalOp::Set, s.epoch);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = s.epoch;
}

// out[i] = the reduction of element `base + i` over every rank's segment, over the share.
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void reduce_share(const Window& w, u64 base, void* out, Share sh) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  Raw* dst = static_cast<Raw*>(out);
  for (u64 g = sh.lo / V + threadIdx.x; g < sh.vhi / V; g += blockDim.x) {
    reinterpret_cast<uint4*>(dst)[g] = reduce_vec<E, OP>(w, base, g);
  }
  for (u64 i = sh.vhi + threadIdx.x; i < sh.hi; i += blockDim.x) dst[i] = reduce_one<E, OP>(w, base, i);
}

// out = the reduction of every rank's `in` (n elements; in == out allowed).
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void all_reduce(const ferrocomm_window_handle& h, const void* in, void* out, u64 n,
                                        u64* counters, u32 vectors) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  const Window w(h);
  const Share sh = share_of<V>(n, vectors);
  Step s;
  if (!begin(w, counters, s)) return;
  copy_share(w.local_ptr<Raw>(0), static_cast<const Raw*>(in), sh);
  if (!exchange(w, s)) return;
  reduce_share<E, OP>(w, 0, out, sh);
  end(w, counters, s);
}

// out[r * n_bytes ...] = rank r's `in` (n_bytes each).
FERROCOMM_DEVICE_INLINE void all_gather(const ferrocomm_window_handle& h, const void* in, void* out, u64 n_bytes,
                                        u64* counters, u32 vectors) {
  const Window w(h);
  const Share sh = share_of<16>(n_bytes, vectors);
  Step s;
  if (!begin(w, counters, s)) return;
  copy_share(w.local_ptr<unsigned char>(0), static_cast<const unsigned char*>(in), sh);
  if (!exchange(w, s)) return;
  for (i32 r = 0; r < w.size(); ++r) {
    copy_share(static_cast<unsigned char*>(out) + r * n_bytes, w.peer_ptr<const unsigned char>(r, 0), sh);
  }
  end(w, counters, s);
}

// Block r of `out` = block `rank` of rank r's `in` (size blocks of n_bytes each).
FERROCOMM_DEVICE_INLINE void all_to_all(const ferrocomm_window_handle& h, const void* in, void* out, u64 n_bytes,
                                        u64* counters, u32 vectors) {
  using Byte = unsigned char;
  const Window w(h);
  const Share sh = share_of<16>(n_bytes, vectors);
  Step s;
  if (!begin(w, counters, s)) return;
  for (i32 r = 0; r < w.size(); ++r) {
    copy_share(w.local_ptr<Byte>(0) + r * n_bytes, static_cast<const Byte*>(in) + r * n_bytes, sh);
  }
  if (!exchange(w, s)) return;
  const u64 mine = static_cast<u64>(w.rank()) * n_bytes;
  for (i32 r = 0; r < w.size(); ++r) {
    copy_share(static_cast<Byte*>(out) + r * n_bytes, w.peer_ptr<const Byte>(r, 0) + mine, sh);
  }
  end(w, counters, s);
}

// out (n elements) = the reduction over ranks of block `rank` of their `in` (size x n).
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void reduce_scatter(const ferrocomm_window_handle& h, const void* in, void* out, u64 n,
                                            u64* counters, u32 vectors) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  const Window w(h);
  const Share sh = share_of<V>(n, vectors);
  Step s;
  if (!begin(w, counters, s)) return;
  // Our share of every block goes into our segment.
  for (i32 r = 0; r < w.size(); ++r) {
    copy_share(w.local_ptr<Raw>(0) + r * n, static_cast<const Raw*>(in) + r * n, sh);
  }
  if (!exchange(w, s)) return;
  reduce_share<E, OP>(w, static_cast<u64>(w.rank()) * n, out, sh);
  end(w, counters, s);
}

}  // namespace

// Every kernel: (window handle, input, output, count, per-block epoch counters, vector flag).
#define FERROCOMM_ONESHOT(name, E, OP)                                                                 \
  extern "C" __global__ void __launch_bounds__(256, 1) ferrocomm_allreduce_oneshot_##name(            \
      ferrocomm_window_handle h, const void* in, void* out, u64 n, u64* counters, u32 vectors) {      \
    all_reduce<E, OP>(h, in, out, n, counters, vectors);                                                \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(256, 1) ferrocomm_reducescatter_oneshot_##name(        \
      ferrocomm_window_handle h, const void* in, void* out, u64 n, u64* counters, u32 vectors) {      \
    reduce_scatter<E, OP>(h, in, out, n, counters, vectors);                                            \
  }

extern "C" __global__ void __launch_bounds__(256, 1)
    ferrocomm_alltoall_oneshot(ferrocomm_window_handle h, const void* in, void* out, u64 n_bytes, u64* counters,
                               u32 vectors) {
  all_to_all(h, in, out, n_bytes, counters, vectors);
}

extern "C" __global__ void __launch_bounds__(256, 1)
    ferrocomm_allgather_oneshot(ferrocomm_window_handle h, const void* in, void* out, u64 n_bytes, u64* counters,
                                u32 vectors) {
  all_gather(h, in, out, n_bytes, counters, vectors);
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
