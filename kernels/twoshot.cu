// Two-shot all_reduce (reduce-scatter, then all-gather, through one window): for messages
// where the one-shot's n reads of the whole message cost more than a second signal round.
//
// The message is cut into one slice per rank (whole 16-byte groups). Each rank copies its
// input into its segment and signals READY; rank r then reduces slice r over every segment in
// rank order (the same bits as the one-shot), writes it to its output and over slice r of its
// own segment (only rank r reads that slice of our input), and signals REDUCED; last, every
// rank copies each peer's reduced slice into its output. Each rank reads 2x the message
// instead of n x. The protocol (epochs, ids, segment reuse) is in collective.cuh.

#include "collective.cuh"

using namespace ferrocomm;
using namespace ferrocomm::coll;

namespace {

template <class E, u32 OP>
FERROCOMM_DEVICE_INLINE void all_reduce_twoshot(const ferrocomm_window_handle& h, const void* in, void* out, u64 n,
                                                u64* counters, u32 vectors) {
  using Raw = typename E::Raw;
  constexpr u64 V = 16 / sizeof(Raw);
  const Window w(h);
  const u64 size = static_cast<u64>(w.size());
  const Slices<V> slices(n, size, vectors);
  auto share = [&](u64 r) { return slices.share(r); };
  Step s;
  if (!begin(w, counters, s)) return;
  for (u64 r = 0; r < size; ++r) copy_share(w.local_ptr<Raw>(0), static_cast<const Raw*>(in), share(r));
  if (!exchange(w, s, s.ready)) return;
  const Share mine = share(static_cast<u64>(w.rank()));
  reduce_share<E, OP>(w, 0, out, w.local_ptr<Raw>(0), mine);
  if (!exchange(w, s, s.reduced)) return;
  for (i32 r = 0; r < w.size(); ++r) {
    if (r != w.rank()) copy_share(static_cast<Raw*>(out), w.peer_ptr<const Raw>(r, 0), share(r));
  }
  end(w, counters, s);
}

}  // namespace

#define FERROCOMM_TWOSHOT(name, E, OP)                                                                 \
  extern "C" __global__ void __launch_bounds__(256, 1) ferrocomm_allreduce_twoshot_##name(            \
      ferrocomm_window_handle h, const void* in, void* out, u64 n, u64* counters, u32 vectors) {      \
    all_reduce_twoshot<E, OP>(h, in, out, n, counters, vectors);                                        \
  }

FERROCOMM_FOR_EACH_REDUCTION(FERROCOMM_TWOSHOT)
