// Who a window reaches and how: the team of a window is its communicator's ranks, and the
// *local* team is the ranks whose segments are mapped into this process (the NVLink / PCIe
// load-store domain, where peer_ptr works and every verb is a plain load or store). The others
// (ranks on other hosts) are reached only through the proxy queue: put, signal and
// signal_relaxed go there; get, the atomics, the device barrier and peer_ptr do not (see
// window.cuh). The handle says which: its proxy queue's `remote[]` byte array is nonzero for
// exactly those ranks, and a handle without a queue reaches every rank by load/store.
//
// Free functions on a Window, like multicast_ptr. team_rank and team_size are fields of the
// handle; the local-team functions read the queue's `remote[]` (size bytes) when there is one,
// so a kernel that needs them in a loop reads them once.
#pragma once
#include "ferrocomm/window.cuh"

namespace ferrocomm {

FERROCOMM_DEVICE_INLINE i32 team_rank(const Window& w) { return w.rank(); }
FERROCOMM_DEVICE_INLINE i32 team_size(const Window& w) { return w.size(); }

// True when `peer`'s segment is mapped here (peer_ptr may be used); the caller's own rank is
// always local. False for a rank outside [0, size).
FERROCOMM_DEVICE_INLINE bool team_is_local(const Window& w, i32 peer) {
  return peer >= 0 && peer < w.size() && !w.via_proxy(peer);
}

// The number of ranks in the local team, the caller included (1 ..= size).
FERROCOMM_DEVICE_INLINE i32 team_local_size(const Window& w) {
  if (w.handle().fifo == 0) return w.size();
  i32 n = 0;
  for (i32 r = 0; r < w.size(); ++r) n += !w.via_proxy(r);
  return n;
}

// The caller's index among the local team's ranks in rank order (0 ..= local size - 1), to
// split work among the ranks that share memory.
FERROCOMM_DEVICE_INLINE i32 team_local_rank(const Window& w) {
  if (w.handle().fifo == 0) return w.rank();
  i32 n = 0;
  for (i32 r = 0; r < w.rank(); ++r) n += !w.via_proxy(r);
  return n;
}

// The rank of the local team's member `k` (in rank order), or -1 when k is out of range.
FERROCOMM_DEVICE_INLINE i32 team_local_peer(const Window& w, i32 k) {
  if (k < 0) return -1;
  for (i32 r = 0; r < w.size(); ++r) {
    if (!w.via_proxy(r) && k-- == 0) return r;
  }
  return -1;
}

}  // namespace ferrocomm
