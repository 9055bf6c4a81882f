// The ordered memory accesses of docs/memory-model.md, one function each, at system scope so
// that peers on other GPUs and the host see them. Each branch says why its ordering suffices;
// the host device's (CPU threads, one address space) uses the C++ order of the same name.
#pragma once
#include "ferrocomm/device.cuh"

namespace ferrocomm {

// Nanoseconds from a clock that all SMs share (deadlines of spin loops).
FERROCOMM_DEVICE_INLINE u64 now_ns() {
#if FERROCOMM_HOST
  return ::ferrocomm_host::now_ns();
#elif FERROCOMM_HIP
  // wall_clock64 ticks at a constant 100 MHz on CDNA2 (gfx90a).
  return wall_clock64() * 10ull;
#else
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// Acquire: later reads of this thread see everything published before the value it reads.
FERROCOMM_DEVICE_INLINE u64 load_acquire(const u64* p) {
#if FERROCOMM_HOST
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#elif FERROCOMM_HIP
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

FERROCOMM_DEVICE_INLINE u32 load_acquire(const u32* p) {
#if FERROCOMM_HOST
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#elif FERROCOMM_HIP
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Relaxed: execution-only polling where no data depends on the value.
FERROCOMM_DEVICE_INLINE u64 load_relaxed(const u64* p) {
#if FERROCOMM_HOST
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#elif FERROCOMM_HIP
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Release: every earlier store of this thread (and, cumulatively, every store it has observed,
// including its group's after a group barrier) is visible before `v` is.
FERROCOMM_DEVICE_INLINE void store_release(u64* p, u64 v) {
#if FERROCOMM_HOST
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#elif FERROCOMM_HIP
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Release read-modify-write without a result (`red`): same publication as store_release.
FERROCOMM_DEVICE_INLINE void add_release(u64* p, u64 v) {
#if FERROCOMM_HOST
  __atomic_fetch_add(p, v, __ATOMIC_RELEASE);
#elif FERROCOMM_HIP
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Relaxed store and add: atomic (a waiter reads whole values, the slot's values only grow)
// but ordering nothing else, for signals that publish no data (signal_relaxed).
FERROCOMM_DEVICE_INLINE void store_relaxed(u64* p, u64 v) {
#if FERROCOMM_HOST
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
#elif FERROCOMM_HIP
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

FERROCOMM_DEVICE_INLINE void add_relaxed(u64* p, u64 v) {
#if FERROCOMM_HOST
  __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#elif FERROCOMM_HIP
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// Atomics of rule 4: acquire and release at once, on the word's single home location.
FERROCOMM_DEVICE_INLINE u64 fetch_add(u64* p, u64 v) {
#if FERROCOMM_HOST
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#elif FERROCOMM_HIP
  return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  u64 old;
  asm volatile("atom.acq_rel.sys.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
#endif
}

FERROCOMM_DEVICE_INLINE u64 compare_swap(u64* p, u64 expected, u64 desired) {
#if FERROCOMM_HOST
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expected;
#elif FERROCOMM_HIP
  __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expected;
#else
  u64 old;
  asm volatile("atom.acq_rel.sys.global.cas.b64 %0, [%1], %2, %3;"
               : "=l"(old)
               : "l"(p), "l"(expected), "l"(desired)
               : "memory");
  return old;
#endif
}

// fence: orders this thread's earlier puts and signals before its later ones (rule 3).
FERROCOMM_DEVICE_INLINE void fence_acq_rel() {
#if FERROCOMM_HOST
  __atomic_thread_fence(__ATOMIC_ACQ_REL);
#elif FERROCOMM_HIP
  __atomic_thread_fence(__ATOMIC_ACQ_REL);
#else
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}

// flush: a sequentially consistent fence; with direct stores, completion is visibility.
FERROCOMM_DEVICE_INLINE void fence_sc() {
#if FERROCOMM_HOST
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#elif FERROCOMM_HIP
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#else
  asm volatile("fence.sc.sys;" ::: "memory");
#endif
}

// First error wins: a CAS on the code keeps the root cause when several waits fail.
FERROCOMM_DEVICE_INLINE void record_status(u64 status_addr, u32 code, u32 op, i32 peer, u32 signal_id,
                                           u64 expected, u64 observed) {
  ferrocomm_status* s = reinterpret_cast<ferrocomm_status*>(status_addr);
  if (s == nullptr) return;
  if (atomicCAS_system(&s->code, FERROCOMM_STATUS_OK, code) != FERROCOMM_STATUS_OK) return;
  s->op = op;
  s->peer = peer;
  s->signal_id = signal_id;
  s->expected = expected;
  s->observed = observed;
  fence_sc();
}

}  // namespace ferrocomm
