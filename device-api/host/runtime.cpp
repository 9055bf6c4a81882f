// The launcher of the host device (device-api/include/ferrocomm/host/runtime.h): runs one
// kernel launch to completion on CPU threads, one per CUDA thread, every block at once.
//
// Threads come from a process-wide pool that grows to the largest number of threads in
// flight and keeps them parked between launches (creating thousands of threads per launch
// would dominate every small collective). A launch first takes every thread it needs and only
// then starts them: a launch whose threads cannot all be had runs none of them (a partial grid
// would hang in its barriers) and reports the error instead.
#define FERROCOMM_HOST_DEVICE 1
#include "ferrocomm/host/runtime.h"

#include <errno.h>
#include <pthread.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

namespace {

using namespace ferrocomm_host;

// Lives on the launcher's stack. Workers count down under `lock`, so the launcher (which
// waits holding it) cannot return before the last worker has let go of it.
struct Launch {
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  unsigned long long remaining = 0;
  std::mutex lock;
  std::condition_variable finished;
};

struct Task {
  Launch* launch = nullptr;
  Thread thread;
};

// A pooled thread: parked until `state` says RUN, then runs `task` and parks again.
struct Worker {
  enum : int { PARKED = 0, RUN = 1 };
  std::atomic<int> state{PARKED};
  Task* task = nullptr;
};

// Stacks of kernel threads: device code keeps little on its stack; sanitizers want more.
constexpr size_t STACK_BYTES = 512 * 1024;
constexpr unsigned long long SHARED_BYTES = 48 * 1024;

std::mutex pool_lock;
std::vector<Worker*> idle;

void park(Worker* w) {
  std::lock_guard<std::mutex> g(pool_lock);
  idle.push_back(w);
}

void* work(void* arg) {
  Worker* w = static_cast<Worker*>(arg);
  for (;;) {
    while (w->state.load(std::memory_order_acquire) != Worker::RUN) w->state.wait(Worker::PARKED, std::memory_order_acquire);
    Task* t = w->task;
    Launch* l = t->launch;
    current = &t->thread;
    l->body(l->ctx);
    current = nullptr;
    w->state.store(Worker::PARKED, std::memory_order_relaxed);
    // Back in the pool before the launch may return: the next launch finds it. Once the
    // lock is released the launch (on its launcher's stack) may be gone.
    park(w);
    std::lock_guard<std::mutex> g(l->lock);
    if (--l->remaining == 0) l->finished.notify_all();
  }
  return nullptr;
}

// `n` parked workers, creating what the pool lacks; on failure returns what it took and an errno.
int take(size_t n, std::vector<Worker*>& out) {
  {
    std::lock_guard<std::mutex> g(pool_lock);
    while (out.size() < n && !idle.empty()) {
      out.push_back(idle.back());
      idle.pop_back();
    }
  }
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, STACK_BYTES);
  int failure = 0;
  while (out.size() < n && !failure) {
    Worker* w = new (std::nothrow) Worker;
    if (w == nullptr) {
      failure = ENOMEM;
      break;
    }
    pthread_t id;
    failure = pthread_create(&id, &attr, work, w);
    if (failure) {
      delete w;
    } else {
      pthread_detach(id);
      out.push_back(w);
    }
  }
  pthread_attr_destroy(&attr);
  if (failure) {
    for (Worker* w : out) park(w);
    out.clear();
  }
  return failure;
}

}  // namespace

// Runs `body(ctx)` on grid x block threads with CUDA's thread indices set, and returns when
// all have returned. 0 on success, else an errno value (EINVAL: an empty or oversized shape;
// EAGAIN / ENOMEM: the threads could not be had).
extern "C" int ferrocomm_host_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                     unsigned long long shared_bytes, void (*body)(void*), void* ctx) {
  const unsigned long long blocks = 1ull * gx * gy * gz, threads = 1ull * bx * by * bz;
  if (blocks == 0 || threads == 0 || threads > 1024 || blocks * threads > 65536 || body == nullptr) return EINVAL;
  const unsigned long long shared = shared_bytes + SHARED_BYTES;
  const unsigned warps = static_cast<unsigned>((threads + WARP - 1) / WARP);

  std::unique_ptr<Block[]> block_state(new (std::nothrow) Block[blocks]);
  std::unique_ptr<Warp[]> warp_state(new (std::nothrow) Warp[blocks * warps]);
  std::unique_ptr<unsigned char[]> shared_mem(new (std::nothrow) unsigned char[blocks * shared]);
  std::unique_ptr<Task[]> tasks(new (std::nothrow) Task[blocks * threads]);
  if (!block_state || !warp_state || !shared_mem || !tasks) return ENOMEM;
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

  std::vector<Worker*> workers;
  workers.reserve(blocks * threads);
  if (const int failure = take(blocks * threads, workers)) return failure;

  Launch launch;
  launch.body = body;
  launch.ctx = ctx;
  launch.remaining = blocks * threads;
  for (unsigned long long b = 0; b < blocks; ++b) {
    for (unsigned long long t = 0; t < threads; ++t) {
      Task& task = tasks[b * threads + t];
      task.launch = &launch;
      task.thread.block = &block_state[b];
      task.thread.linear = static_cast<unsigned>(t);
      task.thread.block_dim = dim3{bx, by, bz};
      task.thread.grid_dim = dim3{gx, gy, gz};
      task.thread.thread_idx = dim3{static_cast<unsigned>(t % bx), static_cast<unsigned>(t / bx % by),
                                    static_cast<unsigned>(t / (1ull * bx * by))};
      task.thread.block_idx = dim3{static_cast<unsigned>(b % gx), static_cast<unsigned>(b / gx % gy),
                                   static_cast<unsigned>(b / (1ull * gx * gy))};
      Worker* w = workers[b * threads + t];
      w->task = &task;
      w->state.store(Worker::RUN, std::memory_order_release);
      w->state.notify_one();
    }
  }
  std::unique_lock<std::mutex> g(launch.lock);
  launch.finished.wait(g, [&] { return launch.remaining == 0; });
  return 0;
}
