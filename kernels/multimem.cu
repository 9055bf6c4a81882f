// Multimem all_reduce (NVLink SHARP): the switch reduces. For windows with a multicast object
// (every rank on a GPU of its own behind NVSwitch; device-api multimem.cuh).
//
// The message is cut into one slice per rank, as in the two-shot. Each rank copies its input
// into its segment and signals READY; rank r then load-reduces slice r through the multicast
// address (the switch returns the reduction over every segment) and stores the result back
// through it, which writes slice r of every segment, and signals REDUCED; last, every rank
// copies the reduced message out of its own segment. Each slice is reduced once and
// broadcast, so every rank gets the same bits; each rank's GPU moves 2/n of the message over
// NVLink instead of the two-shot's 2 (n-1)/n. The protocol (epochs, ids, segment reuse) is in
// collective.cuh; the proxy fences around the signals order the multicast accesses against the
// unicast ones (docs/memory-model.md, "Multicast").
//
// Accesses through the multicast address are whole 16-byte groups: the last group of a
// message whose size is not a multiple of 16 bytes also reduces the padding after it in the
// segment (the window's data region is a multiple of 16 bytes), which no one copies out.

#include "collective.cuh"

using namespace ferrocomm;
using namespace ferrocomm::coll;

// The (name suffix, element type, reduce op, load-reduce) pairs the switch reduces (avg: the
// sum, divided afterwards); host/backend/device/collectives.rs (`multimem_suffix`) loads them.
#define FERROCOMM_FOR_EACH_SWITCH_REDUCTION(M)    \
  M(f32_sum, F32, REDUCE_SUM, multimem_sum_f32x4)   \
  M(f32_avg, F32, REDUCE_AVG, multimem_sum_f32x4)   \
  M(f16_sum, F16, REDUCE_SUM, multimem_sum_f16x8)   \
  M(f16_min, F16, REDUCE_MIN, multimem_min_f16x8)   \
  M(f16_max, F16, REDUCE_MAX, multimem_max_f16x8)   \
  M(bf16_sum, Bf16, REDUCE_SUM, multimem_sum_bf16x8) \
  M(bf16_min, Bf16, REDUCE_MIN, multimem_min_bf16x8) \
  M(bf16_max, Bf16, REDUCE_MAX, multimem_max_bf16x8)

namespace {

#if FERROCOMM_HAS_MULTIMEM

// The switch's load-reduce of 16 bytes for element type E and reduce op OP (avg: the sum,
// divided afterwards like reduce_vec does). Only the pairs the switch has are defined; the
// host launches no other.
template <class E, u32 OP>
struct SwitchReduce;

#define FERROCOMM_SWITCH_REDUCE(name, E, OP, fn) \
  template <>                                    \
  struct SwitchReduce<E, OP> {                   \
    static FERROCOMM_DEVICE_INLINE uint4 load(const void* mc) { return fn(mc); } \
  };
FERROCOMM_FOR_EACH_SWITCH_REDUCTION(FERROCOMM_SWITCH_REDUCE)
#undef FERROCOMM_SWITCH_REDUCE

template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE uint4 switch_reduce(const void* mc, i32 ranks) {
  uint4 v = SwitchReduce<E, OP>::load(mc);
  if (OP == REDUCE_AVG) {
    // Only f32 averages here (see the host's plan): four lanes, one word each.
    for (int k = 0; k < 4; ++k) set_word(v, k, E::put(E::get(word_of(v, k)) / static_cast<float>(ranks)));
  }
  return v;
}

template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void all_reduce_multimem(const ferrocomm_window_handle& h, const void* in, void* out, u64 n,
                                                 u64* counters, u32 vectors) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  const Window w(h);
  if (!w.abi_ok()) return;
  unsigned char* mc = multicast_ptr<unsigned char>(w, 0);
  if (mc == nullptr) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      record_status(h.status, FERROCOMM_STATUS_INVALID, FERROCOMM_OP_COLLECTIVE, -1, 0, 0, 0);
    return;
  }
  const u64 size = static_cast<u64>(w.size());
  const Slices<V> slices(n, size, vectors);
  auto share = [&](u64 r) { return slices.share(r); };
  Step s;
  if (!begin(w, counters, s)) return;
  for (u64 r = 0; r < size; ++r) copy_share(w.local_ptr<Raw>(0), static_cast<const Raw*>(in), share(r));
  multimem_fence();
  if (!exchange(w, s, s.ready)) return;
  multimem_fence();
  // The groups below are not the lanes this thread copied (scalar tails, and a world of one,
  // where exchange synchronises nothing).
  __syncthreads();
  // This block's share of our slice, in whole groups (share bounds are group-aligned, except
  // the message's end, which rounds up into the padding).
  const Share mine = share(static_cast<u64>(w.rank()));
  for (u64 g = mine.lo / V + threadIdx.x; g < (mine.hi + V - 1) / V; g += blockDim.x) {
    multimem_store(mc + g * 16, switch_reduce<E, OP>(mc + g * 16, w.size()));
  }
  multimem_fence();
  if (!exchange(w, s, s.reduced)) return;
  multimem_fence();
  __syncthreads();
  for (u64 r = 0; r < size; ++r) copy_share(static_cast<Raw*>(out), w.local_ptr<const Raw>(0), share(r));
  end(w, counters, s);
}

#else

// No multimem instructions for this target: a handle here never has a multicast address.
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void all_reduce_multimem(const ferrocomm_window_handle& h, const void*, void*, u64, u64*,
                                                 u32) {
  if (blockIdx.x == 0 && threadIdx.x == 0)
    record_status(h.status, FERROCOMM_STATUS_INVALID, FERROCOMM_OP_COLLECTIVE, -1, 0, 0, 0);
}

#endif

}  // namespace

#define FERROCOMM_MULTIMEM(name, E, OP, fn)                                                            \
  extern "C" __global__ void __launch_bounds__(256, 1) ferrocomm_allreduce_multimem_##name(           \
      ferrocomm_window_handle h, const void* in, void* out, u64 n, u64* counters, u32 vectors) {      \
    all_reduce_multimem<E, OP>(h, in, out, n, counters, vectors);                                       \
  }

FERROCOMM_FOR_EACH_SWITCH_REDUCTION(FERROCOMM_MULTIMEM)
