// signal (release) and wait_signal (acquire), rules 1 and 2 of docs/memory-model.md.
#pragma once

namespace ferrocomm {

// The coop syncs before its leader releases, so the whole group's earlier puts are published
// by the one release (the sync orders them before the leader's store at CTA scope; the
// system-scope release is cumulative over them).
template <class Coop>
FERROCOMM_DEVICE_INLINE void Window::signal(Coop c, i32 peer, u32 id, SignalOp op, u64 value) const {
  if (!abi_ok() || !signal_ok(peer, id, c.is_leader())) return;
  // Through the queue, the proxy runs the signal after every earlier descriptor of ours.
  if (via_proxy(peer)) return proxy_signal(c, peer, id, op, value);
  c.sync();
  if (c.is_leader()) {
    u64* slot = signal_slot(peer, id, h_.rank);
    if (op == SignalOp::Set) {
      store_release(slot, value);
    } else {
      add_release(slot, value);
    }
  }
}

// No sync and no release: nothing of the caller's is published by it, so the leader alone
// writes, with a relaxed atomic (the slot still only grows and is read whole). Through the
// queue it becomes an ordinary signal descriptor: the proxy applies descriptors in order and
// with release, which is stronger than asked and costs nothing more there.
template <class Coop>
FERROCOMM_DEVICE_INLINE void Window::signal_relaxed(Coop c, i32 peer, u32 id, SignalOp op, u64 value) const {
  if (!abi_ok() || !signal_ok(peer, id, c.is_leader())) return;
  if (via_proxy(peer)) return proxy_signal(c, peer, id, op, value);
  if (c.is_leader()) {
    u64* slot = signal_slot(peer, id, h_.rank);
    if (op == SignalOp::Set) {
      store_relaxed(slot, value);
    } else {
      add_relaxed(slot, value);
    }
  }
}

template <class Coop>
FERROCOMM_DEVICE_INLINE void Window::put_signal(Coop c, i32 peer, u64 dst_offset, const void* src, u64 bytes, u32 id,
                                                SignalOp op, u64 value) const {
  // A bad signal id refuses the put too: the caller's protocol is broken either way.
  if (!abi_ok() || !range_ok(peer, dst_offset, bytes, c.is_leader()) || !signal_ok(peer, id, c.is_leader())) return;
  if (via_proxy(peer)) {
    // A put the proxy refused, or could not queue, sends no signal: the peer would take the
    // bytes already in its window for the new ones. The coop still syncs in both calls.
    const bool queued = proxy_put(c, peer, dst_offset, src, bytes);
    return proxy_signal(c, peer, id, op, value, queued);
  }
  put(c, peer, dst_offset, src, bytes);
  signal(c, peer, id, op, value);
}

// The leader polls with acquire loads until the condition holds, the deadline passes or the
// communicator fails; then the coop syncs, which carries the leader's acquire to every thread.
template <class Coop>
FERROCOMM_DEVICE_INLINE Observed Window::wait_signal(Coop c, u32 id, i32 source, Cmp cmp, u64 value) const {
  Observed seen{false, source, 0};
  if (!abi_ok()) return seen;
  const bool any_or_sum = source == SOURCE_ANY || source == SOURCE_SUM;
  if (!signal_ok(any_or_sum ? h_.rank : source, id, c.is_leader())) return seen;
  if (c.is_leader()) {
    const u64 start = now_ns();
    for (u32 spin = 0;; ++spin) {
      if (source >= 0) {
        seen.value = load_acquire(signal_slot(h_.rank, id, source));
        if (holds(cmp, seen.value, value)) seen.ok = true;
      } else if (source == SOURCE_ANY) {
        for (i32 s = 0; s < h_.size && !seen.ok; ++s) {
          seen.value = load_acquire(signal_slot(h_.rank, id, s));
          if (holds(cmp, seen.value, value)) {
            seen.ok = true;
            seen.source = s;
          }
        }
      } else {
        seen.value = 0;
        for (i32 s = 0; s < h_.size; ++s) seen.value += load_acquire(signal_slot(h_.rank, id, s));
        seen.source = -1;
        seen.ok = holds(cmp, seen.value, value);
      }
      if (seen.ok) break;
      // The clock and the flags cost a few loads; look every 32 polls.
      if ((spin & 31) == 31 && (failed() || now_ns() - start > h_.timeout_ns)) {
        give_up(FERROCOMM_OP_WAIT_SIGNAL, source, id, value, seen.value);
        break;
      }
    }
  }
  const u64 packed = broadcast(c, (static_cast<u64>(seen.ok) << 32) | static_cast<u32>(seen.source));
  seen.value = broadcast(c, seen.value);
  seen.ok = (packed >> 32) != 0;
  seen.source = static_cast<i32>(static_cast<u32>(packed));
  return seen;
}

}  // namespace ferrocomm
