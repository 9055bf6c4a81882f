// The launcher of the host device (device-api/include/ferrocomm/host/runtime.h): runs one
// kernel launch to completion on CPU threads, one per CUDA thread, every block at once.
//
// All threads are created before any runs the kernel: they wait at a gate, so a launch whose
// threads cannot all be created runs none of them (a partial grid would hang in its barriers)
// and reports the error instead.
#define FERROCOMM_HOST_DEVICE 1
#include "ferrocomm/host/runtime.h"

#include <errno.h>
#include <pthread.h>

#include <memory>
#include <new>
#include <vector>

namespace {

using namespace ferrocomm_host;

struct Launch {
  void (*body)(void*);
  void* ctx;
  std::atomic<int> gate{0};  // 1: run, 2: give up
};

struct Start {
  Launch* launch;
  Thread thread;
};

void* run_thread(void* arg) {
  Start* s = static_cast<Start*>(arg);
  for (;;) {
    const int g = s->launch->gate.load(std::memory_order_acquire);
    if (g == 2) return nullptr;
    if (g == 1) break;
    s->launch->gate.wait(0, std::memory_order_acquire);
  }
  current = &s->thread;
  s->launch->body(s->launch->ctx);
  current = nullptr;
  return nullptr;
}

// Stacks of kernel threads: device code keeps little on its stack; sanitizers want more.
constexpr size_t STACK_BYTES = 512 * 1024;
constexpr unsigned long long SHARED_BYTES = 48 * 1024;

}  // namespace

// Runs `body(ctx)` on grid x block threads with CUDA's thread indices set, and returns when
// all have returned. 0 on success, else an errno value (EINVAL: an empty or oversized shape;
// EAGAIN / ENOMEM: the threads could not be created).
extern "C" int ferrocomm_host_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                     unsigned long long shared_bytes, void (*body)(void*), void* ctx) {
  const unsigned long long blocks = 1ull * gx * gy * gz, threads = 1ull * bx * by * bz;
  if (blocks == 0 || threads == 0 || threads > 1024 || blocks * threads > 65536 || body == nullptr) return EINVAL;
  const unsigned long long shared = shared_bytes + SHARED_BYTES;
  const unsigned warps = static_cast<unsigned>((threads + WARP - 1) / WARP);

  Launch launch{body, ctx};
  std::unique_ptr<Block[]> block_state(new (std::nothrow) Block[blocks]);
  std::unique_ptr<Warp[]> warp_state(new (std::nothrow) Warp[blocks * warps]);
  std::unique_ptr<unsigned char[]> shared_mem(new (std::nothrow) unsigned char[blocks * shared]);
  std::unique_ptr<Start[]> starts(new (std::nothrow) Start[blocks * threads]);
  if (!block_state || !warp_state || !shared_mem || !starts) return ENOMEM;
  for (unsigned long long b = 0; b < blocks; ++b) {
    Block& blk = block_state[b];
    blk.barrier.size = static_cast<unsigned>(threads);
    for (auto& a : blk.all) a.store(1, std::memory_order_relaxed);
    blk.warps = &warp_state[b * warps];
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned long long first = 1ull * w * WARP;
      blk.warps[w].barrier.size = static_cast<unsigned>(threads - first < WARP ? threads - first : WARP);
      for (auto& l : blk.warps[w].lane) l.store(0, std::memory_order_relaxed);
    }
    blk.shared = &shared_mem[b * shared];
    blk.shared_bytes = shared;
    memset(blk.shared, 0, shared);
  }

  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, STACK_BYTES);
  std::vector<pthread_t> created;
  created.reserve(blocks * threads);
  int failure = 0;
  for (unsigned long long b = 0; b < blocks && !failure; ++b) {
    for (unsigned long long t = 0; t < threads && !failure; ++t) {
      Start& s = starts[b * threads + t];
      s.launch = &launch;
      s.thread.block = &block_state[b];
      s.thread.linear = static_cast<unsigned>(t);
      s.thread.block_dim = dim3{bx, by, bz};
      s.thread.grid_dim = dim3{gx, gy, gz};
      s.thread.thread_idx = dim3{static_cast<unsigned>(t % bx), static_cast<unsigned>(t / bx % by),
                                 static_cast<unsigned>(t / (1ull * bx * by))};
      s.thread.block_idx = dim3{static_cast<unsigned>(b % gx), static_cast<unsigned>(b / gx % gy),
                                static_cast<unsigned>(b / (1ull * gx * gy))};
      pthread_t id;
      failure = pthread_create(&id, &attr, run_thread, &s);
      if (!failure) created.push_back(id);
    }
  }
  pthread_attr_destroy(&attr);
  launch.gate.store(failure ? 2 : 1, std::memory_order_release);
  launch.gate.notify_all();
  for (pthread_t id : created) pthread_join(id, nullptr);
  return failure;
}
