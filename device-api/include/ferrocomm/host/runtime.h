// The host device: CUDA's execution model on CPU threads, so that kernels/*.cu and the device
// API run on a machine without a GPU (device.cuh includes this when FERROCOMM_HOST_DEVICE is
// defined). One OS thread per CUDA thread; every block of a launch runs at once, so spin-waits
// across blocks and ranks make progress as on a GPU with all blocks resident; 32-lane warps;
// shared memory per block. The launcher that creates the threads is device-api/host/runtime.cpp.
//
// Memory orders: every ordered access of atomics.cuh maps to a GCC __atomic builtin of the same
// or a stronger order (docs/memory-model.md); the barriers here are acquire/release, as
// __syncthreads and __syncwarp order memory among the threads they join.
#pragma once
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <atomic>

namespace ferrocomm_host {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// A barrier of `size` threads: the last to arrive advances the generation. acq_rel on the
// arrival and release/acquire on the generation make every thread's earlier writes visible to
// every thread after it.
struct Barrier {
  std::atomic<unsigned> arrived{0};
  std::atomic<unsigned> generation{0};
  unsigned size = 0;

  void arrive_and_wait() {
    const unsigned gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == size) {
      arrived.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_release);
      generation.notify_all();
      return;
    }
    for (;;) {
      const unsigned now = generation.load(std::memory_order_acquire);
      if (now != gen) return;
      generation.wait(now, std::memory_order_acquire);
    }
  }
};

constexpr unsigned WARP = 32;

// One warp's lanes: a barrier and one exchange word per lane (shuffles, ballots).
struct Warp {
  Barrier barrier;
  std::atomic<unsigned long long> lane[WARP];
};

// One block: its barrier, its warps, its shared memory. The result words of
// __syncthreads_and rotate over three slots (see sync_block).
struct Block {
  Barrier barrier;
  Warp* warps = nullptr;
  std::atomic<int> all[3];
  unsigned char* shared = nullptr;
  unsigned long long shared_bytes = 0;
  // Static __shared__ variables: (tag, offset) pairs, first come first placed.
  std::atomic<int> shared_lock{0};
  const void* shared_tags[32] = {};
  unsigned long long shared_offsets[32] = {};
  unsigned shared_vars = 0;
  unsigned long long shared_used = 0;
};

struct Thread {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
  Block* block = nullptr;
  unsigned linear = 0;         // index in the block
  unsigned long long syncs = 0;  // block barriers passed (selects the __syncthreads_and slot)
};

inline thread_local Thread* current = nullptr;

inline Thread& self() { return *current; }

// __syncthreads / __syncthreads_and: every thread ANDs its predicate into the slot of this
// barrier, waits for all, reads the result. Slot k % 3 is reset to "true" after barrier k + 1,
// when every thread has read it, and is next used at barrier k + 3.
inline int sync_block(int pred) {
  Thread& t = self();
  Block& b = *t.block;
  const unsigned long long k = t.syncs++;
  if (!pred) b.all[k % 3].store(0, std::memory_order_relaxed);
  b.barrier.arrive_and_wait();
  const int result = b.all[k % 3].load(std::memory_order_relaxed);
  if (t.linear == 0 && k >= 1) b.all[(k + 2) % 3].store(1, std::memory_order_relaxed);
  return result;
}

inline Warp& warp() { return self().block->warps[self().linear / WARP]; }

inline void sync_warp() { warp().barrier.arrive_and_wait(); }

// Every lane publishes `v`, the warp meets, each lane reads `src`'s, the warp meets again so
// the words may be reused.
inline unsigned long long shuffle(unsigned long long v, unsigned src) {
  Warp& w = warp();
  w.lane[self().linear % WARP].store(v, std::memory_order_relaxed);
  w.barrier.arrive_and_wait();
  const unsigned long long out = w.lane[src % WARP].load(std::memory_order_relaxed);
  w.barrier.arrive_and_wait();
  return out;
}

inline unsigned ballot(int pred) {
  Warp& w = warp();
  const unsigned me = self().linear % WARP;
  w.lane[me].store(pred ? 1ull : 0ull, std::memory_order_relaxed);
  w.barrier.arrive_and_wait();
  unsigned bits = 0;
  for (unsigned l = 0; l < w.barrier.size; ++l) {
    if (w.lane[l].load(std::memory_order_relaxed)) bits |= 1u << l;
  }
  w.barrier.arrive_and_wait();
  return bits;
}

// The block's copy of the static __shared__ variable identified by `tag`.
inline void* shared_var(const void* tag, unsigned long long bytes, unsigned long long align) {
  Block& b = *self().block;
  while (b.shared_lock.exchange(1, std::memory_order_acquire)) sched_yield();
  void* out = nullptr;
  for (unsigned i = 0; i < b.shared_vars && !out; ++i) {
    if (b.shared_tags[i] == tag) out = b.shared + b.shared_offsets[i];
  }
  if (!out && b.shared_vars < 32) {
    const unsigned long long at = (b.shared_used + align - 1) / align * align;
    if (at + bytes <= b.shared_bytes) {
      b.shared_tags[b.shared_vars] = tag;
      b.shared_offsets[b.shared_vars++] = at;
      b.shared_used = at + bytes;
      out = b.shared + at;
    }
  }
  b.shared_lock.store(0, std::memory_order_release);
  if (!out) __builtin_trap();  // more static shared memory than a block has: a kernel bug
  return out;
}

// The clock of device-side deadlines. Spin loops read it every 32 polls: here that is also
// where a spinning thread lets the others run (far more threads than cores).
inline unsigned long long now_ns() {
  sched_yield();
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<unsigned long long>(ts.tv_sec) * 1000000000ull + static_cast<unsigned long long>(ts.tv_nsec);
}

}  // namespace ferrocomm_host

// The CUDA names kernels use.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define threadIdx (::ferrocomm_host::self().thread_idx)
#define blockIdx (::ferrocomm_host::self().block_idx)
#define blockDim (::ferrocomm_host::self().block_dim)
#define gridDim (::ferrocomm_host::self().grid_dim)

using ferrocomm_host::dim3;

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}

template <class T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

inline void __syncthreads() { ::ferrocomm_host::sync_block(1); }
inline int __syncthreads_and(int pred) { return ::ferrocomm_host::sync_block(pred); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::ferrocomm_host::sync_warp(); }
inline unsigned __ballot_sync(unsigned, int pred) { return ::ferrocomm_host::ballot(pred); }
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  unsigned long long bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = ::ferrocomm_host::shuffle(bits, static_cast<unsigned>(src));
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}

// CUDA's atomic functions are relaxed; the same here. *_system: the same (one address space).
template <class T>
inline T atomicAdd(T* p, T v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* p, float v) {
  unsigned* bits = reinterpret_cast<unsigned*>(p);
  unsigned seen = __atomic_load_n(bits, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(bits, &seen, __float_as_uint(__uint_as_float(seen) + v), false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
  return __uint_as_float(seen);
}
inline double atomicAdd(double* p, double v) {
  unsigned long long* bits = reinterpret_cast<unsigned long long*>(p);
  unsigned long long seen = __atomic_load_n(bits, __ATOMIC_RELAXED);
  for (;;) {
    double old;
    memcpy(&old, &seen, 8);
    const double sum = old + v;
    unsigned long long next;
    memcpy(&next, &sum, 8);
    if (__atomic_compare_exchange_n(bits, &seen, next, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return old;
  }
}
template <class T>
inline T atomicMax(T* p, T v) {
  T seen = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (seen < v && !__atomic_compare_exchange_n(p, &seen, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return seen;
}
template <class T>
inline T atomicCAS(T* p, T expected, T desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}
template <class T>
inline T atomicCAS_system(T* p, T expected, T desired) {
  return atomicCAS(p, expected, desired);
}
template <class T>
inline T atomicAdd_system(T* p, T v) {
  return atomicAdd(p, v);
}

// A static __shared__ variable: on the host device, the block's own copy.
#define FERROCOMM_HOST_SHARED(type, name)                                                    \
  static const char name##_shared_tag = 0;                                                   \
  type& name = *static_cast<type*>(::ferrocomm_host::shared_var(&name##_shared_tag, sizeof(type), alignof(type)))
