// A window as kernels see it: the verbs of docs/memory-model.md on a ferrocomm_window_handle
// passed by value. Data verbs (put, get) are weak stores and loads through peer pointers, or
// descriptors in the proxy queue toward ranks on other hosts (impl/proxy.cuh);
// `signal` and `wait_signal` are release and acquire and are what make data safe to read;
// `fence`, `flush` and `barrier` order and complete. Every wait is bounded by the handle's
// timeout and the communicator's abort flag and reports failure through `ok`, never a trap.
// Every verb first checks that the handle was made for the ABI these headers describe
// (`abi_ok`); on a mismatch it records FERROCOMM_STATUS_ABI_MISMATCH and does nothing else.
// Then its arguments, as the host API checks them: a rank outside the window, bytes past a
// segment's data, a signal id past the pad or a misaligned atomic records
// FERROCOMM_STATUS_INVALID and the verb does nothing (a store through such an offset would
// land in a signal pad or another allocation). `peer_ptr`, `local_ptr`, `signal_slot` and
// `via_proxy` are the unchecked way in: their caller keeps the rank and offset in the window.
#pragma once
#include "ferrocomm/atomics.cuh"
#include "ferrocomm/coop.cuh"

namespace ferrocomm {

enum class SignalOp : u32 { Set = FERROCOMM_SIGNAL_SET, Add = FERROCOMM_SIGNAL_ADD };
enum class Cmp : u32 {
  Eq = FERROCOMM_CMP_EQ,
  Ne = FERROCOMM_CMP_NE,
  Ge = FERROCOMM_CMP_GE,
  Gt = FERROCOMM_CMP_GT,
  Le = FERROCOMM_CMP_LE,
  Lt = FERROCOMM_CMP_LT,
};

// `wait_signal` sources besides a rank.
constexpr i32 SOURCE_ANY = FERROCOMM_SOURCE_ANY;
constexpr i32 SOURCE_SUM = FERROCOMM_SOURCE_SUM;

// What a wait saw: `ok` is false when it timed out or the communicator was aborted (the
// handle's status says which); `source` is the satisfying rank (-1 for a sum).
struct Observed {
  bool ok;
  i32 source;
  u64 value;
};

FERROCOMM_DEVICE_INLINE bool holds(Cmp cmp, u64 have, u64 want) {
  switch (cmp) {
    case Cmp::Eq: return have == want;
    case Cmp::Ne: return have != want;
    case Cmp::Ge: return have >= want;
    case Cmp::Gt: return have > want;
    case Cmp::Le: return have <= want;
    case Cmp::Lt: return have < want;
  }
  return false;
}

class Window {
 public:
  FERROCOMM_DEVICE_INLINE explicit Window(const ferrocomm_window_handle& h) : h_(h) {}

  FERROCOMM_DEVICE_INLINE i32 rank() const { return h_.rank; }
  FERROCOMM_DEVICE_INLINE i32 size() const { return h_.size; }
  FERROCOMM_DEVICE_INLINE u64 bytes() const { return h_.data_bytes; }
  FERROCOMM_DEVICE_INLINE const ferrocomm_window_handle& handle() const { return h_; }

  // True when the handle has the layout this kernel was compiled for (abi.h). Otherwise records
  // FERROCOMM_STATUS_ABI_MISMATCH (first error wins), so the host reports both versions. A
  // single compare of a by-value field: the verbs call it on entry; a kernel that uses
  // peer_ptr / local_ptr without any verb should call it first itself.
  FERROCOMM_DEVICE_INLINE bool abi_ok() const {
    if (h_.abi_version == FERROCOMM_ABI_VERSION) return true;
    record_status(h_.status, FERROCOMM_STATUS_ABI_MISMATCH, 0, -1, 0, FERROCOMM_ABI_VERSION, h_.abi_version);
    return false;
  }

  // Byte `offset` of `rank`'s segment, for direct loads and stores over NVLink / PCIe.
  // Unchecked: the caller keeps offset + access size within bytes().
  template <class T = void>
  FERROCOMM_DEVICE_INLINE T* peer_ptr(i32 rank, u64 offset) const {
    return reinterpret_cast<T*>(h_.base + static_cast<u64>(rank) * h_.stride + offset);
  }
  template <class T = void>
  FERROCOMM_DEVICE_INLINE T* local_ptr(u64 offset) const {
    return peer_ptr<T>(h_.rank, offset);
  }

  // Slot [id][source] of `target`'s signal pad.
  FERROCOMM_DEVICE_INLINE u64* signal_slot(i32 target, u32 id, i32 source) const {
    u64 slot = static_cast<u64>(id) * static_cast<u64>(h_.size) + static_cast<u64>(source);
    return peer_ptr<u64>(target, h_.signal_offset + slot * 8);
  }

  // True once the communicator is aborted or an earlier wait of this window failed: waits
  // stop at once instead of serving out their own timeout.
  FERROCOMM_DEVICE_INLINE bool failed() const {
    if (h_.abort_flag != 0 && load_acquire(reinterpret_cast<const u32*>(h_.abort_flag)) != 0) return true;
    return h_.status != 0 && load_acquire(&reinterpret_cast<const ferrocomm_status*>(h_.status)->code) != 0;
  }

  // Data movement (impl/rma.cuh): the coop's threads copy disjoint slices.
  template <class Coop>
  FERROCOMM_DEVICE_INLINE void put(Coop c, i32 peer, u64 dst_offset, const void* src, u64 bytes) const;
  template <class Coop>
  FERROCOMM_DEVICE_INLINE void get(Coop c, i32 peer, u64 src_offset, void* dst, u64 bytes) const;

  // Signals (impl/signal.cuh): the coop syncs, then its leader releases.
  template <class Coop>
  FERROCOMM_DEVICE_INLINE void signal(Coop c, i32 peer, u32 id, SignalOp op, u64 value) const;
  // A relaxed signal: the same update of slot [id][rank] on `peer`, atomic, but it orders and
  // publishes nothing (no sync, no release), for counters no data depends on. Toward a peer
  // behind the proxy queue it travels like `signal`, in order with earlier puts.
  template <class Coop>
  FERROCOMM_DEVICE_INLINE void signal_relaxed(Coop c, i32 peer, u32 id, SignalOp op, u64 value) const;
  template <class Coop>
  FERROCOMM_DEVICE_INLINE void put_signal(Coop c, i32 peer, u64 dst_offset, const void* src, u64 bytes, u32 id,
                                          SignalOp op, u64 value) const;
  // The leader acquires, then the coop syncs so every thread sees the data. `source` is a
  // rank, SOURCE_ANY or SOURCE_SUM.
  template <class Coop>
  FERROCOMM_DEVICE_INLINE Observed wait_signal(Coop c, u32 id, i32 source, Cmp cmp, u64 value) const;
  // This rank's own slot [id][source], read with acquire (no waiting).
  FERROCOMM_DEVICE_INLINE u64 read_signal(u32 id, i32 source) const {
    if (!abi_ok() || !signal_ok(source, id, true)) return 0;
    return load_acquire(signal_slot(h_.rank, id, source));
  }

  // Ordering and completion (impl/barrier.cuh).
  template <class Coop>
  FERROCOMM_DEVICE_INLINE void fence(Coop c) const;
  template <class Coop>
  FERROCOMM_DEVICE_INLINE void flush(Coop c) const;
  // Every rank's coop must call; one coop per rank at a time (for a grid-wide barrier, sync
  // the grid first and let one block call). Returns false on timeout or abort.
  template <class Coop>
  FERROCOMM_DEVICE_INLINE bool barrier(Coop c) const;

  // Atomics of rule 4 on the aligned u64 at `offset` of `peer` (one thread). Load/store peers
  // only: toward a rank behind the proxy queue they record FERROCOMM_STATUS_INVALID, return 0.
  FERROCOMM_DEVICE_INLINE u64 fetch_add(i32 peer, u64 offset, u64 value) const {
    if (!abi_ok() || !atomic_ok(peer, offset)) return 0;
    if (via_proxy(peer)) {
      not_via_proxy(peer);
      return 0;
    }
    return ferrocomm::fetch_add(peer_ptr<u64>(peer, offset), value);
  }
  FERROCOMM_DEVICE_INLINE u64 compare_swap(i32 peer, u64 offset, u64 expected, u64 desired) const {
    if (!abi_ok() || !atomic_ok(peer, offset)) return 0;
    if (via_proxy(peer)) {
      not_via_proxy(peer);
      return 0;
    }
    return ferrocomm::compare_swap(peer_ptr<u64>(peer, offset), expected, desired);
  }

  // True when `peer` is not load/store reachable and put / signal go through the proxy queue.
  FERROCOMM_DEVICE_INLINE bool via_proxy(i32 peer) const;

 private:
  // The argument checks. Every thread of a coop gets the same answer (a coop's threads pass
  // the same arguments); `record` (its leader) writes the status, first error winning.
  FERROCOMM_DEVICE_INLINE bool rank_ok(i32 peer, bool record) const {
    if (peer >= 0 && peer < h_.size) return true;
    if (record) record_status(h_.status, FERROCOMM_STATUS_INVALID, FERROCOMM_OP_BAD_RANK, peer, 0, h_.size, 0);
    return false;
  }
  // Written so that offset + bytes cannot wrap past the check.
  FERROCOMM_DEVICE_INLINE bool range_ok(i32 peer, u64 offset, u64 bytes, bool record) const {
    if (!rank_ok(peer, record)) return false;
    if (offset <= h_.data_bytes && bytes <= h_.data_bytes - offset) return true;
    if (record) record_status(h_.status, FERROCOMM_STATUS_INVALID, FERROCOMM_OP_OUT_OF_WINDOW, peer, 0, bytes, offset);
    return false;
  }
  FERROCOMM_DEVICE_INLINE bool signal_ok(i32 peer, u32 id, bool record) const {
    if (!rank_ok(peer, record)) return false;
    if (id < h_.signals) return true;
    if (record) record_status(h_.status, FERROCOMM_STATUS_INVALID, FERROCOMM_OP_BAD_SIGNAL, peer, id, h_.signals, id);
    return false;
  }
  // One thread's atomic: in the data and 8-byte aligned (a misaligned atomic faults the GPU).
  FERROCOMM_DEVICE_INLINE bool atomic_ok(i32 peer, u64 offset) const {
    if (!range_ok(peer, offset, 8, true)) return false;
    if ((offset & 7) == 0) return true;
    record_status(h_.status, FERROCOMM_STATUS_INVALID, FERROCOMM_OP_MISALIGNED, peer, 0, 8, offset);
    return false;
  }

  // Records why a wait gave up; the caller returns with ok = false.
  FERROCOMM_DEVICE_INLINE void give_up(u32 op, i32 peer, u32 id, u64 expected, u64 observed) const {
    bool aborted = h_.abort_flag != 0 && load_acquire(reinterpret_cast<const u32*>(h_.abort_flag)) != 0;
    record_status(h_.status, aborted ? FERROCOMM_STATUS_ABORTED : FERROCOMM_STATUS_TIMEOUT, op, peer, id, expected,
                  observed);
  }

  // The proxy queue (impl/proxy.cuh).
  FERROCOMM_DEVICE_INLINE const ferrocomm_proxy_queue* queue() const;
  FERROCOMM_DEVICE_INLINE bool push(i32 peer, u64 w0, u64 w1, u64* taken) const;
  template <class Coop>
  FERROCOMM_DEVICE_INLINE bool proxy_put(Coop c, i32 peer, u64 dst_offset, const void* src, u64 bytes) const;
  template <class Coop>
  FERROCOMM_DEVICE_INLINE void proxy_signal(Coop c, i32 peer, u32 id, SignalOp op, u64 value,
                                            bool send = true) const;
  FERROCOMM_DEVICE_INLINE bool proxy_flush() const;
  FERROCOMM_DEVICE_INLINE void not_via_proxy(i32 peer) const;

  ferrocomm_window_handle h_;
};

}  // namespace ferrocomm

#include "ferrocomm/impl/proxy.cuh"
#include "ferrocomm/impl/rma.cuh"
#include "ferrocomm/impl/signal.cuh"
#include "ferrocomm/impl/barrier.cuh"
