// Host-initiated window operations that need the GPU's own ordering: the host enqueues them on
// the rank's stream, so they are ordered with the kernels and copies around them. Plain puts
// and gets between device buffers go by copy engine (cuMemcpyAsync) instead.
#include "ferrocomm/ferrocomm.cuh"

using namespace ferrocomm;

// One thread releases slot [id][rank] on `peer`. Stream order puts every earlier kernel and
// copy of this stream before it: their writes are complete at kernel boundaries, and the
// system-scope release then publishes them to the peer (rule 1).
extern "C" __global__ void ferrocomm_signal(ferrocomm_window_handle h, i32 peer, u32 id, u32 op, u64 value) {
  Window(h).signal(coop_thread(), peer, id, static_cast<SignalOp>(op), value);
}

// A signal that `source`, a rank on another host, sent through this rank's window server:
// one thread releases our own slot [id][source]. The server copied the source's earlier puts
// into our segment on this same stream, so they are complete before the release (rule 1).
extern "C" __global__ void ferrocomm_signal_from(ferrocomm_window_handle h, i32 source, u32 id, u32 op, u64 value) {
  const Window w(h);
  if (!w.abi_ok()) return;
  u64* slot = w.signal_slot(h.rank, id, source);
  if (op == FERROCOMM_SIGNAL_SET) {
    store_release(slot, value);
  } else {
    add_release(slot, value);
  }
}

// One thread waits (acquire) and writes what it saw to `out` (ok, source, value).
extern "C" __global__ void ferrocomm_wait_signal(ferrocomm_window_handle h, u32 id, i32 source, u32 cmp, u64 value,
                                                 u64* out) {
  Observed seen = Window(h).wait_signal(coop_thread(), id, source, static_cast<Cmp>(cmp), value);
  out[0] = seen.ok;
  out[1] = static_cast<u64>(static_cast<unsigned int>(seen.source));
  out[2] = seen.value;
}

// Every rank's one block meets; a timeout is left in the handle's status.
extern "C" __global__ void ferrocomm_barrier(ferrocomm_window_handle h) { Window(h).barrier(coop_block()); }

// Atomics for the host API (rule 4): the result goes to `out`.
extern "C" __global__ void ferrocomm_fetch_add(ferrocomm_window_handle h, i32 peer, u64 offset, u64 value, u64* out) {
  *out = Window(h).fetch_add(peer, offset, value);
}
extern "C" __global__ void ferrocomm_compare_swap(ferrocomm_window_handle h, i32 peer, u64 offset, u64 expected,
                                                  u64 desired, u64* out) {
  *out = Window(h).compare_swap(peer, offset, expected, desired);
}

// A put issued by SMs rather than the copy engine: block b copies the b-th of gridDim.x equal
// slices (16-byte aligned) with block scope. Used where a put must be stream-ordered with
// kernels only, and by the benchmark that compares SM puts with cudaMemcpy.
extern "C" __global__ void ferrocomm_put_blocks(ferrocomm_window_handle h, i32 peer, u64 dst_offset, const void* src,
                                                u64 bytes) {
  const u64 slice = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~15ull;
  const u64 begin = slice * blockIdx.x;
  if (begin >= bytes) return;
  const u64 len = bytes - begin < slice ? bytes - begin : slice;
  Window(h).put(coop_block(), peer, dst_offset + begin, static_cast<const unsigned char*>(src) + begin, len);
}
