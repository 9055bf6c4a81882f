// fence, flush and barrier.
#pragma once

namespace ferrocomm {

// Orders the coop's earlier puts and signals to each target before its later ones.
template <class Coop>
FERROCOMM_DEVICE_INLINE void Window::fence(Coop c) const {
  if (!abi_ok()) return;
  c.sync();
  fence_acq_rel();
  c.sync();
}

// Completes the coop's earlier puts, signals and atomics at their targets. Load/store peers
// need only the SC fence.
// With a proxy queue, the leader also waits until the proxy reports every earlier descriptor
// complete at its target.
template <class Coop>
FERROCOMM_DEVICE_INLINE void Window::flush(Coop c) const {
  if (!abi_ok()) return;
  c.sync();
  fence_sc();
  if (h_.fifo != 0 && c.is_leader()) proxy_flush();
  c.sync();
}

// Flush, then one epoch per barrier: the leader release-stores the new epoch into its slot on
// every peer, then waits until every slot of its own pad reached it. Epochs only grow, so a
// fast rank's next barrier cannot be mistaken for this one.
template <class Coop>
FERROCOMM_DEVICE_INLINE bool Window::barrier(Coop c) const {
  if (!abi_ok()) return false;
  c.sync();
  u64 ok = 1;
  if (c.is_leader()) {
    fence_sc();
    const u64 slots = h_.barrier_offset;
    u64* my_epoch = local_ptr<u64>(slots + static_cast<u64>(h_.size) * 8);
    const u64 epoch = *my_epoch + 1;
    *my_epoch = epoch;
    for (i32 p = 0; p < h_.size; ++p) {
      // The barrier slots are not a signal pad: the queue cannot reach them (host barrier).
      if (via_proxy(p)) {
        not_via_proxy(p);
        ok = 0;
        continue;
      }
      store_release(peer_ptr<u64>(p, slots + static_cast<u64>(h_.rank) * 8), epoch);
    }
    const u64 start = now_ns();
    for (i32 p = 0; p < h_.size && ok; ++p) {
      const u64* slot = local_ptr<u64>(slots + static_cast<u64>(p) * 8);
      for (u32 spin = 0;; ++spin) {
        const u64 seen = load_acquire(slot);
        if (seen >= epoch) break;
        if ((spin & 31) == 31 && (failed() || now_ns() - start > h_.timeout_ns)) {
          give_up(FERROCOMM_OP_BARRIER, p, 0, epoch, seen);
          ok = 0;
          break;
        }
      }
    }
  }
  return broadcast(c, ok) != 0;
}

}  // namespace ferrocomm
