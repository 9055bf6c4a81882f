// Who executes a call: a coop is one thread, one warp or one block. Verbs take a coop; its
// threads share the data movement, `sync` joins them, and the leader issues the one release
// or acquire of the call (docs/memory-model.md, "Scopes of the device API").
#pragma once
#include "ferrocomm/device.cuh"

namespace ferrocomm {

struct CoopThread {
  FERROCOMM_DEVICE_INLINE u32 thread_rank() const { return 0; }
  FERROCOMM_DEVICE_INLINE u32 size() const { return 1; }
  FERROCOMM_DEVICE_INLINE void sync() const {}
  FERROCOMM_DEVICE_INLINE bool is_leader() const { return true; }
};

// All lanes of the calling warp must call (the block's x dimension a multiple of the warp).
struct CoopWarp {
  FERROCOMM_DEVICE_INLINE u32 thread_rank() const {
    u32 linear = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    return linear % FERROCOMM_WARP_SIZE;
  }
  FERROCOMM_DEVICE_INLINE u32 size() const { return FERROCOMM_WARP_SIZE; }
  FERROCOMM_DEVICE_INLINE void sync() const { FERROCOMM_SYNC_WARP(); }
  FERROCOMM_DEVICE_INLINE bool is_leader() const { return thread_rank() == 0; }
};

// All threads of the block must call.
struct CoopBlock {
  FERROCOMM_DEVICE_INLINE u32 thread_rank() const {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  }
  FERROCOMM_DEVICE_INLINE u32 size() const { return blockDim.x * blockDim.y * blockDim.z; }
  FERROCOMM_DEVICE_INLINE void sync() const { FERROCOMM_SYNC_BLOCK(); }
  FERROCOMM_DEVICE_INLINE bool is_leader() const { return thread_rank() == 0; }
};

FERROCOMM_DEVICE_INLINE CoopThread coop_thread() { return CoopThread{}; }
FERROCOMM_DEVICE_INLINE CoopWarp coop_warp() { return CoopWarp{}; }
FERROCOMM_DEVICE_INLINE CoopBlock coop_block() { return CoopBlock{}; }

// Shares the leader's value with the whole coop. The block form uses one shared slot per
// call site type; callers sync before reusing it, which every verb here does.
FERROCOMM_DEVICE_INLINE u64 broadcast(CoopThread, u64 v) { return v; }
FERROCOMM_DEVICE_INLINE u64 broadcast(CoopWarp, u64 v) {
#if FERROCOMM_HIP
  return __shfl(v, 0);
#else
  return __shfl_sync(0xffffffffu, v, 0);
#endif
}
FERROCOMM_DEVICE_INLINE u64 broadcast(CoopBlock b, u64 v) {
  FERROCOMM_SHARED(u64, slot);
  if (b.is_leader()) slot = v;
  b.sync();
  u64 out = slot;
  b.sync();
  return out;
}

}  // namespace ferrocomm
