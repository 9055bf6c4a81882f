// The device producer of the proxy queue (abi.h, ferrocomm_proxy_queue): puts and signals
// toward ranks that are not load/store reachable become 16-byte descriptors that the host's
// proxy thread carries over the network. Only a coop's leader pushes; the coop syncs first so
// that the group's writes of a put's source are published by the leader's release of word 0.
#pragma once

namespace ferrocomm {

FERROCOMM_DEVICE_INLINE const ferrocomm_proxy_queue* Window::queue() const {
  return reinterpret_cast<const ferrocomm_proxy_queue*>(h_.fifo);
}

FERROCOMM_DEVICE_INLINE bool Window::via_proxy(i32 peer) const {
  return h_.fifo != 0 && reinterpret_cast<const unsigned char*>(queue()->remote)[peer] != 0;
}

// One descriptor: take a ticket (written to `*taken`), wait for its slot to be free (bounded),
// write word 1, then release word 0 with the lap parity. False when the queue stayed full past
// the deadline.
FERROCOMM_DEVICE_INLINE bool Window::push(i32 peer, u64 w0, u64 w1, u64* taken) const {
  const ferrocomm_proxy_queue* q = queue();
  const u64 cap = q->capacity;
  const u64 ticket = atomicAdd(reinterpret_cast<unsigned long long*>(q->head), 1ull);
  *taken = ticket;
  const u64* tail = reinterpret_cast<const u64*>(q->tail);
  const u64 start = now_ns();
  for (u32 spin = 0;; ++spin) {
    const u64 freed = load_acquire(tail);
    if (ticket - freed < cap) break;
    if ((spin & 31) == 31 && (failed() || now_ns() - start > h_.timeout_ns)) {
      give_up(FERROCOMM_OP_PROXY, peer, 0, ticket, freed);
      return false;
    }
  }
  u64* slot = reinterpret_cast<u64*>(q->slots) + 2 * (ticket & (cap - 1));
  const u64 parity = (~(ticket / cap)) & 1ull;
  slot[1] = w1;
  // Release: word 1, and everything the coop wrote before its sync, is visible to the proxy
  // before word 0 is.
  store_release(&slot[0], w0 | (parity << FERROCOMM_PROXY_PARITY_BIT));
  return true;
}

// Returns, in the leader, whether every descriptor of the put was queued (true in the others):
// a put_signal sends its signal only then. The caller has checked the peer and destination.
template <class Coop>
FERROCOMM_DEVICE_INLINE bool Window::proxy_put(Coop c, i32 peer, u64 dst_offset, const void* src, u64 bytes) const {
  c.sync();
  if (!c.is_leader()) return true;
  // The proxy reads the source from this rank's window data, so it must lie there.
  const u64 src_offset = reinterpret_cast<u64>(src) - reinterpret_cast<u64>(local_ptr(0));
  if (reinterpret_cast<u64>(src) < reinterpret_cast<u64>(local_ptr(0)) || src_offset > h_.data_bytes ||
      bytes > h_.data_bytes - src_offset) {
    record_status(h_.status, FERROCOMM_STATUS_INVALID, FERROCOMM_OP_PROXY, peer, 0, bytes, reinterpret_cast<u64>(src));
    return false;
  }
  const u64 head = (static_cast<u64>(FERROCOMM_PROXY_PUT) << FERROCOMM_PROXY_OP_SHIFT) |
                   (static_cast<u64>(peer) << FERROCOMM_PROXY_PEER_SHIFT);
  u64 ticket = 0;
  for (u64 done = 0; done < bytes; done += FERROCOMM_PROXY_MAX_PUT) {
    const u64 n = bytes - done < FERROCOMM_PROXY_MAX_PUT ? bytes - done : FERROCOMM_PROXY_MAX_PUT;
    const u64 w0 = head | ((dst_offset + done) & FERROCOMM_PROXY_OFFSET_MASK);
    const u64 w1 = (n << FERROCOMM_PROXY_BYTES_SHIFT) | ((src_offset + done) & FERROCOMM_PROXY_OFFSET_MASK);
    if (!push(peer, w0, w1, &ticket)) return false;
  }
  if (bytes == 0) return true;
  // A put is complete locally when it returns (docs/memory-model.md): wait until the proxy
  // has copied the source, which it publishes by releasing the slot (tail passes our last
  // ticket; it consumes in ticket order). Acquire: our later writes of the source come after.
  const u64* tail = reinterpret_cast<const u64*>(queue()->tail);
  const u64 start = now_ns();
  for (u32 spin = 0;; ++spin) {
    const u64 freed = load_acquire(tail);
    if (freed > ticket) return true;
    // Queued all the same: a signal after it would follow it in the proxy's order.
    if ((spin & 31) == 31 && (failed() || now_ns() - start > h_.timeout_ns)) {
      give_up(FERROCOMM_OP_PROXY, peer, 0, ticket + 1, freed);
      return true;
    }
  }
}

// `send` false (a put_signal whose put was not queued): the coop syncs as always, and nothing
// is queued.
template <class Coop>
FERROCOMM_DEVICE_INLINE void Window::proxy_signal(Coop c, i32 peer, u32 id, SignalOp op, u64 value, bool send) const {
  c.sync();
  if (!c.is_leader() || !send) return;
  const u64 w0 = (static_cast<u64>(FERROCOMM_PROXY_SIGNAL) << FERROCOMM_PROXY_OP_SHIFT) |
                 (static_cast<u64>(peer) << FERROCOMM_PROXY_PEER_SHIFT) |
                 (static_cast<u64>(static_cast<u32>(op)) << 32) | id;
  u64 ticket;
  push(peer, w0, value, &ticket);
}

// Waits until the proxy reports complete every descriptor taken before this call.
FERROCOMM_DEVICE_INLINE bool Window::proxy_flush() const {
  const ferrocomm_proxy_queue* q = queue();
  const u64 target = atomicAdd(reinterpret_cast<unsigned long long*>(q->head), 0ull);
  const u64* done = reinterpret_cast<const u64*>(q->done);
  const u64 start = now_ns();
  for (u32 spin = 0;; ++spin) {
    const u64 seen = load_acquire(done);
    if (seen >= target) return true;
    if ((spin & 31) == 31 && (failed() || now_ns() - start > h_.timeout_ns)) {
      give_up(FERROCOMM_OP_FLUSH, -1, 0, target, seen);
      return false;
    }
  }
}

// Verbs the queue does not carry (get, atomics, barrier slots) record this and do nothing.
FERROCOMM_DEVICE_INLINE void Window::not_via_proxy(i32 peer) const {
  record_status(h_.status, FERROCOMM_STATUS_INVALID, FERROCOMM_OP_NOT_VIA_PROXY, peer, 0, 0, ~0ull);
}

}  // namespace ferrocomm
