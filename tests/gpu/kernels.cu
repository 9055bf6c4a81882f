// Kernels of the GPU window tests (tests/gpu_windows.rs), compiled at run time through
// ferrocomm::device::compile, and by scripts/check-kernels.sh with nvcc and hipcc, so every
// verb is instantiated at thread, warp and block scope on both vendors.
#include "ferrocomm/ferrocomm.cuh"

using namespace ferrocomm;

// The test pattern: word i of iteration `it` from rank `r`, a mix of a per-run random seed.
__device__ __forceinline__ u64 pattern(u64 seed, i32 r, u32 it, u64 i) {
  u64 x = seed ^ (static_cast<u64>(r) << 48) ^ (static_cast<u64>(it) << 32) ^ i;
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Ring: every iteration, fill `tile` (words u64) with this rank's pattern, put it to the right
// neighbour at offset 0 with signal 0 = it + 1; wait for the left neighbour's signal, check its
// tile word by word (mismatches counted into *wrong), then acknowledge on signal 1 so the left
// neighbour may overwrite. Scratch `tile` is this rank's own device buffer.
template <class Coop>
__device__ void ring(Coop c, const ferrocomm_window_handle& h, u64* tile, u64 words, u32 iters, u64 seed,
                     unsigned long long* wrong) {
  Window w(h);
  const i32 right = (w.rank() + 1) % w.size(), left = (w.rank() + w.size() - 1) % w.size();
  for (u32 it = 0; it < iters; ++it) {
    for (u64 i = c.thread_rank(); i < words; i += c.size()) tile[i] = pattern(seed, w.rank(), it, i);
    c.sync();
    if (it > 0 && !w.wait_signal(c, 1, right, Cmp::Ge, it).ok) return;
    w.put_signal(c, right, 0, tile, words * 8, 0, SignalOp::Set, it + 1);
    if (!w.wait_signal(c, 0, left, Cmp::Ge, it + 1).ok) return;
    const u64* got = w.local_ptr<u64>(0);
    unsigned long long bad = 0;
    for (u64 i = c.thread_rank(); i < words; i += c.size()) bad += got[i] != pattern(seed, left, it, i);
    if (bad) atomicAdd(wrong, bad);
    w.signal(c, left, 1, SignalOp::Set, it + 1);
  }
}

#define RING(scope)                                                                                          \
  extern "C" __global__ void ring_##scope(ferrocomm_window_handle h, u64* tile, u64 words, u32 iters, u64 seed, \
                                          unsigned long long* wrong) {                                       \
    ring(coop_##scope(), h, tile, words, iters, seed, wrong);                                                \
  }
RING(thread)
RING(warp)
RING(block)

// get: copy `words` u64 from `peer`'s segment into `dst` with the given scope.
#define GET(scope)                                                                                       \
  extern "C" __global__ void get_##scope(ferrocomm_window_handle h, i32 peer, u64* dst, u64 words) {     \
    Window(h).get(coop_##scope(), peer, 0, dst, words * 8);                                              \
  }
GET(thread)
GET(warp)
GET(block)

// Barrier rounds: in round k every rank stores k + 1 into word `rank` of every peer, meets
// the others at a barrier, then checks that its own words 0..size all read k + 1.
extern "C" __global__ void barrier_rounds(ferrocomm_window_handle h, u32 rounds, unsigned long long* wrong) {
  Window w(h);
  CoopBlock b = coop_block();
  for (u32 k = 0; k < rounds; ++k) {
    if (b.thread_rank() < static_cast<u32>(w.size())) {
      *w.peer_ptr<u64>(b.thread_rank(), static_cast<u64>(w.rank()) * 8) = k + 1;
    }
    if (!w.barrier(b)) return;
    if (b.thread_rank() < static_cast<u32>(w.size()) && *w.local_ptr<u64>(b.thread_rank() * 8ull) != k + 1) {
      atomicAdd(wrong, 1ull);
    }
    if (!w.barrier(b)) return;
  }
}

// A wait nobody satisfies: must end by the handle's deadline with ok = false.
extern "C" __global__ void wait_forever(ferrocomm_window_handle h, u64* out) {
  Observed o = Window(h).wait_signal(coop_block(), 0, SOURCE_SUM, Cmp::Ge, ~0ull);
  if (threadIdx.x == 0) out[0] = o.ok;
}

// Every thread adds 1 to word 0 of rank 0, `adds` times.
extern "C" __global__ void fetch_add_storm(ferrocomm_window_handle h, u32 adds) {
  Window w(h);
  for (u32 i = 0; i < adds; ++i) w.fetch_add(0, 0, 1);
}

// One block-scope put_signal of `bytes` from `src` to `peer`'s offset `dst`, signal `id` set
// to `value`: a put the proxy refuses must send no signal, and the block must still leave.
extern "C" __global__ void put_signal_block(ferrocomm_window_handle h, i32 peer, u64 dst, const u64* src, u64 bytes,
                                            u32 id, u64 value) {
  Window(h).put_signal(coop_block(), peer, dst, src, bytes, id, SignalOp::Set, value);
}

// One verb with the caller's arguments, for the verbs' argument checks: 0 put (block, from
// `scratch`), 1 get (block, into `scratch`), 2 signal (block), 3 put_signal (block), 4
// wait_signal (block, source `peer`, for 0), 5 fetch_add, 6 compare_swap, 7 read_signal
// (source `peer`). A refused verb must touch nothing and return at once.
extern "C" __global__ void one_verb(ferrocomm_window_handle h, u32 verb, i32 peer, u64 offset, u64 bytes, u32 id,
                                    u64* scratch) {
  const Window w(h);
  const bool first = threadIdx.x == 0;
  switch (verb) {
    case 0: w.put(coop_block(), peer, offset, scratch, bytes); break;
    case 1: w.get(coop_block(), peer, offset, scratch, bytes); break;
    case 2: w.signal(coop_block(), peer, id, SignalOp::Add, 1); break;
    case 3: w.put_signal(coop_block(), peer, offset, scratch, bytes, id, SignalOp::Add, 1); break;
    case 4: w.wait_signal(coop_block(), id, peer, Cmp::Ge, 0); break;
    case 5: if (first) w.fetch_add(peer, offset, 1); break;
    case 6: if (first) w.compare_swap(peer, offset, 0, 1); break;
    case 7: if (first) scratch[0] = w.read_signal(id, peer); break;
  }
}

// Warp-scope wait by ANY and block-scope fence / flush, so every verb is instantiated.
extern "C" __global__ void wait_any_warp(ferrocomm_window_handle h, u32 id, u64 value, u64* out) {
  Window w(h);
  w.fence(coop_warp());
  w.flush(coop_block());
  Observed o = w.wait_signal(coop_warp(), id, SOURCE_ANY, Cmp::Ge, value);
  if (threadIdx.x == 0) {
    out[0] = o.ok;
    out[1] = static_cast<u64>(static_cast<unsigned int>(o.source));
    out[2] = o.value;
  }
}

// Multicast (in the tests, a team of one GPU): each thread stores 16-byte groups of small
// floats through the window's multicast address, then reads each back through its own
// segment's address and load-reduces it (one segment: the sum is the value itself). Counts
// wrong groups in `wrong`; bit 32 and up say the kernel could not run at all (no multicast
// address, or no multimem instructions for this target).
extern "C" __global__ void multicast_roundtrip(ferrocomm_window_handle h, u64 groups, u32 seed,
                                               unsigned long long* wrong) {
#if FERROCOMM_HAS_MULTIMEM
  Window w(h);
  unsigned char* mc = multicast_ptr<unsigned char>(w, 0);
  if (mc == nullptr) {
    if (threadIdx.x == 0) atomicAdd(wrong, 1ull << 32);
    return;
  }
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  auto value = [&](u64 g) {
    const u32 base = (static_cast<u32>(g) * 2654435761u) ^ seed;
    return make_uint4(__float_as_uint(static_cast<float>(base & 1023u)), __float_as_uint(static_cast<float>((base >> 10) & 1023u)),
                      __float_as_uint(static_cast<float>((base >> 20) & 1023u)), __float_as_uint(0.5f));
  };
  for (u64 g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) multimem_store(mc + g * 16, value(g));
  multimem_fence();
  for (u64 g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const uint4 want = value(g);
    const uint4 plain = w.local_ptr<const uint4>(0)[g];
    const uint4 reduced = multimem_sum_f32x4(mc + g * 16);
    const bool same = plain.x == want.x && plain.y == want.y && plain.z == want.z && plain.w == want.w &&
                      reduced.x == want.x && reduced.y == want.y && reduced.z == want.z && reduced.w == want.w;
    if (!same) atomicAdd(wrong, 1ull);
  }
#else
  if (threadIdx.x == 0) atomicAdd(wrong, 2ull << 32);
#endif
}

// A user's fused kernel built from the collectives' primitives (reduce_copy.cuh, dtype.cuh):
// out[i] = (sum over ranks of window a's element i) + (max over ranks of window b's element
// i), each reduction rounded to E as the collectives round it, then added in f32; and
// `copy` = the right neighbour's segment of a. The grid cuts the n elements into per-block
// shares of whole 16-byte groups (vectorised) with a scalar tail. Reads only: the host has
// filled every segment and passed a barrier before the launch.
template <class E>
__device__ void fused_reduce(const ferrocomm_window_handle& ha, const ferrocomm_window_handle& hb, u64 n,
                             typename E::Raw* out, typename E::Raw* copy) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  const Window a(ha), b(hb);
  // No verb below checks the handles for us: peer_ptr is unchecked.
  if (!a.abi_ok() || !b.abi_ok()) return;
  const Share sh = share_of<V>(n, 1);
  for (u64 g = sh.lo / V + threadIdx.x; g < sh.vhi / V; g += blockDim.x) {
    const uint4 sum = reduce_vec<E, REDUCE_SUM>(a, 0, g), most = reduce_vec<E, REDUCE_MAX>(b, 0, g);
#pragma unroll
    for (u64 k = 0; k < V; ++k) {
      out[g * V + k] = E::put(E::get(lane<Raw>(sum, static_cast<int>(k))) + E::get(lane<Raw>(most, static_cast<int>(k))));
    }
  }
  for (u64 i = sh.vhi + threadIdx.x; i < sh.hi; i += blockDim.x) {
    out[i] = E::put(E::get(reduce_one<E, REDUCE_SUM>(a, 0, i)) + E::get(reduce_one<E, REDUCE_MAX>(b, 0, i)));
  }
  copy_share(copy, a.peer_ptr<const Raw>((a.rank() + 1) % a.size(), 0), sh);
}

extern "C" __global__ void fused_reduce_f32(ferrocomm_window_handle a, ferrocomm_window_handle b, u64 n, u32* out,
                                            u32* copy) {
  fused_reduce<F32>(a, b, n, out, copy);
}
extern "C" __global__ void fused_reduce_bf16(ferrocomm_window_handle a, ferrocomm_window_handle b, u64 n,
                                             unsigned short* out, unsigned short* copy) {
  fused_reduce<Bf16>(a, b, n, out, copy);
}
extern "C" __global__ void fused_reduce_f16(ferrocomm_window_handle a, ferrocomm_window_handle b, u64 n,
                                            unsigned short* out, unsigned short* copy) {
  fused_reduce<F16>(a, b, n, out, copy);
}

// fp8.cuh's e4m3 both ways: out[i] = e4m3(in[i]) for i < n, decoded[c] = the value of
// code c for every code (256 floats).
extern "C" __global__ void e4m3_convert(const float* in, unsigned char* out, u64 n, float* decoded) {
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  for (u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = f32_to_e4m3(in[i]);
  for (u64 c = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; c < 256; c += stride) {
    decoded[c] = e4m3_to_f32(static_cast<unsigned char>(c));
  }
}

// fp8.cuh's e5m2 both ways, like e4m3_convert.
extern "C" __global__ void e5m2_convert(const float* in, unsigned char* out, u64 n, float* decoded) {
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  for (u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = f32_to_e5m2(in[i]);
  for (u64 c = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; c < 256; c += stride) {
    decoded[c] = e5m2_to_f32(static_cast<unsigned char>(c));
  }
}

// team.cuh as one thread sees it: out = [rank, size, local size, local rank, is_local(p) for p
// in -1 ..= size, local_peer(k) for k in 0 ..= size] (i32 each; 2 * size + 7 in all).
extern "C" __global__ void team_info(ferrocomm_window_handle h, i32* out) {
  const Window w(h);
  out[0] = team_rank(w);
  out[1] = team_size(w);
  out[2] = team_local_size(w);
  out[3] = team_local_rank(w);
  for (i32 p = -1; p <= w.size(); ++p) out[5 + p] = team_is_local(w, p);
  for (i32 k = 0; k <= w.size(); ++k) out[w.size() + 6 + k] = team_local_peer(w, k);
}

// Relaxed signals as counters: `adds` relaxed Adds of 1 on slot `id` of every peer, then a
// relaxed Set of 1000 + rank on slot id + 1; then the coop waits until the sum of its slot
// `id` reaches adds * (size - 1) and until every peer's slot id + 1 holds 1000 + peer.
// out = [ok, the sum it saw].
template <class Coop>
__device__ void relaxed_counters(Coop c, const ferrocomm_window_handle& h, u32 id, u32 adds, u64* out) {
  const Window w(h);
  for (u32 k = 0; k < adds; ++k) {
    for (i32 p = 0; p < w.size(); ++p) {
      if (p != w.rank()) w.signal_relaxed(c, p, id, SignalOp::Add, 1);
    }
  }
  for (i32 p = 0; p < w.size(); ++p) {
    if (p != w.rank()) w.signal_relaxed(c, p, id + 1, SignalOp::Set, 1000 + static_cast<u64>(w.rank()));
  }
  const Observed sum = w.wait_signal(c, id, SOURCE_SUM, Cmp::Ge, static_cast<u64>(adds) * (w.size() - 1));
  bool ok = sum.ok;
  for (i32 p = 0; p < w.size() && ok; ++p) {
    if (p != w.rank()) ok = w.wait_signal(c, id + 1, p, Cmp::Eq, 1000 + static_cast<u64>(p)).ok;
  }
  if (c.thread_rank() == 0) {
    out[0] = ok;
    out[1] = sum.value;
  }
}

#define RELAXED(scope)                                                                                        \
  extern "C" __global__ void relaxed_counters_##scope(ferrocomm_window_handle h, u32 id, u32 adds, u64* out) { \
    relaxed_counters(coop_##scope(), h, id, adds, out);                                                     \
  }
RELAXED(thread)
RELAXED(warp)
RELAXED(block)
