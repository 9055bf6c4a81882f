// Multicast access to a window (NVLink SHARP, sm_90 and later behind NVSwitch): where the
// handle's `multicast` is nonzero, `Window::multicast_ptr(offset)` names byte `offset` of every
// rank's segment at once. A load-reduce there returns the reduction over all segments, done
// in the switch; a store there lands in every segment. Only these functions may touch a
// multicast address (PTX leaves any other access to it undefined).
//
// Ordering (docs/memory-model.md, "Multicast"): a multicast address aliases the segments'
// own addresses, so a writer issues `multimem_fence()` after its multicast stores and before
// the release signal that publishes them, and a reader issues it after the acquire that
// observed the signal and before it reads through the unicast address (and likewise in the
// other direction: unicast stores, fence, release; acquire, fence, multicast loads).
//
// All accesses are 16 bytes at a 16-byte aligned address. FERROCOMM_HAS_MULTIMEM is 1 where
// the instructions exist (CUDA device code for sm_90 and later); elsewhere these functions
// are absent, and a kernel must check it (a handle never carries a multicast address there:
// the driver reports no support).
#pragma once
#include "ferrocomm/window.cuh"

#if FERROCOMM_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FERROCOMM_HAS_MULTIMEM 1
#else
#define FERROCOMM_HAS_MULTIMEM 0
#endif

namespace ferrocomm {

// Byte `offset` of every rank's segment, or null when the window has no multicast object.
template <class T = void>
FERROCOMM_DEVICE_INLINE T* multicast_ptr(const Window& w, u64 offset) {
  const u64 base = w.handle().multicast;
  return base == 0 ? nullptr : reinterpret_cast<T*>(base + offset);
}

#if FERROCOMM_HAS_MULTIMEM

// Orders accesses through a multicast address against accesses to the same bytes through
// the segments' own addresses (PTX: proxy fence between virtual aliases).
FERROCOMM_DEVICE_INLINE void multimem_fence() { asm volatile("fence.proxy.alias;" ::: "memory"); }

// Stores 16 bytes into every segment (bits unchanged: f32 lanes are moved, not computed).
FERROCOMM_DEVICE_INLINE void multimem_store(void* mc, uint4 v) {
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(mc), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

#define FERROCOMM_MULTIMEM_LOAD_REDUCE(name, form)                                                           \
  FERROCOMM_DEVICE_INLINE uint4 name(const void* mc) {                                                      \
    uint4 v;                                                                                                 \
    asm volatile("multimem.ld_reduce.relaxed.sys.global." form " {%0, %1, %2, %3}, [%4];"                   \
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                                                \
                 : "l"(mc)                                                                                   \
                 : "memory");                                                                                \
    return v;                                                                                                \
  }

// The reduction over every segment of 16 bytes: 4 f32, or 8 f16 / bf16 (sums accumulate in
// f32, then round once). The switch has no f32 min / max.
FERROCOMM_MULTIMEM_LOAD_REDUCE(multimem_sum_f32x4, "add.v4.f32")
FERROCOMM_MULTIMEM_LOAD_REDUCE(multimem_sum_f16x8, "add.acc::f32.v4.f16x2")
FERROCOMM_MULTIMEM_LOAD_REDUCE(multimem_min_f16x8, "min.v4.f16x2")
FERROCOMM_MULTIMEM_LOAD_REDUCE(multimem_max_f16x8, "max.v4.f16x2")
FERROCOMM_MULTIMEM_LOAD_REDUCE(multimem_sum_bf16x8, "add.acc::f32.v4.bf16x2")
FERROCOMM_MULTIMEM_LOAD_REDUCE(multimem_min_bf16x8, "min.v4.bf16x2")
FERROCOMM_MULTIMEM_LOAD_REDUCE(multimem_max_bf16x8, "max.v4.bf16x2")

#undef FERROCOMM_MULTIMEM_LOAD_REDUCE

#endif  // FERROCOMM_HAS_MULTIMEM

}  // namespace ferrocomm
