// Kernels of ferrocomm-bench's device rows.
#include "ferrocomm/ferrocomm.cuh"

using namespace ferrocomm;

// put(8 B) + signal, then wait for the peer's answer, `iters` times; the two ranks run it at
// once. The initiator sends first. Signal values are epochs: iteration i waits for base + i + 1.
// out[0] = 1 on success, out[1] = nanoseconds from first send to last receipt.
extern "C" __global__ void ferrocomm_bench_pingpong(ferrocomm_window_handle h, i32 peer, u32 id, u32 iters,
                                                    u32 initiator, u64 base, u64* out) {
  Window w(h);
  const u64 payload = 0x5eed0000ull + w.rank();
  const u64 t0 = now_ns();
  for (u32 i = 0; i < iters; ++i) {
    const u64 epoch = base + i + 1;
    if (initiator) {
      w.put_signal(coop_thread(), peer, 0, &payload, 8, id, SignalOp::Set, epoch);
      if (!w.wait_signal(coop_thread(), id, peer, Cmp::Ge, epoch).ok) return;
    } else {
      if (!w.wait_signal(coop_thread(), id, peer, Cmp::Ge, epoch).ok) return;
      w.put_signal(coop_thread(), peer, 0, &payload, 8, id, SignalOp::Set, epoch);
    }
  }
  out[0] = 1;
  out[1] = now_ns() - t0;
}
