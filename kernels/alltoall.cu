// all_to_all with any sizes (the v form included) on a window, in chunks through slots.
//
// The window's second region holds, in every rank's segment, one slot per receiver. Sender p
// stages its block for rank r chunk by chunk in slot r of its own segment and signals
// FILLED; r copies the chunk out of p's segment and signals CONSUMED, which frees the slot for
// p's next chunk. A pair's chunk count follows from its length, which both ends know, so a
// block of any size passes through a slot of fixed size, and no rank needs another pair's
// sizes. Rounds interleave sends and receives (round k's sends wait only for round k - 1's
// receives), so no cycle of waits forms.
//
// Chunk ids count per (block, pair) across calls: they only grow, and the ids a chunk waits
// for need no reset. Each chunk carries the sender's byte count and call number, so a receiver
// that expected another size (or a chunk of another call) records MISMATCH instead of copying.
// The grid is always MAX_BLOCKS blocks (sizes differ between ranks, the grid may not); block b
// moves share b of every chunk with its own signals.

#include "collective.cuh"

using namespace ferrocomm;
using namespace ferrocomm::coll;

namespace {

using Byte = unsigned char;

// What the host passes: this rank's send and receive parts, and where the slots are.
struct AllToAll {
  u64 send[MAX_RANKS], send_len[MAX_RANKS];
  u64 recv[MAX_RANKS], recv_len[MAX_RANKS];
  u64 region;  // byte offset of the slots in every segment
  u64 slot;    // bytes per slot: MAX_BLOCKS 16-byte headers, then the payload
};

constexpr u64 HEADER_BYTES = 16 * MAX_BLOCKS;

// Per-rank counters, in u64: [calls: MAX_BLOCKS][sent: MAX_BLOCKS][MAX_RANKS][got: ...].
FERROCOMM_DEVICE_INLINE u64* calls_of(u64* c) { return c + blockIdx.x; }
FERROCOMM_DEVICE_INLINE u64* sent_of(u64* c, i32 r) { return c + MAX_BLOCKS + blockIdx.x * MAX_RANKS + r; }
FERROCOMM_DEVICE_INLINE u64* got_of(u64* c, i32 r) {
  return c + MAX_BLOCKS + MAX_BLOCKS * MAX_RANKS + blockIdx.x * MAX_RANKS + r;
}

// Block b's share of the first `len` bytes of a chunk, with 16-byte accesses if both ends
// allow. Every chunk is cut as a whole slot of `cut` bytes would be, so block b moves the same
// slot bytes in every chunk: a short chunk cut by its own length would give block b bytes that
// another block of the receiver may still be reading from the previous chunk (block b's
// CONSUMED signal covers only what block b read).
FERROCOMM_DEVICE_INLINE void copy_chunk_share(Byte* dst, const Byte* src, u64 len, u64 cut) {
  const u32 vectors = ((reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src)) & 15u) == 0;
  Share s = share_of<16>(cut, vectors);
  s.lo = min(s.lo, len);
  s.hi = min(s.hi, len);
  s.vhi = vectors ? max(s.lo, min(s.hi, (len / 16) * 16)) : s.lo;
  copy_share(dst, src, s);
}

FERROCOMM_DEVICE_INLINE void all_to_all(const ferrocomm_window_handle& h, const AllToAll& a, u64* counters) {
  const Window w(h);
  if (!w.abi_ok()) return;
  const i32 me = w.rank();
  const u64 payload = a.slot - HEADER_BYTES;
  const u64 call = *calls_of(counters) + 1;
  // Our own block needs no slot.
  const u64 own = min(a.send_len[me], a.recv_len[me]);
  copy_chunk_share(reinterpret_cast<Byte*>(a.recv[me]), reinterpret_cast<const Byte*>(a.send[me]), own, own);
  u64 rounds = 0;
  for (i32 r = 0; r < w.size(); ++r) {
    if (r == me) continue;
    rounds = max(rounds, max((a.send_len[r] + payload - 1) / payload, (a.recv_len[r] + payload - 1) / payload));
  }
  for (u64 k = 0; k < rounds; ++k) {
    const u64 at = k * payload;
    for (i32 r = 0; r < w.size(); ++r) {
      if (r == me || at >= a.send_len[r]) continue;
      const u64 chunk = *sent_of(counters, r) + k + 1;
      // Rank r has copied our previous chunk out of this slot.
      if (!w.wait_signal(coop_block(), CONSUMED_ID + blockIdx.x, r, Cmp::Ge, chunk - 1).ok) return;
      Byte* slot = w.local_ptr<Byte>(a.region + static_cast<u64>(r) * a.slot);
      if (threadIdx.x == 0) {
        u64* hdr = reinterpret_cast<u64*>(slot + 16 * blockIdx.x);
        hdr[0] = a.send_len[r];
        hdr[1] = call;
      }
      copy_chunk_share(slot + HEADER_BYTES, reinterpret_cast<const Byte*>(a.send[r]) + at,
                       min(payload, a.send_len[r] - at), payload);
      w.signal(coop_block(), r, FILLED_ID + blockIdx.x, SignalOp::Set, chunk);
    }
    for (i32 p = 0; p < w.size(); ++p) {
      if (p == me || at >= a.recv_len[p]) continue;
      const u64 chunk = *got_of(counters, p) + k + 1;
      if (!w.wait_signal(coop_block(), FILLED_ID + blockIdx.x, p, Cmp::Ge, chunk).ok) return;
      const Byte* slot = w.peer_ptr<const Byte>(p, a.region + static_cast<u64>(me) * a.slot);
      const u64* hdr = reinterpret_cast<const u64*>(slot + 16 * blockIdx.x);
      if (hdr[0] != a.recv_len[p] || hdr[1] != call) {
        if (threadIdx.x == 0) {
          record_status(h.status, FERROCOMM_STATUS_MISMATCH, FERROCOMM_OP_COLLECTIVE, p, FILLED_ID + blockIdx.x,
                        a.recv_len[p], hdr[1] == call ? hdr[0] : ~0ull);
        }
        return;
      }
      copy_chunk_share(reinterpret_cast<Byte*>(a.recv[p]) + at, slot + HEADER_BYTES, min(payload, a.recv_len[p] - at),
                       payload);
      w.signal(coop_block(), p, CONSUMED_ID + blockIdx.x, SignalOp::Set, chunk);
    }
  }
  // Every thread has read the counters (the signals above synced the block at least once per
  // chunk; this sync covers calls without any).
  __syncthreads();
  if (threadIdx.x == 0) {
    for (i32 r = 0; r < w.size(); ++r) {
      if (r == me) continue;
      *sent_of(counters, r) += (a.send_len[r] + payload - 1) / payload;
      *got_of(counters, r) += (a.recv_len[r] + payload - 1) / payload;
    }
    *calls_of(counters) = call;
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256, 1)
    ferrocomm_alltoall(ferrocomm_window_handle h, FERROCOMM_GRID_CONSTANT const AllToAll parts, u64* counters) {
  all_to_all(h, parts, counters);
}
