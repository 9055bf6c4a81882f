// One-shot collectives on a window (the device backend's path for small messages):
// all_reduce, all_gather, reduce_scatter.
//
// Each rank copies its input into its own segment, signals every peer, waits for every peer's
// signal, then reads what it needs from every segment: all_reduce and reduce_scatter reduce in
// rank order 0, 1, ..., n-1, so every rank computes the same bits; all_gather copies. The
// protocol (epochs, signal ids, segment reuse) is in collective.cuh.

#include "collective.cuh"

using namespace ferrocomm;
using namespace ferrocomm::coll;

namespace {

// out = the reduction of every rank's `in` (n elements; in == out allowed).
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void all_reduce(const ferrocomm_window_handle& h, const void* in, void* out, u64 n,
                                        u64* counters, u32 vectors) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  const Window w(h);
  const Share sh = share_of<V>(n, vectors);
  Step s;
  if (!begin(w, counters, s)) return;
  copy_share(w.local_ptr<Raw>(0), static_cast<const Raw*>(in), sh);
  if (!exchange(w, s, s.ready)) return;
  reduce_share<E, OP>(w, 0, out, nullptr, sh);
  end(w, counters, s);
}

// outputs.ptr[r] (n_bytes) = rank r's `in`.
FERROCOMM_DEVICE_INLINE void all_gather(const ferrocomm_window_handle& h, const void* in, const Parts& outputs,
                                        u64 n_bytes, u64* counters, u32 vectors) {
  using Byte = unsigned char;
  const Window w(h);
  const Share sh = share_of<16>(n_bytes, vectors);
  Step s;
  if (!begin(w, counters, s)) return;
  copy_share(w.local_ptr<Byte>(0), static_cast<const Byte*>(in), sh);
  if (!exchange(w, s, s.ready)) return;
  for (i32 r = 0; r < w.size(); ++r) {
    copy_share(reinterpret_cast<Byte*>(outputs.ptr[r]), w.peer_ptr<const Byte>(r, 0), sh);
  }
  end(w, counters, s);
}

// out (n elements) = the reduction over ranks of their inputs.ptr[rank] (n elements each).
template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void reduce_scatter(const ferrocomm_window_handle& h, const Parts& inputs, void* out, u64 n,
                                            u64* counters, u32 vectors) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  const Window w(h);
  const Share sh = share_of<V>(n, vectors);
  Step s;
  if (!begin(w, counters, s)) return;
  // Our share of every block goes into our segment, block r at element r * n.
  for (i32 r = 0; r < w.size(); ++r) {
    copy_share(w.local_ptr<Raw>(0) + r * n, reinterpret_cast<const Raw*>(inputs.ptr[r]), sh);
  }
  if (!exchange(w, s, s.ready)) return;
  reduce_share<E, OP>(w, static_cast<u64>(w.rank()) * n, out, nullptr, sh);
  end(w, counters, s);
}

}  // namespace

#define FERROCOMM_ONESHOT(name, E, OP)                                                                 \
  extern "C" __global__ void __launch_bounds__(256, 1) ferrocomm_allreduce_oneshot_##name(            \
      ferrocomm_window_handle h, const void* in, void* out, u64 n, u64* counters, u32 vectors) {      \
    all_reduce<E, OP>(h, in, out, n, counters, vectors);                                                \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(256, 1) ferrocomm_reducescatter_oneshot_##name(        \
      ferrocomm_window_handle h, FERROCOMM_GRID_CONSTANT const Parts inputs, void* out, u64 n, u64* counters, u32 vectors) {        \
    reduce_scatter<E, OP>(h, inputs, out, n, counters, vectors);                                        \
  }

extern "C" __global__ void __launch_bounds__(256, 1)
    ferrocomm_allgather_oneshot(ferrocomm_window_handle h, const void* in, FERROCOMM_GRID_CONSTANT const Parts outputs,
                                u64 n_bytes,
                                u64* counters, u32 vectors) {
  all_gather(h, in, outputs, n_bytes, counters, vectors);
}

FERROCOMM_FOR_EACH_REDUCTION(FERROCOMM_ONESHOT)
