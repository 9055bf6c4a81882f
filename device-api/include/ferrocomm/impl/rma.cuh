// put / get: plain (weak) copies between this rank's memory and a peer's segment, or a queued
// put toward a rank behind the proxy. They become visible at the target through a later
// signal, flush or barrier (rules 1 and 3).
#pragma once

namespace ferrocomm {

// The coop's threads copy disjoint slices, 16 bytes at a time when both ends and the length
// allow it (one 128-bit access per thread per step keeps NVLink and HBM busy), else 8, else 1.
template <class Coop>
FERROCOMM_DEVICE_INLINE void coop_copy(Coop c, void* dst, const void* src, u64 bytes) {
  const u64 tid = c.thread_rank(), n = c.size();
  const u64 align = reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src) | bytes;
  if ((align & 15) == 0) {
    uint4* d = static_cast<uint4*>(dst);
    const uint4* s = static_cast<const uint4*>(src);
    for (u64 i = tid; i < bytes / 16; i += n) d[i] = s[i];
  } else if ((align & 7) == 0) {
    u64* d = static_cast<u64*>(dst);
    const u64* s = static_cast<const u64*>(src);
    for (u64 i = tid; i < bytes / 8; i += n) d[i] = s[i];
  } else {
    unsigned char* d = static_cast<unsigned char*>(dst);
    const unsigned char* s = static_cast<const unsigned char*>(src);
    for (u64 i = tid; i < bytes; i += n) d[i] = s[i];
  }
}

template <class Coop>
FERROCOMM_DEVICE_INLINE void Window::put(Coop c, i32 peer, u64 dst_offset, const void* src, u64 bytes) const {
  if (!abi_ok() || !range_ok(peer, dst_offset, bytes, c.is_leader())) return;
  if (via_proxy(peer)) {
    proxy_put(c, peer, dst_offset, src, bytes);
    return;
  }
  coop_copy(c, peer_ptr(peer, dst_offset), src, bytes);
}

// The coop syncs afterwards so every thread may read any byte of `dst`. Load/store peers
// only: the proxy queue carries no gets (FERROCOMM_STATUS_INVALID).
template <class Coop>
FERROCOMM_DEVICE_INLINE void Window::get(Coop c, i32 peer, u64 src_offset, void* dst, u64 bytes) const {
  if (!abi_ok() || !range_ok(peer, src_offset, bytes, c.is_leader())) return;
  if (via_proxy(peer)) {
    if (c.is_leader()) not_via_proxy(peer);
    c.sync();
    return;
  }
  coop_copy(c, dst, peer_ptr(peer, src_offset), bytes);
  c.sync();
}

}  // namespace ferrocomm
