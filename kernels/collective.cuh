// What the library's collective kernels share (kernels/oneshot.cu, twoshot.cu, multimem.cu,
// alltoall.cu) and users' kernels do not: the signal ids of a collective window, the per-block
// epoch protocol, and the kernels' size limits. The element types, reductions, copies and
// per-block shares they are built from are public device API (ferrocomm/dtype.cuh,
// ferrocomm/reduce_copy.cuh, both in the umbrella header).
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

// The synchronisation of one block of a one- or two-shot collective (see the top of the file).
struct Step {
  u64 epoch;
  u32 ready, done, reduced;
};

// Takes this block's epoch, then waits until every peer has read what any block of an earlier
// call left in our segment: the blocks of the last call that used block j's share signalled
// DONE_j with epoch counters[j]. Calls with fewer blocks cut the segment differently, so one
// block's own DONE would not cover the bytes it is about to overwrite. The threads wait on the
// (peer, block) pairs in parallel. False (and nothing touched) for a handle of another ABI.
FERROCOMM_DEVICE_INLINE bool begin(const Window& w, u64* counters, Step& s) {
  // Before any segment access: the collectives address segments through peer_ptr.
  if (!w.abi_ok()) return false;
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
  M(bf16_avg, Bf16, REDUCE_AVG)         \
  M(i16_sum, I16, REDUCE_SUM)           \
  M(i16_min, I16, REDUCE_MIN)           \
  M(i16_max, I16, REDUCE_MAX)           \
  M(i16_avg, I16, REDUCE_AVG)           \
  M(u16_sum, U16, REDUCE_SUM)           \
  M(u16_min, U16, REDUCE_MIN)           \
  M(u16_max, U16, REDUCE_MAX)           \
  M(u16_avg, U16, REDUCE_AVG)
