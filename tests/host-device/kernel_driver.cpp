// Runs every kernel of kernels/*.cu and tests/gpu/kernels.cu on the host device with several
// ranks at once, so that a sanitizer build (scripts/host-device-sanitize.sh: ThreadSanitizer,
// then AddressSanitizer + UndefinedBehaviorSanitizer) instruments every memory access the
// kernels make. The windows have the layout the device backend builds (abi.h;
// host/backend/device/window.rs and collectives.rs): ranks are threads of this process and
// share one allocation, segment r at base + r * stride.
//
// Results are checked against references computed here: collectives reduce in rank order in
// f32, so they must match bit for bit. Exits 1 on the first wrong value (printing what), 0 when
// everything matched.
//
// Usage: kernel_driver [max ranks, default 4]
#define FERROCOMM_HOST_DEVICE 1
#include "../../kernels/alltoall.cu"
#include "../../kernels/bench.cu"
#include "../../kernels/fused_norm.cu"
#include "../../kernels/moe.cu"
#include "../../kernels/multimem.cu"
#include "../../kernels/norm_pass.cu"
#include "../../kernels/oneshot.cu"
#include "../../kernels/rma.cu"
#include "../../kernels/twoshot.cu"
#include "../gpu/kernels.cu"

#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <thread>
#include <vector>

extern "C" int ferrocomm_host_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                     unsigned long long shared_bytes, void (*body)(void*), void* ctx);

namespace {

using namespace ferrocomm::coll;

[[noreturn]] void fail(const char* what, long long a, long long b, long long c) {
  fprintf(stderr, "FAILED: %s (%lld, %lld, %lld)\n", what, a, b, c);
  exit(1);
}

// One launch on this thread's rank: grid x block threads run `k`.
void launch(unsigned blocks, unsigned threads, std::function<void()> k) {
  auto body = [](void* p) { (*static_cast<std::function<void()>*>(p))(); };
  const int rc = ferrocomm_host_launch(blocks, 1, 1, threads, 1, 1, 0, body, &k);
  if (rc != 0) fail("ferrocomm_host_launch", rc, blocks, threads);
}

// A window of `size` ranks in one allocation, laid out as window.rs does.
struct Group {
  int size;
  u64 data_bytes, signal_offset, barrier_offset, stride;
  std::vector<unsigned char> memory;
  std::vector<ferrocomm_status> status;
  u32 abort_flag = 0;
  std::vector<std::vector<u64>> counters;  // per rank: shot epochs + all_to_all counters

  // Kernels hold addresses into it: never copied (a copy would also race with them).
  Group(const Group&) = delete;
  Group(Group&&) = default;

  Group(int n, u64 bytes, u32 signals) : size(n), status(n) {
    auto up = [](u64 x) { return (x + 255) / 256 * 256; };
    data_bytes = bytes;
    signal_offset = up(bytes);
    barrier_offset = up(signal_offset + u64(signals) * n * 8);
    stride = up(barrier_offset + (n + 1) * 8);
    memory.assign(stride * n + 16, 0);
    counters.assign(n, std::vector<u64>(MAX_BLOCKS + MAX_BLOCKS + 2 * MAX_BLOCKS * MAX_RANKS, 0));
    memset(status.data(), 0, sizeof(ferrocomm_status) * n);
    signals_ = signals;
  }

  ferrocomm_window_handle handle(int rank) {
    ferrocomm_window_handle h{};
    h.base = (reinterpret_cast<u64>(memory.data()) + 15) & ~15ull;
    h.stride = stride;
    h.data_bytes = data_bytes;
    h.signal_offset = signal_offset;
    h.barrier_offset = barrier_offset;
    h.status = reinterpret_cast<u64>(&status[rank]);
    h.abort_flag = reinterpret_cast<u64>(&abort_flag);
    h.timeout_ns = 20ull * 1000 * 1000 * 1000;
    h.rank = rank;
    h.size = size;
    h.signals = signals_;
    h.abi_version = FERROCOMM_ABI_VERSION;
    return h;
  }

  void check_status(const char* what) {
    for (int r = 0; r < size; ++r) {
      if (status[r].code != FERROCOMM_STATUS_OK) fail(what, r, status[r].code, status[r].peer);
    }
  }

  // Runs f(rank) on one thread per rank, all at once.
  void ranks(const std::function<void(int)>& f) {
    std::vector<std::thread> ts;
    for (int r = 0; r < size; ++r) ts.emplace_back(f, r);
    for (auto& t : ts) t.join();
  }

  u32 signals_;
};

u64 mix(u64 x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Small values so sums stay exact enough to be interesting, and negative ones for min / max.
template <class E>
typename E::Raw value(int rank, u64 i, u64 seed) {
  const float v = static_cast<float>(static_cast<int>(mix(seed ^ (u64(rank) << 40) ^ i) % 2001) - 1000) / 64.0f;
  return E::put(v);
}

template <class E, u32 OP>
typename E::Raw reference(int size, u64 i, u64 seed) {
  float acc = E::get(value<E>(0, i, seed));
  for (int r = 1; r < size; ++r) acc = combine<OP>(acc, E::get(value<E>(r, i, seed)));
  return finish<E, OP>(acc, size);
}

using ShotKernel = void (*)(ferrocomm_window_handle, const void*, void*, u64, u64*, u32);

// all_reduce (one- or two-shot) of `n` elements on every rank, `calls` times in a row.
template <class E, u32 OP>
void check_all_reduce(Group& g, ShotKernel k, const char* name, u64 n, unsigned blocks, unsigned threads, int calls) {
  using Raw = typename E::Raw;
  for (int call = 0; call < calls; ++call) {
    const u64 seed = mix(n * 131 + call);
    std::vector<std::vector<Raw>> in(g.size), out(g.size);
    for (int r = 0; r < g.size; ++r) {
      in[r].resize(n + 8);
      out[r].assign(n + 8, Raw(0x7777));
      for (u64 i = 0; i < n; ++i) in[r][i] = value<E>(r, i, seed);
    }
    g.ranks([&](int r) {
      ferrocomm_window_handle h = g.handle(r);
      const u32 vectors = ((reinterpret_cast<u64>(in[r].data()) | reinterpret_cast<u64>(out[r].data())) & 15) == 0;
      launch(blocks, threads, [&, h, vectors] { k(h, in[r].data(), out[r].data(), n, g.counters[r].data(), vectors); });
    });
    g.check_status(name);
    for (int r = 0; r < g.size; ++r) {
      for (u64 i = 0; i < n; ++i) {
        if (out[r][i] != reference<E, OP>(g.size, i, seed)) fail(name, r, static_cast<long long>(i), g.size);
      }
      if (out[r][n] != Raw(0x7777)) fail("all_reduce wrote past its end", r, static_cast<long long>(n), g.size);
    }
  }
}

void check_all_gather(Group& g, u64 bytes, unsigned blocks, unsigned threads) {
  std::vector<std::vector<unsigned char>> in(g.size), out(g.size);
  for (int r = 0; r < g.size; ++r) {
    in[r].resize(bytes);
    for (u64 i = 0; i < bytes; ++i) in[r][i] = static_cast<unsigned char>(mix(r * 977 + i));
    out[r].assign(bytes * g.size, 0xee);
  }
  g.ranks([&](int r) {
    Parts parts{};
    for (int p = 0; p < g.size; ++p) parts.ptr[p] = reinterpret_cast<u64>(out[r].data() + p * bytes);
    ferrocomm_window_handle h = g.handle(r);
    launch(blocks, threads, [&, h, parts] { ferrocomm_allgather_oneshot(h, in[r].data(), parts, bytes, g.counters[r].data(), 0); });
  });
  g.check_status("all_gather");
  for (int r = 0; r < g.size; ++r) {
    for (int p = 0; p < g.size; ++p) {
      for (u64 i = 0; i < bytes; ++i) {
        if (out[r][p * bytes + i] != in[p][i]) fail("all_gather", r, p, static_cast<long long>(i));
      }
    }
  }
}

void check_reduce_scatter(Group& g, u64 n, unsigned blocks, unsigned threads) {
  std::vector<std::vector<u32>> in(g.size), out(g.size);
  const u64 seed = 99;
  for (int r = 0; r < g.size; ++r) {
    in[r].resize(n * g.size);
    for (int b = 0; b < g.size; ++b) {
      for (u64 i = 0; i < n; ++i) in[r][b * n + i] = value<F32>(r, b * n + i, seed);
    }
    out[r].assign(n, 0x7f7f7f7f);
  }
  g.ranks([&](int r) {
    Parts parts{};
    u64 addresses = reinterpret_cast<u64>(out[r].data());
    for (int p = 0; p < g.size; ++p) {
      parts.ptr[p] = reinterpret_cast<u64>(in[r].data() + p * n);
      addresses |= parts.ptr[p];
    }
    // 16-byte accesses where every part allows them, as the host decides.
    const u32 vectors = (addresses & 15) == 0;
    ferrocomm_window_handle h = g.handle(r);
    launch(blocks, threads, [&, h, parts, vectors] {
      ferrocomm_reducescatter_oneshot_f32_sum(h, parts, out[r].data(), n, g.counters[r].data(), vectors);
    });
  });
  g.check_status("reduce_scatter");
  for (int r = 0; r < g.size; ++r) {
    for (u64 i = 0; i < n; ++i) {
      if (out[r][i] != reference<F32, REDUCE_SUM>(g.size, r * n + i, seed)) fail("reduce_scatter", r, static_cast<long long>(i), g.size);
    }
  }
}

// all_to_all with a different length per pair (below `max_len`), through slots of
// `slot_payload` bytes: most pairs take several chunks, the last one short, which the 16
// blocks cut differently from a full one.
void check_all_to_all(Group& g, u64 region, u64 slot_payload, u64 max_len, int calls) {
  for (int call = 0; call < calls; ++call) {
    auto len = [&](int from, int to) { return (mix(from * 31 + to * 7 + call) % max_len) + (from == to ? 0 : 1); };
    std::vector<std::vector<std::vector<unsigned char>>> send(g.size), recv(g.size);
    for (int r = 0; r < g.size; ++r) {
      send[r].resize(g.size);
      recv[r].resize(g.size);
      for (int p = 0; p < g.size; ++p) {
        send[r][p].resize(len(r, p));
        for (u64 i = 0; i < send[r][p].size(); ++i) send[r][p][i] = static_cast<unsigned char>(mix(r * 1000003 + p * 1009 + i + call));
        recv[r][p].assign(len(p, r), 0xee);
      }
    }
    g.ranks([&](int r) {
      AllToAll a{};
      for (int p = 0; p < g.size; ++p) {
        a.send[p] = reinterpret_cast<u64>(send[r][p].data());
        a.send_len[p] = send[r][p].size();
        a.recv[p] = reinterpret_cast<u64>(recv[r][p].data());
        a.recv_len[p] = recv[r][p].size();
      }
      a.region = region;
      a.slot = HEADER_BYTES + slot_payload;
      ferrocomm_window_handle h = g.handle(r);
      u64* counters = g.counters[r].data() + MAX_BLOCKS;
      launch(MAX_BLOCKS, 32, [=] { ferrocomm_alltoall(h, a, counters); });
    });
    g.check_status("all_to_all");
    for (int r = 0; r < g.size; ++r) {
      for (int p = 0; p < g.size; ++p) {
        if (recv[r][p] != send[p][r]) fail("all_to_all", r, p, call);
      }
    }
  }
}

// A proxy queue per rank (abi.h, ferrocomm_proxy_queue) and one proxy thread each, which runs
// the descriptors as a window's proxy and the peers' window servers do together: a put is a
// memcpy from the origin's segment into the target's, a signal a release store (or release add)
// on the target's pad; `tail` and `done` are released after each descriptor. Ranks r with
// remote(r, p) reach p only through it. In-process, so the sanitizers see the whole path:
// producer release of word 0, proxy acquire, copy, release of the signal, waiter's acquire.
struct Proxies {
  static constexpr u64 CAP = 64;
  struct Rank {
    std::vector<u64> slots = std::vector<u64>(2 * CAP, 0);
    u64 head = 0, tail = 0, done = 0;
    std::vector<unsigned char> remote;
    ferrocomm_proxy_queue q{};
  };
  Group& g;
  std::vector<Rank> ranks;
  std::vector<std::thread> threads;
  bool stop = false;

  Proxies(Group& group, const std::function<bool(int, int)>& remote) : g(group), ranks(group.size) {
    for (int r = 0; r < g.size; ++r) {
      Rank& k = ranks[r];
      for (int p = 0; p < g.size; ++p) k.remote.push_back(remote(r, p) ? 1 : 0);
      k.q.slots = reinterpret_cast<u64>(k.slots.data());
      k.q.head = reinterpret_cast<u64>(&k.head);
      k.q.tail = reinterpret_cast<u64>(&k.tail);
      k.q.done = reinterpret_cast<u64>(&k.done);
      k.q.remote = reinterpret_cast<u64>(k.remote.data());
      k.q.capacity = CAP;
    }
    for (int r = 0; r < g.size; ++r) threads.emplace_back([this, r] { serve(r); });
  }
  Proxies(const Proxies&) = delete;
  ~Proxies() {
    __atomic_store_n(&stop, true, __ATOMIC_RELEASE);
    for (auto& t : threads) t.join();
  }

  ferrocomm_window_handle handle(int r) {
    ferrocomm_window_handle h = g.handle(r);
    h.fifo = reinterpret_cast<u64>(&ranks[r].q);
    return h;
  }

  unsigned char* segment(int r) { return reinterpret_cast<unsigned char*>(g.handle(r).base + u64(r) * g.stride); }

  void serve(int me) {
    Rank& k = ranks[me];
    for (u64 t = 0;; ++t) {
      u64* slot = &k.slots[2 * (t % CAP)];
      const u64 parity = (~(t / CAP)) & 1;
      u64 w0;
      for (;;) {
        w0 = __atomic_load_n(&slot[0], __ATOMIC_ACQUIRE);
        if ((w0 >> FERROCOMM_PROXY_PARITY_BIT) == parity) break;
        if (__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) return;
        std::this_thread::yield();
      }
      const u64 w1 = slot[1];
      const u32 op = (w0 >> FERROCOMM_PROXY_OP_SHIFT) & 0x7f;
      const int peer = int((w0 >> FERROCOMM_PROXY_PEER_SHIFT) & FERROCOMM_PROXY_MAX_PEER);
      if (peer >= g.size || !k.remote[peer]) fail("proxy descriptor toward a mapped or bad rank", me, peer, op);
      if (op == FERROCOMM_PROXY_PUT) {
        const u64 dst = w0 & FERROCOMM_PROXY_OFFSET_MASK, src = w1 & FERROCOMM_PROXY_OFFSET_MASK;
        const u64 bytes = w1 >> FERROCOMM_PROXY_BYTES_SHIFT;
        if (dst + bytes > g.data_bytes || src + bytes > g.data_bytes) fail("proxy put out of bounds", me, dst, src);
        memcpy(segment(peer) + dst, segment(me) + src, bytes);
      } else if (op == FERROCOMM_PROXY_SIGNAL) {
        const u32 id = u32(w0);
        u64* pad = reinterpret_cast<u64*>(segment(peer) + g.signal_offset + (u64(id) * g.size + me) * 8);
        if ((w0 >> 32) & 1) {
          __atomic_fetch_add(pad, w1, __ATOMIC_RELEASE);
        } else {
          __atomic_store_n(pad, w1, __ATOMIC_RELEASE);
        }
      } else {
        fail("proxy descriptor op", me, op, t);
      }
      __atomic_store_n(&k.tail, t + 1, __ATOMIC_RELEASE);
      __atomic_store_n(&k.done, t + 1, __ATOMIC_RELEASE);
    }
  }
};

// MoE dispatch then combine (kernels/moe.cu) on `g.size` ranks, `calls` times in a row (the
// epochs advance), laid out as host/backend/device/moe.rs does: bf16 rows of 128, two local
// experts per rank, K = 2 distinct experts per token (some slots -1), 5 + rank tokens. With
// `hosts`, odd and even ranks are on two "hosts": toward the other host the kernels build
// slots in their outboxes and put them through the proxy queue (Proxies above), with DONE and
// READY signals through it too; within a host they store directly. Call 1 (of more than 2, with
// peers) gives the last rank a bad expert id: it records it, every other rank records its
// refusal, nothing is written to any output (the combine's counts are then still -1, so every
// combine send refuses too), and the next call runs normally. Calls 2 and 3 (of more than 4,
// with peers) run the dispatch only, with header-only announcements of a larger shape (hidden
// 256, OP_GROW, as host/backend/device/moe.rs announces before it grows the window): by the last
// rank alone (every rank records OP_SHAPE naming one of the other shape), then by every rank
// (they agree: nothing recorded); nothing is written, and the next call runs normally. Call 5
// (of more than 5, with peers) cuts every expert at 3 rows: a rank whose expert overflowed
// records OP_CAPACITY, a rank whose token lost a row OP_MISSING with the smallest (token, k,
// owner) in its C_MISSING counter; its tokens with a lost row keep their bits, the others
// are combined.
void check_moe_on(int calls, bool hosts) {
  namespace m = ferrocomm::moe;
  auto up16 = [](u64 x) { return (x + 15) / 16 * 16; };
  for (int size : {1, 2, 3, 4}) {
    if (hosts && size == 1) continue;
    const u64 local = 2, experts = local * size, topk = 2, hidden = 128, capacity = 32;
    const u64 rows = local * capacity, header = up16(64 + 4 * local), data = up16(hidden * 4);
    const u64 dslot = header + rows * (up16(4 + 4 * topk) + data), cslot = header + rows * (16 + data);
    const u64 outbox = hosts ? size * (dslot + cslot) : 0;
    Group g(size, size * (dslot + cslot) + (hosts ? size * std::max(dslot, cslot) : 0), 2 + 2 * m::MOE_BLOCKS);
    Proxies proxies(g, [&](int r, int p) { return hosts && (r & 1) != (p & 1); });
    std::vector<std::vector<u64>> counters(size, std::vector<u64>(m::C_MISSING + 1, 0));
    std::vector<ferrocomm_status> errors(size);
    memset(errors.data(), 0, sizeof(ferrocomm_status) * size);
    for (int call = 0; call < calls; ++call) {
      const bool bad = call == 1 && calls > 2 && size > 1;
      const bool grow = (call == 2 || call == 3) && calls > 4 && size > 1;
      const bool cut = call == 5 && size > 1;
      const u64 cap = cut ? 3 : capacity;
      auto tokens_of = [](int r) { return u64(5 + r); };
      std::vector<std::vector<u16>> tok(size), rt(size), eo(size), out(size);
      std::vector<std::vector<i32>> idx(size), counts(size), src(size);
      std::vector<std::vector<float>> wts(size);
      // Element j of token t's combine on rank r where every row came back as itself:
      // sum_k w_k * token, in k order.
      auto combined = [&](int r, u64 t, u64 j) {
        float acc = 0.0f;
        for (u64 k = 0; k < topk; ++k) {
          if (idx[r][t * topk + k] >= 0) acc = fmaf(wts[r][t * topk + k], Bf16::get(tok[r][t * hidden + j]), acc);
        }
        return Bf16::put(acc);
      };
      for (int r = 0; r < size; ++r) {
        const u64 t = tokens_of(r);
        for (u64 i = 0; i < t * hidden; ++i) tok[r].push_back(Bf16::put(float((long long)(mix(r * 7919 + i + call * 31) % 64) - 32) / 8.0f));
        for (u64 i = 0; i < t; ++i) {
          const i32 a = i32(mix(r * 131 + i + call) % experts);
          const i32 b = (i % 3 == 0 || experts == 1) ? -1 : i32((a + 1 + mix(i + r) % (experts - 1)) % experts);
          idx[r].push_back(a);
          idx[r].push_back(b);
          if (bad && r == size - 1 && i == 0) idx[r][1] = 99;
          wts[r].push_back(0.5f + float(i % 4));
          wts[r].push_back(-0.25f * float(i % 3));
        }
        rt[r].assign(rows * hidden, 0xffff);
        counts[r].assign(local, -1);
        src[r].assign(rows * 3, -1);
        out[r].assign(t * hidden, 0xffff);
      }
      g.ranks([&](int r) {
        m::Args a{};
        a.hidden = hidden, a.topk = topk, a.experts = experts, a.local = local, a.capacity = cap;
        a.row_bytes = hidden * 2, a.header = header, a.rows = rows, a.outbox = outbox;
        a.errors = reinterpret_cast<u64>(&errors[r]);
        ferrocomm_window_handle h = proxies.handle(r);
        u64* c = counters[r].data();
        m::Args d = a;
        d.region = 0, d.slot = dslot, d.record = up16(4 + 4 * topk) + up16(a.row_bytes);
        m::Args ds = d;
        ds.tokens = reinterpret_cast<u64>(tok[r].data()), ds.idx = reinterpret_cast<u64>(idx[r].data());
        ds.n_tokens = tokens_of(r);
        m::Args dr = d;
        dr.tokens = reinterpret_cast<u64>(rt[r].data()), dr.counts = reinterpret_cast<u64>(counts[r].data());
        dr.src = reinterpret_cast<u64>(src[r].data());
        if (grow && (call == 3 || r == size - 1)) {
          // An announcement: no buffers, only the shape.
          ds = d, ds.refuse = m::OP_GROW, ds.hidden = 256;
          dr = ds;
        }
        launch(size, 32, [=] { ferrocomm_moe_dispatch_send(h, ds, c); });
        launch(m::MOE_BLOCKS, 32, [=] { ferrocomm_moe_dispatch_recv(h, dr, c); });
        if (grow) return;
        // The experts' outputs: the rows themselves.
        eo[r] = rt[r];
        m::Args cm = a;
        cm.region = size * dslot, cm.slot = cslot, cm.record = 16 + up16(a.row_bytes), cm.dtype = 2;
        m::Args cs = cm;
        cs.tokens = reinterpret_cast<u64>(eo[r].data()), cs.counts = reinterpret_cast<u64>(counts[r].data());
        cs.src = reinterpret_cast<u64>(src[r].data());
        launch(size, 32, [=] { ferrocomm_moe_combine_send(h, cs, c); });
        m::Args cr = cm;
        cr.idx = reinterpret_cast<u64>(idx[r].data()), cr.weights = reinterpret_cast<u64>(wts[r].data());
        cr.out = reinterpret_cast<u64>(out[r].data()), cr.n_tokens = tokens_of(r);
        launch(m::MOE_BLOCKS, 32, [=] { ferrocomm_moe_combine_recv(h, cr, c); });
      });
      g.check_status("moe");
      if (bad) {
        for (int r = 0; r < size; ++r) {
          const bool culprit = r == size - 1;
          if (errors[r].code != FERROCOMM_STATUS_INVALID || errors[r].op != (culprit ? m::OP_EXPERT : m::OP_REFUSED_EXPERT) ||
              errors[r].peer != (culprit ? -1 : size - 1) || errors[r].expected != 1 || errors[r].observed != 99) {
            fail("moe refusal record", r, errors[r].op, errors[r].peer);
          }
          for (u16 x : rt[r]) {
            if (x != 0xffff) fail("moe refused dispatch wrote a row", r, x, 0);
          }
          for (i32 c : counts[r]) {
            if (c != -1) fail("moe refused dispatch wrote a count", r, c, 0);
          }
          for (u16 x : out[r]) {
            if (x != 0xffff) fail("moe refused combine wrote a token", r, x, 0);
          }
        }
        memset(errors.data(), 0, sizeof(ferrocomm_status) * size);
        continue;
      }
      if (grow) {
        for (int r = 0; r < size; ++r) {
          const bool last = r == size - 1;
          const ferrocomm_status& e = errors[r];
          if (call == 3 && e.code != FERROCOMM_STATUS_OK) fail("moe agreed announcements recorded", r, e.op, e.peer);
          if (call == 2 && (e.code != FERROCOMM_STATUS_MISMATCH || e.op != m::OP_SHAPE || e.signal_id != m::FIELD_HIDDEN ||
                            e.peer != (last ? 0 : size - 1) || e.expected != (last ? 256u : 128u) ||
                            e.observed != (last ? 128u : 256u))) {
            fail("moe announcement against another shape", r, e.op, e.peer);
          }
          for (u16 x : rt[r]) {
            if (x != 0xffff) fail("moe announcement wrote a row", r, x, call);
          }
          for (i32 c : counts[r]) {
            if (c != -1) fail("moe announcement wrote a count", r, c, call);
          }
        }
        memset(errors.data(), 0, sizeof(ferrocomm_status) * size);
        continue;
      }
      if (cut) {
        // Which (rank, token, k) kept its row: per expert, the first `cap` in (source, token, k)
        // order, as the dispatch lays them out.
        std::vector<std::vector<bool>> kept(size);
        std::vector<u64> seen(experts, 0);
        for (int p = 0; p < size; ++p) {
          for (u64 q = 0; q < idx[p].size(); ++q) kept[p].push_back(idx[p][q] >= 0 && seen[idx[p][q]]++ < cap);
        }
        bool any_lost = false;
        for (int r = 0; r < size; ++r) {
          bool over = false;
          for (u64 e = 0; e < local; ++e) over = over || seen[r * local + e] > cap;
          u64 first = ~0ull;
          for (u64 t = 0; t < tokens_of(r); ++t) {
            bool whole = true;
            for (u64 k = 0; k < topk; ++k) {
              const u64 q = t * topk + k;
              if (idx[r][q] < 0) continue;
              if (!kept[r][q]) {
                whole = false;
                first = std::min(first, t << 32 | k << 16 | u64(idx[r][q]) / local);
              }
            }
            for (u64 j = 0; j < hidden; ++j) {
              if (out[r][t * hidden + j] != (whole ? combined(r, t, j) : u16(0xffff))) fail("moe combine after a cut", r, t, j);
            }
          }
          any_lost = any_lost || first != ~0ull;
          const u32 want = over ? m::OP_CAPACITY : first != ~0ull ? m::OP_MISSING : 0;
          if ((want == 0) != (errors[r].code == FERROCOMM_STATUS_OK) || (want != 0 && errors[r].op != want)) {
            fail("moe record after a cut", r, errors[r].op, want);
          }
          if (counters[r][m::C_MISSING] != (first == ~0ull ? 0 : ~first)) fail("moe first lost row", r, counters[r][m::C_MISSING], first);
          counters[r][m::C_MISSING] = 0;
        }
        if (!any_lost) fail("moe cut: no token lost a row", size, 0, 0);
        memset(errors.data(), 0, sizeof(ferrocomm_status) * size);
        continue;
      }
      for (int r = 0; r < size; ++r) {
        if (errors[r].code != FERROCOMM_STATUS_OK) fail("moe data error", r, errors[r].op, errors[r].peer);
        // Dispatch: per local expert, (source, token, k) in order.
        for (u64 e = 0; e < local; ++e) {
          u64 i = 0;
          for (int p = 0; p < size; ++p) {
            for (u64 q = 0; q < idx[p].size(); ++q) {
              if (idx[p][q] != i32(r * local + e)) continue;
              const u64 slot = e * capacity + i++;
              if (src[r][slot * 3] != p || src[r][slot * 3 + 1] != i32(q / topk) || src[r][slot * 3 + 2] != i32(q % topk)) {
                fail("moe dispatch src", r, e, slot);
              }
              if (memcmp(&rt[r][slot * hidden], &tok[p][q / topk * hidden], hidden * 2) != 0) fail("moe dispatch row", r, e, slot);
            }
          }
          if (counts[r][e] != i32(i)) fail("moe dispatch count", r, e, counts[r][e]);
        }
        // Combine: every row came back as itself.
        for (u64 t = 0; t < tokens_of(r); ++t) {
          for (u64 j = 0; j < hidden; ++j) {
            if (out[r][t * hidden + j] != combined(r, t, j)) fail("moe combine", r, t, j);
          }
        }
      }
    }
    // The last DONE signals may still be in the queues (a signal's producer does not wait).
    for (int r = 0; r < size; ++r) {
      Proxies::Rank& k = proxies.ranks[r];
      while (__atomic_load_n(&k.done, __ATOMIC_ACQUIRE) != __atomic_load_n(&k.head, __ATOMIC_ACQUIRE)) {
        std::this_thread::yield();
      }
      if (hosts && k.head == 0) fail("moe: nothing went through the proxy", r, size, 0);
    }
    printf("ok: moe, %d rank%s%s\n", size, size == 1 ? "" : "s", hosts ? " on two hosts (proxy queue)" : "");
  }
}

void check_moe(int calls) {
  check_moe_on(calls, false);
  check_moe_on(calls, true);
}

void check_rma(Group& g) {
  std::vector<u64> results(g.size * 3);
  // signal / wait_signal: every rank adds 1 to slot [1][me] of every peer, then waits for the
  // sum over sources of its own slot 1 to reach size - 1.
  g.ranks([&](int r) {
    ferrocomm_window_handle h = g.handle(r);
    for (int p = 0; p < g.size; ++p) {
      if (p != r) launch(1, 1, [=] { ferrocomm_signal(h, p, 1, FERROCOMM_SIGNAL_ADD, 1); });
    }
    u64* out = &results[r * 3];
    launch(1, 1, [=, n = g.size] { ferrocomm_wait_signal(h, 1, SOURCE_SUM, FERROCOMM_CMP_GE, n - 1, out); });
    launch(1, 64, [=] { ferrocomm_barrier(h); });
  });
  g.check_status("signal / wait_signal / barrier");
  for (int r = 0; r < g.size; ++r) {
    if (results[r * 3] != 1 || results[r * 3 + 2] != u64(g.size - 1)) fail("wait_signal", r, results[r * 3], results[r * 3 + 2]);
  }
  // fetch_add and compare_swap on word 0 of rank 0, from every rank; signal_from.
  g.ranks([&](int r) {
    ferrocomm_window_handle h = g.handle(r);
    u64* out = &results[r * 3];
    for (int i = 0; i < 5; ++i) launch(1, 1, [=] { ferrocomm_fetch_add(h, 0, 64, 1, out); });
    launch(1, 1, [=] { ferrocomm_compare_swap(h, 0, 72, 0, u64(r) + 1, out + 1); });
    launch(1, 1, [=, n = g.size] { ferrocomm_signal_from(h, (r + 1) % n, 2, FERROCOMM_SIGNAL_ADD, 3); });
  });
  g.check_status("fetch_add / compare_swap");
  ferrocomm_window_handle h0 = g.handle(0);
  Window w0(h0);
  if (*w0.local_ptr<u64>(64) != u64(5 * g.size)) fail("fetch_add", 0, *w0.local_ptr<u64>(64), 5 * g.size);
  int winners = 0;
  for (int r = 0; r < g.size; ++r) winners += results[r * 3 + 1] == 0;
  if (winners != 1 || *w0.local_ptr<u64>(72) == 0) fail("compare_swap", winners, *w0.local_ptr<u64>(72), 0);
  for (int r = 0; r < g.size; ++r) {
    Window w(g.handle(r));
    if (w.read_signal(2, (r + 1) % g.size) != 3) fail("signal_from", r, w.read_signal(2, (r + 1) % g.size), 3);
  }
  // put_blocks: every rank puts 1000 bytes at offset 4096 of its right neighbour.
  std::vector<std::vector<unsigned char>> src(g.size, std::vector<unsigned char>(1008));
  g.ranks([&](int r) {
    for (u64 i = 0; i < src[r].size(); ++i) src[r][i] = static_cast<unsigned char>(r * 7 + i);
    ferrocomm_window_handle h = g.handle(r);
    const int right = (r + 1) % g.size;
    launch(3, 32, [=, &src] { ferrocomm_put_blocks(h, right, 4096, src[r].data(), 1000); });
    launch(1, 1, [=] { ferrocomm_signal(h, right, 3, FERROCOMM_SIGNAL_SET, 1); });
    u64* out = &results[r * 3];
    launch(1, 1, [=, n = g.size] { ferrocomm_wait_signal(h, 3, (r + n - 1) % n, FERROCOMM_CMP_GE, 1, out); });
  });
  g.check_status("put_blocks");
  for (int r = 0; r < g.size; ++r) {
    const int left = (r + g.size - 1) % g.size;
    const unsigned char* got = Window(g.handle(r)).local_ptr<unsigned char>(4096);
    for (u64 i = 0; i < 1000; ++i) {
      if (got[i] != src[left][i]) fail("put_blocks", r, static_cast<long long>(i), got[i]);
    }
  }
}

// The ring of every scope on a window of its own (signal values restart at 1), then the rest.
void check_device_api(const std::function<Group()>& fresh) {
  Group g = fresh();
  std::vector<unsigned long long> wrong(g.size, 0);
  std::vector<std::vector<u64>> tiles(g.size, std::vector<u64>(96));
  const struct {
    const char* name;
    unsigned threads;
  } scopes[] = {{"thread", 1}, {"warp", 32}, {"block", 64}};
  for (auto s : scopes) {
    Group g = fresh();
    g.ranks([&](int r) {
      ferrocomm_window_handle h = g.handle(r);
      unsigned long long* w = &wrong[r];
      u64* tile = tiles[r].data();
      const char* name = s.name;
      launch(1, s.threads, [=] {
        if (name[0] == 't') ring_thread(h, tile, 96, 3, 7, w);
        if (name[0] == 'w') ring_warp(h, tile, 96, 3, 7, w);
        if (name[0] == 'b') ring_block(h, tile, 96, 3, 7, w);
      });
      launch(1, 64, [=] { ferrocomm_barrier(h); });
      const int peer = (r + 1) % g.size;
      launch(1, s.threads, [=] {
        if (name[0] == 't') get_thread(h, peer, tile, 32);
        if (name[0] == 'w') get_warp(h, peer, tile, 32);
        if (name[0] == 'b') get_block(h, peer, tile, 32);
      });
      launch(1, 64, [=] { ferrocomm_barrier(h); });
    });
    g.check_status(s.name);
    for (int r = 0; r < g.size; ++r) {
      if (wrong[r]) fail("ring: words differed", r, static_cast<long long>(wrong[r]), 0);
    }
  }
  g.ranks([&](int r) {
    ferrocomm_window_handle h = g.handle(r);
    unsigned long long* w = &wrong[r];
    launch(1, 64, [=] { barrier_rounds(h, 3, w); });
    launch(2, 32, [=] { fetch_add_storm(h, 3); });
    launch(1, 64, [=] { ferrocomm_barrier(h); });
  });
  g.check_status("barrier_rounds / fetch_add_storm");
  for (int r = 0; r < g.size; ++r) {
    if (wrong[r]) fail("barrier_rounds", r, static_cast<long long>(wrong[r]), 0);
  }
}

// The remaining verbs (warp fence, block flush, warp wait by ANY), the benchmark's ping-pong,
// and the kernels that need multicast, which the host device reports absent as a GPU without
// NVSwitch does.
void check_rest(Group& g) {
  std::vector<u64> out(g.size * 3, 0);
  g.ranks([&](int r) {
    ferrocomm_window_handle h = g.handle(r);
    const int right = (r + 1) % g.size;
    launch(1, 1, [=] { ferrocomm_signal(h, right, 2, FERROCOMM_SIGNAL_SET, 5); });
    u64* o = &out[r * 3];
    launch(1, 64, [=] { wait_any_warp(h, 2, 5, o); });
  });
  g.check_status("wait_any_warp");
  for (int r = 0; r < g.size; ++r) {
    const u64 left = static_cast<u64>((r + g.size - 1) % g.size);
    if (out[r * 3] != 1 || out[r * 3 + 1] != left || out[r * 3 + 2] != 5) fail("wait_any_warp", r, out[r * 3 + 1], out[r * 3 + 2]);
  }
  if (g.size == 2) {
    g.ranks([&](int r) {
      ferrocomm_window_handle h = g.handle(r);
      u64* o = &out[r * 3];
      launch(1, 1, [=] { ferrocomm_bench_pingpong(h, 1 - r, 3, 50, r == 0, 0, o); });
    });
    g.check_status("ping-pong");
    if (out[0] != 1 || out[3] != 1) fail("ping-pong did not finish", static_cast<long long>(out[0]), static_cast<long long>(out[3]), 0);
  }
  // No multicast address on the host device: the kernels say so and touch nothing.
  std::vector<unsigned long long> wrong(1, 0);
  ferrocomm_window_handle h = g.handle(0);
  unsigned long long* w = wrong.data();
  launch(1, 32, [=] { multicast_roundtrip(h, 4, 1, w); });
  if (wrong[0] != (2ull << 32)) fail("multicast_roundtrip should report no multimem", static_cast<long long>(wrong[0]), 0, 0);
  std::vector<u32> x(64, 0);
  u64* counters = g.counters[0].data();
  launch(1, 32, [=, &x] { ferrocomm_allreduce_multimem_f32_sum(h, x.data(), x.data(), 64, counters, 1); });
  if (g.status[0].code != FERROCOMM_STATUS_INVALID || g.status[0].op != FERROCOMM_OP_COLLECTIVE) {
    fail("a multimem all_reduce without multicast should record INVALID", g.status[0].code, g.status[0].op, 0);
  }
  g.status[0] = ferrocomm_status{};
}

// The device API's newer parts as users' kernels use them (tests/gpu/kernels.cu): a fused
// reduce built from reduce_copy.cuh, team.cuh, relaxed signals at every scope, and a handle of
// another ABI version, which every verb refuses without touching the window.
void check_user_api(const std::function<Group()>& fresh) {
  // fused_reduce_f32: out = sum over ranks of a + max over ranks of b; copy = right's a.
  const u64 n = 37;  // whole 16-byte groups and a scalar tail
  Group a = fresh(), b = fresh();
  for (int r = 0; r < a.size; ++r) {
    for (u64 i = 0; i < n; ++i) {
      *Window(a.handle(r)).local_ptr<u32>(i * 4) = value<F32>(r, i, 11);
      *Window(b.handle(r)).local_ptr<u32>(i * 4) = value<F32>(r, i, 12);
    }
  }
  std::vector<std::vector<u32>> out(a.size, std::vector<u32>(n)), copy(a.size, std::vector<u32>(n));
  a.ranks([&](int r) {
    ferrocomm_window_handle ha = a.handle(r), hb = b.handle(r);
    u32 *o = out[r].data(), *c = copy[r].data();
    launch(2, 32, [=] { fused_reduce_f32(ha, hb, n, o, c); });
  });
  a.check_status("fused_reduce_f32");
  for (int r = 0; r < a.size; ++r) {
    for (u64 i = 0; i < n; ++i) {
      const float want = F32::get(reference<F32, REDUCE_SUM>(a.size, i, 11)) + F32::get(reference<F32, REDUCE_MAX>(a.size, i, 12));
      if (out[r][i] != F32::put(want)) fail("fused_reduce_f32", r, static_cast<long long>(i), out[r][i]);
      if (copy[r][i] != value<F32>((r + 1) % a.size, i, 11)) fail("fused_reduce_f32 copy", r, static_cast<long long>(i), copy[r][i]);
    }
  }
  // team_info: no proxy queue, so every rank is local.
  Group g = fresh();
  std::vector<std::vector<i32>> team(g.size, std::vector<i32>(2 * g.size + 7, -9));
  g.ranks([&](int r) {
    ferrocomm_window_handle h = g.handle(r);
    i32* o = team[r].data();
    launch(1, 1, [=] { team_info(h, o); });
  });
  for (int r = 0; r < g.size; ++r) {
    const auto& t = team[r];
    if (t[0] != r || t[1] != g.size || t[2] != g.size || t[3] != r) fail("team_info", r, t[0], t[2]);
    for (int p = -1; p <= g.size; ++p) {
      if (t[5 + p] != (p >= 0 && p < g.size)) fail("team_is_local", r, p, t[5 + p]);
    }
    for (int k = 0; k <= g.size; ++k) {
      if (t[g.size + 6 + k] != (k < g.size ? k : -1)) fail("team_local_peer", r, k, t[g.size + 6 + k]);
    }
  }
  // relaxed_counters_*: 3 relaxed Adds to every peer, then a relaxed Set, seen by device waits.
  const struct {
    unsigned threads;
    void (*kernel)(ferrocomm_window_handle, u32, u32, u64*);
  } scopes[] = {{1, relaxed_counters_thread}, {32, relaxed_counters_warp}, {64, relaxed_counters_block}};
  for (auto s : scopes) {
    Group g = fresh();
    std::vector<u64> seen(2 * g.size, 0);
    g.ranks([&](int r) {
      ferrocomm_window_handle h = g.handle(r);
      u64* o = &seen[2 * r];
      launch(1, s.threads, [=] { s.kernel(h, 1, 3, o); });
    });
    g.check_status("relaxed_counters");
    for (int r = 0; r < g.size; ++r) {
      if (seen[2 * r] != 1 || seen[2 * r + 1] != u64(3 * (g.size - 1))) fail("relaxed_counters", r, s.threads, seen[2 * r + 1]);
    }
  }
  // A handle of another ABI: the signal is refused, recorded, and the slot stays 0.
  Group old = fresh();
  ferrocomm_window_handle h = old.handle(0);
  h.abi_version = FERROCOMM_ABI_VERSION + 1;
  launch(1, 1, [=, last = old.size - 1] { ferrocomm_signal(h, last, 1, FERROCOMM_SIGNAL_SET, 9); });
  if (old.status[0].code != FERROCOMM_STATUS_ABI_MISMATCH || old.status[0].observed != FERROCOMM_ABI_VERSION + 1) {
    fail("a handle of another ABI version should be refused", old.status[0].code, static_cast<long long>(old.status[0].observed), 0);
  }
  if (Window(old.handle(old.size - 1)).read_signal(1, 0) != 0) fail("the refused signal landed", 0, 0, 0);
}

// Verbs given a rank, offset or signal id outside the window (tests/gpu/kernels.cu `one_verb`)
// record INVALID with the verb's op and touch nothing; a good put_signal (`put_signal_block`)
// lands after them.
void check_bad_arguments(const std::function<Group()>& fresh) {
  Group g = fresh();
  const u64 data = g.data_bytes;
  const u32 ids = g.signals_;
  const int n = g.size;
  for (int r = 0; r < n; ++r) {
    for (u64 i = 0; i < data / 8; ++i) *Window(g.handle(r)).local_ptr<u64>(i * 8) = mix(u64(r) << 40 ^ i);
  }
  struct Case {
    u32 verb;
    int peer;  // -100: the right neighbour
    u64 offset, bytes;
    u32 id, op;
  };
  const int right = -100;
  const Case cases[] = {
      {0, right, data - 32, 64, 0, FERROCOMM_OP_OUT_OF_WINDOW}, {0, right, ~7ull, 16, 0, FERROCOMM_OP_OUT_OF_WINDOW},
      {0, n, 0, 8, 0, FERROCOMM_OP_BAD_RANK},                    {0, -1, 0, 8, 0, FERROCOMM_OP_BAD_RANK},
      {1, right, data, 8, 0, FERROCOMM_OP_OUT_OF_WINDOW},        {2, right, 0, 0, ids, FERROCOMM_OP_BAD_SIGNAL},
      {3, right, data - 4, 8, 0, FERROCOMM_OP_OUT_OF_WINDOW},    {3, right, 0, 8, ids, FERROCOMM_OP_BAD_SIGNAL},
      {4, SOURCE_ANY, 0, 0, ids, FERROCOMM_OP_BAD_SIGNAL},       {4, -3, 0, 0, 0, FERROCOMM_OP_BAD_RANK},
      {5, right, data - 4, 8, 0, FERROCOMM_OP_OUT_OF_WINDOW},    {5, right, 4, 8, 0, FERROCOMM_OP_MISALIGNED},
      {6, n, 0, 8, 0, FERROCOMM_OP_BAD_RANK},                    {7, SOURCE_SUM, 0, 0, 0, FERROCOMM_OP_BAD_RANK},
  };
  std::vector<std::vector<u64>> scratch(n, std::vector<u64>(8, ~0ull));
  g.ranks([&](int r) {
    ferrocomm_window_handle h = g.handle(r);
    u64* s = scratch[r].data();
    for (const Case& c : cases) {
      const int peer = c.peer == right ? (r + 1) % n : c.peer;
      launch(1, 64, [=] { one_verb(h, c.verb, peer, c.offset, c.bytes, c.id, s); });
      if (g.status[r].code != FERROCOMM_STATUS_INVALID || g.status[r].op != c.op) {
        fail("a bad argument should be refused", r, c.verb, g.status[r].op);
      }
      g.status[r] = ferrocomm_status{};
      if (s[1] != ~0ull || (c.verb != 7 && s[0] != ~0ull)) fail("a refused verb wrote the scratch", r, c.verb, 0);
    }
  });
  for (int r = 0; r < n; ++r) {
    Window w(g.handle(r));
    for (u64 i = 0; i < data / 8; ++i) {
      if (*w.local_ptr<u64>(i * 8) != mix(u64(r) << 40 ^ i)) fail("a refused verb wrote the data", r, static_cast<long long>(i), 0);
    }
    for (u64 o = g.signal_offset; o < g.barrier_offset; o += 8) {
      if (*w.local_ptr<u64>(o) != 0) fail("a refused verb wrote a signal", r, static_cast<long long>(o), 0);
    }
  }
  // The window still works: words 256..263 of every rank to its right neighbour's 8..15.
  std::vector<u64> seen(n * 3, 0);
  g.ranks([&](int r) {
    ferrocomm_window_handle h = g.handle(r);
    const u64* src = Window(h).local_ptr<u64>(256 * 8);
    u64* o = &seen[r * 3];
    launch(1, 64, [=] { put_signal_block(h, (r + 1) % n, 64, src, 64, 1, 1); });
    launch(1, 1, [=] { ferrocomm_wait_signal(h, 1, (r + n - 1) % n, FERROCOMM_CMP_GE, 1, o); });
  });
  g.check_status("put_signal_block after refusals");
  for (int r = 0; r < n; ++r) {
    const int left = (r + n - 1) % n;
    for (u64 i = 0; i < 8; ++i) {
      if (*Window(g.handle(r)).local_ptr<u64>(64 + i * 8) != mix(u64(left) << 40 ^ (256 + i))) fail("put_signal_block", r, static_cast<long long>(i), 0);
    }
  }
}

// A wait that nobody satisfies ends by its deadline with a status naming the wait.
void check_timeout(Group& g) {
  ferrocomm_window_handle h = g.handle(0);
  h.timeout_ns = 50ull * 1000 * 1000;
  std::vector<u64> out(1, 7);
  u64* o = out.data();
  launch(1, 32, [=] { wait_forever(h, o); });
  if (out[0] != 0 || g.status[0].code != FERROCOMM_STATUS_TIMEOUT || g.status[0].op != FERROCOMM_OP_WAIT_SIGNAL) {
    fail("wait_forever", static_cast<long long>(out[0]), g.status[0].code, g.status[0].op);
  }
  g.status[0] = ferrocomm_status{};
}

// ---- The fused all_reduce + residual + RMSNorm (kernels/fused_norm.cu) ----
//
// Calls are cut into launches as host/backend/device/collectives/norm.rs cuts them (rows per
// launch from `segment_bytes` and the window's first region, MAX_BLOCKS blocks each), on the
// epochs of the shot counters, several calls in a row on one window.
// Checks: every rank's residual is, bit for bit, the f32 sum of the ranks' x in rank order
// plus the residual, rounded; out is within a tolerance of the f64 RMSNorm of that f32 sum
// (relative 1e-5 for f32, 2e-3 for f16, 1.6e-2 for bf16, plus 1e-5 of the row's largest
// value; fp8: out * scale within 1/16 of the value plus 1e-3 of the row's largest, the
// scale within 1e-5 of max |y| / 448); every rank's residual, out and scales the same bits;
// nothing written past the ends.

using NormKernel = void (*)(ferrocomm_window_handle, const fused_norm::NormArgs, u64*);

// norm.rs `segment_bytes`: the segment bytes of a launch of `rows` rows.
u64 norm_segment_bytes(u64 rows, u64 hidden, u64 in_size, u64 out_size, u64 size, bool two_shot) {
  auto pad16 = [](u64 b) { return (b + 15) / 16 * 16; };
  const u64 own = two_shot ? (rows + size - 1) / size : 0;
  const u64 result_row = pad16(hidden * in_size) + pad16(hidden * out_size) + 16;
  return fused_norm::HEADER_BYTES * MAX_BLOCKS + pad16(rows * hidden * in_size) + own * result_row +
         MAX_BLOCKS * pad16(hidden * 4);
}

// norm.rs `rows_per_launch`: the most rows (at most `tokens`) that fit `region`; 0 if none.
u64 norm_rows_per_launch(u64 tokens, u64 region, const std::function<u64(u64)>& bytes) {
  if (bytes(1) > region) return 0;
  u64 lo = 1, hi = tokens > 1 ? tokens : 1;
  while (lo < hi) {
    const u64 mid = lo + (hi - lo + 1) / 2;
    if (bytes(mid) <= region) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// `n` elements of Raw starting 16-byte aligned (or `skew` elements past that), filled with
// `fill`, with GUARD more elements of `fill` after them.
template <class Raw>
struct Rows {
  static constexpr u64 GUARD = 16;
  std::vector<Raw> all;
  Raw* p;
  u64 n;
  Raw fill;
  // `p` points into `all`: moved, never copied.
  Rows(const Rows&) = delete;
  Rows(Rows&&) = default;
  Rows(u64 count, u64 skew, Raw f) : all(count + skew + GUARD + 16 / sizeof(Raw), f), n(count), fill(f) {
    u64 first = 0;
    while ((reinterpret_cast<u64>(all.data() + first) & 15) != 0) ++first;
    p = all.data() + first + skew;
  }
  bool guard_intact() const {
    for (u64 i = n; i < n + GUARD; ++i) {
      if (p[i] != fill) return false;
    }
    return true;
  }
};

// A collective window for the fused norm, with each rank's two words for mismatched calls
// (the count of blocks that found one, whether the call's first launch did).
struct NormWindow {
  Group g;
  u64 region;
  std::vector<u64> words;
  NormWindow(int n, u64 bytes) : g(n, bytes, 5 * MAX_BLOCKS), region(bytes), words(2 * n, 0) {}
  u64* mismatches(int r) { return &words[2 * r]; }
};

struct NormShape {
  bool two_shot;
  u64 hidden, tokens;
  unsigned threads;
  u64 skew;  // elements by which x is off 16-byte alignment (0: vectors where hidden allows)
  bool refused = false;  // the host refused the call: one launch without rows says so
};

// A value in [-1, 1) with 24 random bits: sums of several of them round in f32.
float norm_value(u64 key) { return static_cast<float>(mix(key) >> 40) / 8388608.0f - 1.0f; }

// The tolerance of a rounded norm output relative to its value: E's rounding plus the f32 sums'.
template <class E>
constexpr double norm_rel() {
  return std::is_same_v<E, F32> ? 1e-5 : std::is_same_v<E, F16> ? 2e-3 : 1.6e-2;
}

[[noreturn]] void norm_fail(const char* name, int rank, u64 t, u64 j, double got, double want, double tol) {
  fprintf(stderr, "FAILED: %s: rank %d token %llu element %llu: %.9g, want %.9g +- %.3g\n", name, rank,
          static_cast<unsigned long long>(t), static_cast<unsigned long long>(j), got, want, tol);
  exit(1);
}

// The rows per launch of a call of `tokens` rows of `hidden` as the host plans it.
template <class In, class Out>
u64 norm_per_launch(const NormWindow& w, u64 hidden, u64 tokens, bool two_shot) {
  auto bytes = [&](u64 rows) { return norm_segment_bytes(rows, hidden, sizeof(In), sizeof(Out), w.g.size, two_shot); };
  return norm_rows_per_launch(tokens, w.region, bytes);
}

// One call of kernel `k` (E activations, O out) on every rank of `w`, cut into launches as the
// host cuts it: rank r's call is `shape_of[r]`, its buffers x[r], residual[r], ....
template <class E, class O>
void run_norm(NormWindow& w, NormKernel k, const std::vector<NormShape>& shape_of,
              std::vector<Rows<typename E::Raw>>& x, std::vector<Rows<typename E::Raw>>& residual,
              std::vector<Rows<typename E::Raw>>& gamma, std::vector<Rows<typename O::Raw>>& out,
              std::vector<Rows<float>>& scales, bool fp8) {
  using In = typename E::Raw;
  using Out = typename O::Raw;
  Group& g = w.g;
  g.ranks([&](int r) {
    const NormShape& s = shape_of[r];
    const u64 hidden = s.hidden, tokens = s.tokens;
    const u64 per = norm_per_launch<In, Out>(w, hidden, tokens, s.two_shot);
    if (per == 0) fail("no norm launch fits the region", r, static_cast<long long>(hidden), static_cast<long long>(w.region));
    // What the kernel lays out must fit what the host planned.
    const u64 own = s.two_shot ? (per + g.size - 1) / g.size : 0;
    const fused_norm::Layout l(per, hidden, sizeof(In), sizeof(Out), own);
    if (l.scratch + MAX_BLOCKS * l.scratch_row > w.region) fail("the norm's layout overflows the host's plan", r, per, hidden);
    const u64 group = 16 / sizeof(In);
    const u64 ptrs = reinterpret_cast<u64>(x[r].p) | reinterpret_cast<u64>(residual[r].p) |
                     reinterpret_cast<u64>(gamma[r].p) | reinterpret_cast<u64>(out[r].p);
    const u32 vectors = hidden % group == 0 && (ptrs & 15) == 0;
    const ferrocomm_window_handle h = g.handle(r);
    u64* counters = g.counters[r].data();
    if (s.refused) {
      // As collectives.rs `refuse_norm`: the one-shot f32 kernel, no rows, headers saying so.
      fused_norm::NormArgs a{};
      a.mismatches = reinterpret_cast<u64>(w.mismatches(r));
      a.refused = 1;
      launch(MAX_BLOCKS, s.threads, [=] { ferrocomm_rmsnorm_oneshot_f32(h, a, counters); });
      return;
    }
    for (u64 first = 0, launch_index = 0; first < tokens; first += per, ++launch_index) {
      fused_norm::NormArgs a{};
      a.x = reinterpret_cast<u64>(x[r].p + first * hidden);
      a.residual = reinterpret_cast<u64>(residual[r].p + first * hidden);
      a.gamma = reinterpret_cast<u64>(gamma[r].p);
      a.out = reinterpret_cast<u64>(out[r].p + first * hidden);
      a.scales = fp8 ? reinterpret_cast<u64>(scales[r].p + first) : 0;
      a.rows = per < tokens - first ? per : tokens - first;
      a.hidden = hidden;
      a.eps = 1e-5f;
      a.vectors = vectors;
      a.mismatches = reinterpret_cast<u64>(w.mismatches(r));
      a.call_rows = tokens;
      a.launch = launch_index;
      launch(MAX_BLOCKS, s.threads, [=] { k(h, a, counters); });
    }
  });
}

// `calls` calls of the fused norm of shape `s` (kernel `one` or `two` by s.two_shot), each
// checked against the reference.
template <class E, class O>
void check_norm(NormWindow& w, NormKernel one, NormKernel two, const char* name, const NormShape& s, int calls) {
  using In = typename E::Raw;
  using Out = typename O::Raw;
  constexpr bool fp8 = sizeof(Out) == 1;
  Group& g = w.g;
  const u64 n = s.hidden, tokens = s.tokens, elems = n * tokens;
  for (int call = 0; call < calls; ++call) {
    const u64 seed = mix(n * 7919 + tokens * 104729 + call * 31 + s.two_shot);
    std::vector<Rows<In>> x, residual, gamma;
    std::vector<Rows<Out>> out;
    std::vector<Rows<float>> scales;
    for (auto* v : {&x, &residual, &gamma}) v->reserve(g.size);
    out.reserve(g.size);
    scales.reserve(g.size);
    for (int r = 0; r < g.size; ++r) {
      x.emplace_back(elems, s.skew, In(0x5a5a));
      residual.emplace_back(elems, 0, In(0x5a5a));
      gamma.emplace_back(n, 0, In(0x5a5a));
      out.emplace_back(elems, 0, Out(0x5a));
      scales.emplace_back(tokens, 0, -12345.0f);
      for (u64 i = 0; i < elems; ++i) {
        // Token 1 is all zeros (an fp8 scale of 1); the residual is every rank's.
        const bool zero = i / n == 1;
        x[r].p[i] = E::put(zero ? 0.0f : norm_value(seed ^ (u64(r + 1) << 48) ^ i));
        residual[r].p[i] = E::put(zero ? 0.0f : norm_value(seed ^ (u64(99) << 48) ^ i));
      }
      for (u64 j = 0; j < n; ++j) gamma[r].p[j] = E::put(1.5f * norm_value(seed ^ (u64(77) << 48) ^ j));
    }
    const std::vector<In> residual_in(residual[0].p, residual[0].p + elems);
    run_norm<E, O>(w, s.two_shot ? two : one, std::vector<NormShape>(g.size, s), x, residual, gamma, out, scales, fp8);
    g.check_status(name);
    for (u64 t = 0; t < tokens; ++t) {
      // The f32 sums in rank order, then the residual, as the kernel adds them.
      std::vector<float> sum(n);
      double squares = 0;
      for (u64 j = 0; j < n; ++j) {
        const u64 i = t * n + j;
        float acc = 0.0f;
        for (int r = 0; r < g.size; ++r) acc += E::get(x[r].p[i]);
        acc += E::get(residual_in[i]);
        sum[j] = acc;
        squares += static_cast<double>(acc) * acc;
      }
      const double inv = 1.0 / sqrt(squares / static_cast<double>(n) + 1e-5);
      std::vector<double> y(n);
      double y_max = 0;
      for (u64 j = 0; j < n; ++j) {
        y[j] = sum[j] * inv * E::get(gamma[0].p[j]);
        y_max = fabs(y[j]) > y_max ? fabs(y[j]) : y_max;
      }
      const double scale = fp8 ? static_cast<double>(scales[0].p[t]) : 1.0;
      if (fp8) {
        const double want = y_max > 0 ? y_max / 448.0 : 1.0;
        if (!(fabs(scale - want) <= 1e-5 * want)) norm_fail(name, 0, t, 0, scale, want, 1e-5 * want);
      }
      for (u64 j = 0; j < n; ++j) {
        const u64 i = t * n + j;
        if (residual[0].p[i] != E::put(sum[j])) norm_fail(name, 0, t, j, E::get(residual[0].p[i]), sum[j], 0);
        const double got = O::get(out[0].p[i]) * scale;
        const double tol = fp8 ? fabs(y[j]) / 16.0 + 1e-3 * y_max : norm_rel<E>() * fabs(y[j]) + 1e-5 * y_max;
        if (!(fabs(got - y[j]) <= tol)) norm_fail(name, 0, t, j, got, y[j], tol);
      }
    }
    for (int r = 0; r < g.size; ++r) {
      // The same bits on every rank (the residual's were checked above through rank 0's).
      if (memcmp(residual[r].p, residual[0].p, elems * sizeof(In)) != 0) fail("norm residuals differ between ranks", r, n, tokens);
      if (memcmp(out[r].p, out[0].p, elems * sizeof(Out)) != 0) fail("norm outputs differ between ranks", r, n, tokens);
      if (fp8 && memcmp(scales[r].p, scales[0].p, tokens * sizeof(float)) != 0) fail("norm scales differ between ranks", r, n, tokens);
      if (!fp8 && scales[r].p[0] != -12345.0f) fail("a norm without fp8 wrote scales", r, n, tokens);
      if (!residual[r].guard_intact() || !out[r].guard_intact() || !scales[r].guard_intact()) {
        fail("the norm wrote past an end", r, n, tokens);
      }
      if (w.mismatches(r)[0] != 0 || w.mismatches(r)[1] != 0) fail("a matched norm noted a mismatch", r, w.mismatches(r)[0], w.mismatches(r)[1]);
    }
  }
}

// Every rank's shot epochs in step, and no peer's READY, DONE or REDUCED signal ahead of them
// (a launch that signalled READY and then gave up would leave one, and the next call would
// read that peer's segment before the peer wrote it).
void check_epochs_in_step(Group& g, const char* name) {
  for (u32 b = 0; b < MAX_BLOCKS; ++b) {
    const u64 epoch = g.counters[0][b];
    for (int r = 0; r < g.size; ++r) {
      if (g.counters[r][b] != epoch) {
        fprintf(stderr, "%s\n", name);
        fail("the ranks' epochs differ", r, b, static_cast<long long>(g.counters[r][b]));
      }
      const Window w(g.handle(r));
      for (int p = 0; p < g.size; ++p) {
        for (u32 id : {READY_ID + b, DONE_ID + b, REDUCED_ID + b}) {
          if (p != r && w.read_signal(id, p) > epoch) {
            fprintf(stderr, "%s\n", name);
            fail("a signal is ahead of the epochs", r, p, id);
          }
        }
      }
    }
  }
}

// Calls of f32 rows that differ between even and odd ranks (`shape(r)`): every rank records
// MISMATCH naming a peer of the other parity and both calls' bytes of x, in the first launch
// (the later ones of the longer calls end at once, or the wait would run into the timeout),
// and writes nothing; then the window is used again. Where the shape of the last rank says
// `refused`, every rank records REFUSED naming that rank instead (the last rank too, which
// reports it on a GPU from its next call, as its peers do).
void check_norm_mismatch(NormWindow& w, const char* name, const std::function<NormShape(int)>& shape) {
  Group& g = w.g;
  std::vector<NormShape> shape_of;
  std::vector<Rows<u32>> x, residual, gamma, out;
  std::vector<Rows<float>> scales;
  for (auto* v : {&x, &residual, &gamma, &out}) v->reserve(g.size);
  scales.reserve(g.size);
  for (int r = 0; r < g.size; ++r) {
    const NormShape s = shape(r);
    shape_of.push_back(s);
    x.emplace_back(s.hidden * s.tokens, 0, F32::put(1.0f));
    residual.emplace_back(s.hidden * s.tokens, 0, F32::put(2.0f));
    gamma.emplace_back(s.hidden, 0, F32::put(1.0f));
    out.emplace_back(s.hidden * s.tokens, 0, 0x7f7f7f7fu);
    scales.emplace_back(s.tokens, 0, -1.0f);
  }
  const bool two_shot = shape_of[0].two_shot;
  const u64 t0 = ferrocomm_host::now_ns();
  run_norm<F32, F32>(w, two_shot ? ferrocomm_rmsnorm_twoshot_f32 : ferrocomm_rmsnorm_oneshot_f32, shape_of, x, residual,
                     gamma, out, scales, false);
  // Far below the handle's 20 s timeout, even under a sanitizer on a busy machine.
  const u64 took_ms = (ferrocomm_host::now_ns() - t0) / 1000000;
  if (took_ms > 10000) fail("a mismatched norm waited", static_cast<long long>(took_ms), g.size, 0);
  const int refuser = shape_of.back().refused ? g.size - 1 : -1;
  for (int r = 0; r < g.size && refuser >= 0; ++r) {
    const ferrocomm_status st = g.status[r];
    if (st.code != FERROCOMM_STATUS_REFUSED || st.op != FERROCOMM_OP_COLLECTIVE || st.peer != refuser) {
      fprintf(stderr, "%s\n", name);
      fail("a refused norm should be recorded naming the refusing rank", r, st.code, st.peer);
    }
    g.status[r] = ferrocomm_status{};
    const NormShape& mine = shape_of[r];
    for (u64 i = 0; i < mine.hidden * mine.tokens; ++i) {
      if (out[r].p[i] != 0x7f7f7f7fu || residual[r].p[i] != F32::put(2.0f)) fail("a refused norm wrote", r, i, 0);
    }
    if (w.mismatches(r)[0] != 0) fail("the norm's mismatch count was not reset", r, w.mismatches(r)[0], 0);
    if (w.mismatches(r)[1] != 1) fail("the first launch did not note the refusal", r, w.mismatches(r)[1], 0);
  }
  for (int r = 0; r < g.size && refuser < 0; ++r) {
    const ferrocomm_status st = g.status[r];
    if (st.code != FERROCOMM_STATUS_MISMATCH || st.op != FERROCOMM_OP_COLLECTIVE || st.peer < 0 || st.peer >= g.size ||
        st.peer % 2 == r % 2) {
      fprintf(stderr, "%s\n", name);
      fail("a mismatched norm should record MISMATCH naming a disagreeing peer", r, st.code, st.peer);
    }
    const NormShape &mine = shape_of[r], &theirs = shape_of[st.peer];
    const u64 bytes = mine.hidden * 4 * mine.tokens, peer_bytes = theirs.hidden * 4 * theirs.tokens;
    if (st.expected != bytes || st.observed != (peer_bytes != bytes ? peer_bytes : ~0ull)) {
      fprintf(stderr, "%s\n", name);
      fail("the norm's mismatch should name both calls' bytes", r, st.expected, st.observed);
    }
    g.status[r] = ferrocomm_status{};
    for (u64 i = 0; i < mine.hidden * mine.tokens; ++i) {
      if (out[r].p[i] != 0x7f7f7f7fu || residual[r].p[i] != F32::put(2.0f)) fail("a mismatched norm wrote", r, i, 0);
    }
    if (w.mismatches(r)[0] != 0) fail("the norm's mismatch count was not reset", r, w.mismatches(r)[0], 0);
    if (w.mismatches(r)[1] != 1) fail("the first launch did not note the mismatch", r, w.mismatches(r)[1], 0);
  }
  check_epochs_in_step(g, name);
}

// Every kind of mismatched call, one- or two-shot.
void check_norm_mismatches(NormWindow& w, bool two_shot) {
  auto odd = [](int r) { return r % 2 == 1; };
  // Another row length, the same rows.
  check_norm_mismatch(w, "row length", [&](int r) { return NormShape{two_shot, odd(r) ? 4u : 8u, 5, 32, 0}; });
  // Other rows: one launch each, of 3 and 5 rows.
  check_norm_mismatch(w, "rows", [&](int r) { return NormShape{two_shot, 8, odd(r) ? 5u : 3u, 32, 0}; });
  // The same first launch, and a second one on the even ranks only.
  const u64 per = norm_per_launch<u32, u32>(w, 129, 1000, two_shot);
  check_norm_mismatch(w, "launches", [&](int r) { return NormShape{two_shot, 129, odd(r) ? per : 2 * per, 32, 0}; });
  // The last rank refuses; the others' calls take two launches.
  const int last = w.g.size - 1;
  check_norm_mismatch(w, "refused", [&](int r) { return NormShape{two_shot, 129, 2 * per, 32, 0, r == last}; });
}

// Every family of the fused norm, one- and two-shot, on `n` ranks: odd and vector-sized
// rows, fewer rows than ranks and rows not divisible by the ranks, calls of several launches,
// two calls of each shape in a row, and mismatched calls between them; one all_reduce on the
// same window too (the kernels share its epochs).
void check_fused_norm(int n) {
  // 16 KiB: a row of 129 f32 fits, and larger calls take several launches.
  NormWindow w(n, 16 << 10);
  // {two-shot, hidden, tokens, threads, skew}; 16-bit rows of 64 and f32 rows of 64 take
  // 16-byte accesses, a skew of one element the scalar path.
  check_norm<F32, F32>(w, ferrocomm_rmsnorm_oneshot_f32, ferrocomm_rmsnorm_twoshot_f32, "rmsnorm oneshot f32 1x1", {false, 1, 1, 32, 0}, 2);
  check_norm<F32, F32>(w, ferrocomm_rmsnorm_oneshot_f32, ferrocomm_rmsnorm_twoshot_f32, "rmsnorm twoshot f32 7x3", {true, 7, 3, 32, 0}, 2);
  check_norm<F32, F32>(w, ferrocomm_rmsnorm_oneshot_f32, ferrocomm_rmsnorm_twoshot_f32, "rmsnorm oneshot f32 33x5", {false, 33, 5, 64, 0}, 1);
  // 2 to 5 launches a call (4 rows a launch at 1 rank, 10 at 8).
  check_norm<F32, F32>(w, ferrocomm_rmsnorm_oneshot_f32, ferrocomm_rmsnorm_twoshot_f32, "rmsnorm twoshot f32 129x20", {true, 129, 20, 32, 0}, 2);
  // 14 rows a launch: 14, 14, 2.
  check_norm<F32, F32>(w, ferrocomm_rmsnorm_oneshot_f32, ferrocomm_rmsnorm_twoshot_f32, "rmsnorm oneshot f32 129x30", {false, 129, 30, 32, 0}, 1);
  check_all_reduce<F32, REDUCE_SUM>(w.g, ferrocomm_allreduce_oneshot_f32_sum, "oneshot f32 sum between norms", 600, 3, 32, 1);
  check_norm<Bf16, Bf16>(w, ferrocomm_rmsnorm_oneshot_bf16, ferrocomm_rmsnorm_twoshot_bf16, "rmsnorm oneshot bf16 64x7", {false, 64, 7, 32, 0}, 2);
  // 3 launches at 1 rank, 2 at 2 to 4, 1 at 8.
  check_norm<Bf16, Bf16>(w, ferrocomm_rmsnorm_oneshot_bf16, ferrocomm_rmsnorm_twoshot_bf16, "rmsnorm twoshot bf16 64x70", {true, 64, 70, 32, 0}, 1);
  check_norm<Bf16, Bf16>(w, ferrocomm_rmsnorm_oneshot_bf16, ferrocomm_rmsnorm_twoshot_bf16, "rmsnorm twoshot bf16 64x6 skewed", {true, 64, 6, 32, 1}, 1);
  check_norm<Bf16, Bf16>(w, ferrocomm_rmsnorm_oneshot_bf16, ferrocomm_rmsnorm_twoshot_bf16, "rmsnorm twoshot bf16 1x5", {true, 1, 5, 32, 0}, 1);
  if (n > 1) check_norm_mismatches(w, false);
  // 28 rows a launch: 28, 4.
  check_norm<F16, F16>(w, ferrocomm_rmsnorm_oneshot_f16, ferrocomm_rmsnorm_twoshot_f16, "rmsnorm oneshot f16 129x32", {false, 129, 32, 32, 0}, 1);
  check_norm<F16, F16>(w, ferrocomm_rmsnorm_oneshot_f16, ferrocomm_rmsnorm_twoshot_f16, "rmsnorm twoshot f16 8x9", {true, 8, 9, 32, 0}, 1);
  if (n > 1) check_norm_mismatches(w, true);
  check_norm<F32, E4M3>(w, ferrocomm_rmsnorm_oneshot_f32_fp8, ferrocomm_rmsnorm_twoshot_f32_fp8, "rmsnorm twoshot f32_fp8 33x11", {true, 33, 11, 32, 0}, 1);
  check_norm<F32, E4M3>(w, ferrocomm_rmsnorm_oneshot_f32_fp8, ferrocomm_rmsnorm_twoshot_f32_fp8, "rmsnorm oneshot f32_fp8 64x12", {false, 64, 12, 32, 0}, 1);
  check_norm<Bf16, E4M3>(w, ferrocomm_rmsnorm_oneshot_bf16_fp8, ferrocomm_rmsnorm_twoshot_bf16_fp8, "rmsnorm oneshot bf16_fp8 7x2", {false, 7, 2, 32, 0}, 2);
  check_norm<F16, E4M3>(w, ferrocomm_rmsnorm_oneshot_f16_fp8, ferrocomm_rmsnorm_twoshot_f16_fp8, "rmsnorm twoshot f16_fp8 64x17", {true, 64, 17, 32, 0}, 1);
  printf("ok: fused norm, %d rank%s\n", n, n == 1 ? "" : "s");
}

}  // namespace

// The fused norm's steps apart (kernels/norm_pass.cu) for `world` ranks' x: each x widened by
// ferrocomm_widen_* (exact), summed here in rank order as an all_reduce would, then
// ferrocomm_residual_rmsnorm_* over `blocks` x `threads`: the residual must be the rounded
// f32 sum exactly, the sum row the f32 sum, out the norm within the types' rounding (fp8: with
// the row's scale, which must be max |y| / 448).
template <class E, class O>
void check_norm_pass(const char* name, void (*widen)(u64, u64, u64), void (*norm)(norm_pass::PassArgs), int world,
                     u64 rows, u64 hidden, unsigned blocks, unsigned threads) {
  using Raw = typename E::Raw;
  using Out = typename O::Raw;
  const u64 n = rows * hidden, seed = mix(rows * 977 + hidden);
  std::vector<float> sum(n, 0.0f), widened(n + 4, -1.0f);
  for (int r = 0; r < world; ++r) {
    std::vector<Raw> x(n);
    for (u64 i = 0; i < n; ++i) x[i] = value<E>(r, i, seed);
    launch(blocks, threads, [&] { widen(reinterpret_cast<u64>(x.data()), reinterpret_cast<u64>(widened.data()), n); });
    for (u64 i = 0; i < n; ++i) {
      if (widened[i] != E::get(x[i])) fail(name, r, static_cast<long long>(i), -1);
      sum[i] += widened[i];
    }
    if (widened[n] != -1.0f) fail("widen wrote past its end", r, static_cast<long long>(n), -1);
  }
  std::vector<Raw> residual(n), gamma(hidden), before(n);
  for (u64 i = 0; i < n; ++i) before[i] = residual[i] = value<E>(world, i, seed);
  for (u64 j = 0; j < hidden; ++j) gamma[j] = value<E>(world + 1, j, seed);
  std::vector<Out> out(n + 16, Out(0x77));
  std::vector<float> scales(rows + 1, -5.0f);
  std::vector<float> s = sum;
  const bool fp8 = sizeof(Out) == 1;
  norm_pass::PassArgs a{};
  a.sum = reinterpret_cast<u64>(s.data());
  a.residual = reinterpret_cast<u64>(residual.data());
  a.gamma = reinterpret_cast<u64>(gamma.data());
  a.out = reinterpret_cast<u64>(out.data());
  a.scales = fp8 ? reinterpret_cast<u64>(scales.data()) : 0;
  a.rows = rows;
  a.hidden = hidden;
  a.eps = 1e-5f;
  a.vectors = hidden % (16 / sizeof(Raw)) == 0 &&
              ((a.sum | a.residual | a.gamma | a.out) & 15) == 0;
  launch(blocks, threads, [&] { norm(a); });
  for (u64 t = 0; t < rows; ++t) {
    double square = 0, ymax = 0;
    std::vector<double> y(hidden);
    for (u64 j = 0; j < hidden; ++j) {
      const u64 i = t * hidden + j;
      const float acc = sum[i] + E::get(before[i]);
      if (residual[i] != E::put(acc) || s[i] != acc) fail(name, static_cast<long long>(t), static_cast<long long>(j), 1);
      square += static_cast<double>(acc) * acc;
    }
    const double inv = 1.0 / std::sqrt(square / static_cast<double>(hidden) + 1e-5);
    for (u64 j = 0; j < hidden; ++j) {
      y[j] = s[t * hidden + j] * inv * E::get(gamma[j]);
      ymax = std::max(ymax, std::fabs(y[j]));
    }
    const double scale = fp8 ? scales[t] : 1.0;
    if (fp8 && std::fabs(scale - (ymax > 0 ? ymax / 448.0 : 1.0)) > 1e-5 * scale) fail(name, static_cast<long long>(t), -1, 2);
    const double rel = fp8 ? 1.0 / 16 : sizeof(Raw) == 4 ? 1e-5 : sizeof(Raw) == 2 && E::get(E::put(1.0f + 1.0f / 512)) != 1.0f ? 1e-3 : 1e-2;
    for (u64 j = 0; j < hidden; ++j) {
      const double got = static_cast<double>(O::get(out[t * hidden + j])) * scale;
      if (!(std::fabs(got - y[j]) <= rel * std::fabs(y[j]) + 1e-4 * ymax)) fail(name, static_cast<long long>(t), static_cast<long long>(j), 3);
    }
  }
  if (out[n] != Out(0x77)) fail("the norm pass wrote past its end", static_cast<long long>(n), -1, 4);
  if (fp8 && scales[rows] != -5.0f) fail("the norm pass wrote a scale past its end", static_cast<long long>(rows), -1, 4);
}

// Odd and vectorised rows, fewer and more rows than blocks, every family.
void check_norm_passes() {
  for (auto [rows, hidden] : {std::pair<u64, u64>{1, 7}, {5, 33}, {9, 64}, {3, 129}}) {
    check_norm_pass<F32, F32>("norm pass f32", ferrocomm_widen_f32, ferrocomm_residual_rmsnorm_f32, 2, rows, hidden, 3, 64);
    check_norm_pass<F16, F16>("norm pass f16", ferrocomm_widen_f16, ferrocomm_residual_rmsnorm_f16, 3, rows, hidden, 2, 32);
    check_norm_pass<Bf16, Bf16>("norm pass bf16", ferrocomm_widen_bf16, ferrocomm_residual_rmsnorm_bf16, 4, rows, hidden, 4, 64);
    check_norm_pass<Bf16, E4M3>("norm pass bf16 fp8", ferrocomm_widen_bf16, ferrocomm_residual_rmsnorm_bf16_fp8, 2, rows, hidden, 2, 64);
    check_norm_pass<F32, E4M3>("norm pass f32 fp8", ferrocomm_widen_f32, ferrocomm_residual_rmsnorm_f32_fp8, 3, rows, hidden, 3, 32);
  }
  printf("ok: norm pass\n");
  fflush(stdout);
}

int main(int argc, char** argv) {
  const int max_ranks = argc > 1 ? atoi(argv[1]) : 4;
  // A second argument `moe` runs the MoE checks alone (the slow sanitizer runs of one kernel).
  if (argc > 2 && strcmp(argv[2], "moe") == 0) {
    check_moe(6);
    return 0;
  }
  for (int n = 1; n <= max_ranks; n = n < 4 ? n + 1 : n * 2) {
    // The collective window's first region (one/two-shot) and second (all_to_all slots).
    const u64 region = 4096;
    // A fresh window per part: each uses signal ids its own way.
    const u64 slot_payload = 2048;
    auto fresh = [&] { return Group(n, region + n * (HEADER_BYTES + slot_payload), 5 * MAX_BLOCKS); };
    {
      Group g = fresh();
      check_rma(g);
    }
    check_device_api(fresh);
    check_user_api(fresh);
    check_bad_arguments(fresh);
    {
      Group g = fresh();
      check_rest(g);
    }
    if (n == 1) {
      Group g = fresh();
      check_timeout(g);
    }
    Group g = fresh();
    // Odd counts leave scalar tails; several blocks cut the message into shares.
    for (u64 count : {u64(1), u64(37), u64(600)}) {
      const unsigned blocks = count > 100 ? 3 : 1;
      check_all_reduce<F32, REDUCE_SUM>(g, ferrocomm_allreduce_oneshot_f32_sum, "oneshot f32 sum", count, blocks, 32, 2);
      check_all_reduce<F16, REDUCE_MAX>(g, ferrocomm_allreduce_oneshot_f16_max, "oneshot f16 max", count, blocks, 64, 1);
      check_all_reduce<Bf16, REDUCE_AVG>(g, ferrocomm_allreduce_oneshot_bf16_avg, "oneshot bf16 avg", count, blocks, 32, 1);
      check_all_reduce<F32, REDUCE_MIN>(g, ferrocomm_allreduce_twoshot_f32_min, "twoshot f32 min", count, blocks, 32, 2);
      check_all_reduce<Bf16, REDUCE_SUM>(g, ferrocomm_allreduce_twoshot_bf16_sum, "twoshot bf16 sum", count, blocks, 64, 1);
      check_all_reduce<F16, REDUCE_AVG>(g, ferrocomm_allreduce_twoshot_f16_avg, "twoshot f16 avg", count, blocks, 32, 1);
      // Negative values as u16 wrap: the sums wrap too.
      check_all_reduce<I16, REDUCE_AVG>(g, ferrocomm_allreduce_oneshot_i16_avg, "oneshot i16 avg", count, blocks, 32, 1);
      check_all_reduce<U16, REDUCE_SUM>(g, ferrocomm_allreduce_twoshot_u16_sum, "twoshot u16 sum", count, blocks, 64, 1);
    }
    check_all_gather(g, 333, 2, 32);
    check_reduce_scatter(g, 150, 2, 32);
    check_reduce_scatter(g, 64, 2, 32);
    check_all_to_all(g, region, slot_payload, 5000, 2);
    check_fused_norm(n);
    printf("ok: %d rank%s\n", n, n == 1 ? "" : "s");
    fflush(stdout);
  }
  check_moe(6);
  check_norm_passes();
  return 0;
}
