// Mixture-of-experts dispatch and combine on a window, DeepEP low-latency style: no host
// synchronisation, so a CUDA graph can capture them. Peers whose segments are mapped here (one
// host: NVLink / PCIe) are written by stores; peers on other hosts through the window's proxy
// queue (puts and signals a host thread carries over TCP or RDMA). The host side is
// host/backend/device/moe.rs; the semantics (and the reference) are the CPU engine's,
// host/backend/cpu/inference.rs.
//
// The MoE window's segment holds two staging regions, one for dispatch and one for combine,
// each one slot per source rank: slot p of rank r's segment is written only by rank p. A slot
// is a header (rows sent, the sender's epoch, per-local-expert row counts) and up to `rows`
// records (rows = local experts * capacity). Where some rank is on another host, the segment
// also holds one outbox per destination (after both regions, `slot` bytes apart, shared by
// dispatch and combine), where a send builds the slot of a destination behind the proxy: the
// proxy reads a put's source from the sender's own window.
//
// - dispatch send (one block per destination r): the tokens that have an expert on r, in token
//   order, as records (token, its K expert ids, the row, its fp8 scales), then the header,
//   built in slot `me` of r's region when r is mapped, else in r's outbox and then carried
//   there by one put (header and the records written; the put returns once the proxy copied
//   it); then READY (release) to r, which through the queue lands after the put's bytes.
// - dispatch receive (MOE_BLOCKS blocks, block b packs the local experts e = b mod MOE_BLOCKS):
//   waits for every source's READY (acquire), then packs per expert the (record, k) pairs whose
//   id is that expert, in (source, token, k) order, with block-wide prefix sums (no atomics, so
//   the order is the same on every run); counts[e] are the pairs routed, rows past the capacity
//   are not written and the overflow is recorded; then DONE_b to every source.
// - combine send (one block per destination r): the rows i < min(counts[e], capacity) of each
//   local expert e whose source rank is r, as records (token, k, row), in (e, i) order, with the
//   rows per expert in the header, in place or through r's outbox as for dispatch; READY to r.
// - combine receive (MOE_BLOCKS blocks over the tokens): waits for every source's READY, finds
//   the record of each (token, k) in the owner's slot (by bisection within the expert's run of
//   records, which a dispatch's src leaves sorted by (token, k); else by a scan), and sums
//   w[t, k] * row in f32 in k order (fmaf), rounded once; then DONE_b to every source.
//
// Every slot's header also carries the sender's shape (experts, topk, hidden, capacity, element
// type) and whether it refuses the call: a send that finds a bad expert id (dispatch) or a bad
// count or source (combine) in its data, or that the host refused (`Args::refuse`, an argument
// error found on the host), still publishes a header to every destination, flagged with why,
// and no records. Receive blocks check every source's header after acquiring its READY: a
// refusal (the first source in rank order) or a shape that differs from their own is recorded,
// nothing is written to the outputs, and the protocol completes (DONE to every source), so every
// rank fails the same call with the same error and the next call runs in step. The header is
// written before the release of READY and read after its acquire (rule 1 / rule 2 of
// docs/memory-model.md), like the records. Before the host replaces the window by a larger
// one, which the peers must make too, it runs such header-only halves on the old window with
// `Args::refuse` = OP_GROW and the new shape: ranks that all announce the same shape agree
// (nothing recorded) and then make the window; a rank whose call has another shape finds the
// announcement's differs, and the announcer finds theirs, so all fail with OP_SHAPE at once.
//
// A sender first waits until every receive block of the destination has signalled DONE for
// its previous epoch, so no slot is overwritten while it is read (DONE and READY toward a rank
// on another host are signals through the queue like any other: release, in order with the
// origin's earlier puts). Epochs are per-rank counters
// in device memory that the kernels advance themselves (per destination block for sends, per
// receive block for receives): they only grow, and a graph replay takes the next one. Failures
// (capacity exceeded, a bad expert id or source, a missing row, a timeout) are recorded in the
// handle's status (first wins) and the kernels still finish the protocol, so the window stays
// usable for the next call.

#include "ferrocomm/ferrocomm.cuh"

namespace ferrocomm {
namespace moe {

using Byte = unsigned char;
using i64 = long long;

// host/backend/device/moe.rs mirrors these.
constexpr u32 MOE_BLOCKS = 8;
constexpr u32 MOE_MAX_RANKS = 16;
constexpr u32 MOE_MAX_TOPK = 32;
constexpr u32 MOE_THREADS = 256;
constexpr u32 D_READY = 0, D_DONE = 1, C_READY = 1 + MOE_BLOCKS, C_DONE = 2 + MOE_BLOCKS;
// Counters (u64): [dispatch sent: MAX_RANKS][dispatch received: BLOCKS][combine sent][combine received]
// [the first lost row of a combine, as ~(token << 32 | k << 16 | owner): 0 for none; the host
// reads and clears it with the error record, so the report does not depend on which block won].
constexpr u32 C_DSENT = 0, C_DRECV = MOE_MAX_RANKS, C_CSENT = MOE_MAX_RANKS + MOE_BLOCKS,
              C_CRECV = 2 * MOE_MAX_RANKS + MOE_BLOCKS, C_MISSING = 2 * MOE_MAX_RANKS + 2 * MOE_BLOCKS;
// The `op` of a status record with FERROCOMM_STATUS_INVALID (or MISMATCH for OP_STEP).
constexpr u32 OP_CAPACITY = 0x4d01;  // peer = local expert, expected = capacity, observed = count
constexpr u32 OP_EXPERT = 0x4d02;    // expected = index in topk_idx, observed = the id (as i64 bits)
constexpr u32 OP_SRC = 0x4d03;       // peer = local expert, expected = row, observed = rank << 32 | k
constexpr u32 OP_MISSING = 0x4d04;   // peer = owner rank, expected = token, observed = k (some block's;
                                      // the host names the first, from C_MISSING)
constexpr u32 OP_STEP = 0x4d05;      // peer = source, expected = this epoch, observed = the slot's
constexpr u32 OP_STRAY = 0x4d06;     // peer = source, expected = token, observed = k
constexpr u32 OP_OUTBOX = 0x4d07;    // peer = destination behind the proxy queue, and no outbox
// A source refused the call (recorded by receivers; the sender's header said why):
constexpr u32 OP_REFUSED_EXPERT = 0x4d08;  // peer = source, extra = its experts, expected = index, observed = id
constexpr u32 OP_REFUSED_SRC = 0x4d09;     // peer = source, extra = local expert, expected = row (~0: counts), observed
constexpr u32 OP_REFUSED_HOST = 0x4d0a;    // peer = source: an argument error found on its host
constexpr u32 OP_SHAPE = 0x4d0b;           // MISMATCH: peer = source, extra = field, expected = ours, observed = its
// A header-only call announcing a shape whose staging needs a larger window (`Args::refuse`):
// ranks that all announce the same shape then make one together; any other rank's call, and
// an announcement to it, differ in shape (OP_SHAPE; FIELD_WINDOW where only that differs).
constexpr u32 OP_GROW = 0x4d0c;
// The shape fields of OP_SHAPE's `extra`.
constexpr u32 FIELD_EXPERTS = 0, FIELD_TOPK = 1, FIELD_HIDDEN = 2, FIELD_CAPACITY = 3, FIELD_DTYPE = 4,
              FIELD_WINDOW = 5;

// What the host passes (one layout for the four kernels; unused fields are 0).
struct Args {
  u64 tokens;       // dispatch send: [T, hidden]; dispatch receive: [local, capacity, hidden]; combine send: expert_out
  u64 scales;       // fp8 scales (dispatch), or 0
  u64 idx;          // topk_idx [T, topk] (dispatch send, combine receive)
  u64 weights;      // combine receive: f32 [T, topk]
  u64 out;          // combine receive: [T, hidden]
  u64 counts;       // dispatch receive: out; combine send: in (i32 [local])
  u64 src;          // dispatch receive: out; combine send: in (i32 [local, capacity, 3])
  u64 n_tokens;     // T of this rank (dispatch send, combine receive)
  u64 hidden, topk, experts, local, capacity;
  u64 row_bytes;    // bytes of one row
  u64 scale_bytes;  // bytes of one row's scales (fp8), else 0
  u64 idx64;        // topk_idx is i64
  u64 dtype;        // combine: 0 f32, 1 f16, 2 bf16
  u64 region;       // this op's staging region in every segment
  u64 slot;         // bytes per source slot
  u64 header;       // bytes of a slot's header
  u64 record;       // bytes per record
  u64 rows;         // records per slot
  u64 errors;       // a ferrocomm_status of this op's data errors (not the handle's: a wait
                    // gives up at once while the handle's status holds an error)
  u64 outbox;       // sends: this rank's outboxes in its own segment, one per destination, `slot`
                    // bytes apart, where slots for ranks behind the proxy queue are built; 0: none
  u64 elem;         // the element type's code (host DType), which ranks must agree on
  u64 refuse;       // 0, or the host refused the call (OP_REFUSED_HOST) or announces a larger
                    // shape (OP_GROW): sends publish only a header saying so, and receives
                    // read nothing and get no output buffers
};

struct Header {
  u64 rows;                                // records sent (dispatch: tokens, may exceed the slot's `rows`)
  u64 epoch;                               // the sender's epoch of this slot
  u32 experts, topk, hidden, capacity, elem;  // the sender's shape and element type
  u32 refused;                             // 0, or why the sender refuses: OP_EXPERT, OP_SRC, OP_REFUSED_HOST,
                                           // or OP_GROW (an announcement, not a refusal)
  u32 extra;                               // the refusal's record fields (see OP_EXPERT, OP_SRC)
  u32 spare;
  u64 expected, observed;
  // then u32 per_expert[local]
};
static_assert(sizeof(Header) == 64, "host/backend/device/moe.rs and the driver size the header from 64 bytes");

FERROCOMM_DEVICE_INLINE u32* per_expert(Byte* slot) { return reinterpret_cast<u32*>(slot + sizeof(Header)); }
FERROCOMM_DEVICE_INLINE const u32* per_expert(const Byte* slot) {
  return reinterpret_cast<const u32*>(slot + sizeof(Header));
}

FERROCOMM_DEVICE_INLINE i64 expert_id(const Args& a, u64 i) {
  return a.idx64 ? reinterpret_cast<const long long*>(a.idx)[i] : reinterpret_cast<const i32*>(a.idx)[i];
}

FERROCOMM_DEVICE_INLINE void invalid(const Args& a, u32 op, i32 peer, u64 expected, u64 observed, u32 extra = 0) {
  record_status(a.errors, FERROCOMM_STATUS_INVALID, op, peer, extra, expected, observed);
}

FERROCOMM_DEVICE_INLINE bool bad_expert(const Args& a, i64 x) { return x < -1 || x >= static_cast<i64>(a.experts); }

// Why a send refuses its call: the first bad value of its data, in the CPU engine's order.
struct Refusal {
  u32 op;  // 0: none
  u32 extra;
  u64 expected, observed;
};

// Fills the fixed part of a slot's header (one thread): the sender's shape, and its refusal.
FERROCOMM_DEVICE_INLINE void write_header(Byte* slot, const Args& a, u64 rows, u64 epoch, const Refusal& why) {
  Header* hd = reinterpret_cast<Header*>(slot);
  hd->rows = rows;
  hd->epoch = epoch;
  hd->experts = static_cast<u32>(a.experts);
  hd->topk = static_cast<u32>(a.topk);
  hd->hidden = static_cast<u32>(a.hidden);
  hd->capacity = static_cast<u32>(a.capacity);
  hd->elem = static_cast<u32>(a.elem);
  hd->refused = why.op;
  hd->extra = why.extra;
  hd->spare = 0;
  hd->expected = why.expected;
  hd->observed = why.observed;
}

// Bytes [0, len) from src to dst by the threads of the block, as wide as alignment allows.
FERROCOMM_DEVICE_INLINE void copy_block(Byte* dst, const Byte* src, u64 len) {
  const u64 both = reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src) | len;
  if ((both & 15) == 0) {
    for (u64 i = threadIdx.x; i < len / 16; i += blockDim.x) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else if ((both & 3) == 0) {
    for (u64 i = threadIdx.x; i < len / 4; i += blockDim.x) {
      reinterpret_cast<u32*>(dst)[i] = reinterpret_cast<const u32*>(src)[i];
    }
  } else {
    for (u64 i = threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
  }
}

struct Scan {
  u32 v[MOE_THREADS];
  u32 total;
  u64 picked[MOE_THREADS];
  Refusal why;  // the send block's refusal, written by the thread that found it
};

// block_scan's values carry two counts: the low half, rows picked; the high half, bad values.
constexpr u32 BAD = 1u << 16;

// Exclusive prefix sum of `v` over the block (thread order); `total` gets the block's sum.
// Every thread calls. The block's `picked` list stays readable until the next call.
FERROCOMM_DEVICE_INLINE u32 block_scan(Scan& s, u32 v, u32& total) {
  __syncthreads();  // earlier readers of s are done
  s.v[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 acc = 0;
    for (u32 i = 0; i < blockDim.x; ++i) {
      const u32 x = s.v[i];
      s.v[i] = acc;
      acc += x;
    }
    s.total = acc;
  }
  __syncthreads();
  total = s.total;
  return s.v[threadIdx.x];
}

// Waits until every receive block of `peer` has read our previous slot (epoch - 1).
FERROCOMM_DEVICE_INLINE bool wait_consumed(const Window& w, u32 done_id, i32 peer, u64 epoch) {
  if (epoch <= 1) return true;
  for (u32 b = 0; b < MOE_BLOCKS; ++b) {
    if (!w.wait_signal(coop_block(), done_id + b, peer, Cmp::Ge, epoch - 1).ok) return false;
  }
  return true;
}

enum class Filled { Yes, Stop, Skip };

// The first difference between a source's shape and ours, recorded (thread 0) if `record`;
// false if none.
FERROCOMM_DEVICE_INLINE bool shape_differs(const Args& a, const Header* h, i32 p, bool record) {
  u32 field = FIELD_EXPERTS;
  u64 ours = a.experts, theirs = h->experts;
  auto next = [&](u32 f, u64 o, u64 t) {
    if (ours == theirs) field = f, ours = o, theirs = t;
  };
  next(FIELD_TOPK, a.topk, h->topk);
  next(FIELD_HIDDEN, a.hidden, h->hidden);
  next(FIELD_CAPACITY, a.capacity, h->capacity);
  next(FIELD_DTYPE, a.elem, h->elem);
  if (ours == theirs) return false;
  if (record && threadIdx.x == 0) record_status(a.errors, FERROCOMM_STATUS_MISMATCH, OP_SHAPE, p, field, ours, theirs);
  return true;
}

// What a source's header means for a receive: read its records; or not, because it agrees
// with our announcement of a larger window (Agreed), or for a reason that fails the call
// (Refused: a refusal, another shape, or one side only announcing).
enum class Verdict { Read, Agreed, Refused };

// Source p's verdict, with the reason recorded (thread 0) unless `quiet` (an earlier source's
// was) or p is this rank refusing (its send recorded why, or its host has the error).
FERROCOMM_DEVICE_INLINE Verdict judge(const Args& a, const Header* h, i32 p, i32 me, bool quiet) {
  const bool we_grow = a.refuse == OP_GROW, they_grow = h->refused == OP_GROW;
  // A refusal first, even against an announcement: the refusing rank's error is the cause.
  if (h->refused != 0 && !they_grow) {
    if (!quiet && threadIdx.x == 0 && p != me) {
      const u32 op = h->refused == OP_EXPERT ? OP_REFUSED_EXPERT : h->refused == OP_SRC ? OP_REFUSED_SRC : OP_REFUSED_HOST;
      invalid(a, op, p, h->expected, h->observed, h->extra);
    }
    return Verdict::Refused;
  }
  if (we_grow || they_grow) {
    if (shape_differs(a, h, p, !quiet)) return Verdict::Refused;
    if (we_grow == they_grow) return Verdict::Agreed;
    if (!quiet && threadIdx.x == 0) {
      record_status(a.errors, FERROCOMM_STATUS_MISMATCH, OP_SHAPE, p, FIELD_WINDOW, we_grow, they_grow);
    }
    return Verdict::Refused;
  }
  return shape_differs(a, h, p, !quiet) ? Verdict::Refused : Verdict::Read;
}

// Waits for every source's slot of this epoch. Stop: a slot of another epoch (recorded), or the
// wait failed; the block gives up. Skip: every slot is there, but nothing may be read (see
// `judge`; the first failing source in rank order recorded), and the protocol still completes.
FERROCOMM_DEVICE_INLINE Filled wait_filled(const Window& w, const Args& a, u32 ready_id, u64 epoch) {
  bool skip = false, quiet = false;
  for (i32 p = 0; p < w.size(); ++p) {
    if (!w.wait_signal(coop_block(), ready_id, p, Cmp::Ge, epoch).ok) return Filled::Stop;
    // After the acquire (the block synchronised after its leader's), the header is the one
    // released with READY.
    const Header* h = w.local_ptr<const Header>(a.region + static_cast<u64>(p) * a.slot);
    if (h->epoch != epoch) {
      if (threadIdx.x == 0) {
        record_status(a.errors, FERROCOMM_STATUS_MISMATCH, OP_STEP, p, ready_id, epoch, h->epoch);
      }
      return Filled::Stop;
    }
    const Verdict v = judge(a, h, p, w.rank(), quiet);
    skip = skip || v != Verdict::Read;
    quiet = quiet || v == Verdict::Refused;
  }
  return skip ? Filled::Skip : Filled::Yes;
}

FERROCOMM_DEVICE_INLINE void signal_consumed(const Window& w, u32 done_id, u64 epoch) {
  for (i32 p = 0; p < w.size(); ++p) w.signal(coop_block(), p, done_id + blockIdx.x, SignalOp::Set, epoch);
}

// Where the send block for `r` builds its slot: in place (slot `me` of r's region) when r's
// segment is mapped here, else r's outbox in this rank's own segment, which `publish` puts.
FERROCOMM_DEVICE_INLINE Byte* slot_for(const Window& w, const Args& a, i32 r, bool direct) {
  if (direct) return w.peer_ptr<Byte>(r, a.region + static_cast<u64>(w.rank()) * a.slot);
  return w.local_ptr<Byte>(a.outbox + static_cast<u64>(r) * a.slot);
}

// Publishes the first `bytes` of the slot built for `r` with READY = epoch. Mapped: the
// records are in place and the block's release signal publishes them (rule 1). Behind the
// proxy: one put (block scope: the block syncs, its leader queues it) carries the outbox into
// slot `me` of r's region, and the signal after it in the same queue reaches r after the data
// (rule 1; docs/memory-model.md, "The proxy queue"), as one put_signal: a put that was not
// queued sends no READY. The put returns once the proxy has copied the outbox, so the next
// call may build there again.
FERROCOMM_DEVICE_INLINE void publish(const Window& w, const Args& a, i32 r, bool direct, const Byte* slot, u64 bytes,
                                     u32 ready_id, u64 epoch) {
  if (direct) return w.signal(coop_block(), r, ready_id, SignalOp::Set, epoch);
  w.put_signal(coop_block(), r, a.region + static_cast<u64>(w.rank()) * a.slot, slot, bytes, ready_id, SignalOp::Set,
               epoch);
}

// False (recorded) when `r` is behind the proxy queue and the host gave no outboxes.
FERROCOMM_DEVICE_INLINE bool reachable(const Args& a, i32 r, bool direct) {
  if (direct || a.outbox != 0) return true;
  if (threadIdx.x == 0) invalid(a, OP_OUTBOX, r, 0, 0);
  return false;
}

FERROCOMM_DEVICE_INLINE void dispatch_send(const ferrocomm_window_handle& h, const Args& a, u64* counters) {
  const Window w(h);
  if (!w.abi_ok()) return;
  const i32 r = static_cast<i32>(blockIdx.x);
  if (r >= w.size()) return;
  FERROCOMM_SHARED(Scan, scan);
  const bool direct = team_is_local(w, r);
  if (!reachable(a, r, direct)) return;
  u64* sent = counters + C_DSENT + r;
  const u64 epoch = load_relaxed(sent) + 1;
  if (!wait_consumed(w, D_DONE, r, epoch)) return;
  Byte* slot = slot_for(w, a, r, direct);
  Byte* recs = slot + a.header;
  const i64 first = static_cast<i64>(r) * a.local, last = first + static_cast<i64>(a.local);
  const u64 ids_bytes = (4 + 4 * a.topk + 15) / 16 * 16;
  const u64 data_bytes = (a.row_bytes + 15) / 16 * 16;
  u64 n = 0;  // tokens for r so far (the same on every thread)
  // Refused: by the host, or at the first bad expert id (every block sees the same one).
  bool refused = a.refuse != 0;
  if (threadIdx.x == 0) scan.why = Refusal{static_cast<u32>(a.refuse), 0, 0, 0};
  for (u64 base = 0; base < a.n_tokens && !refused; base += blockDim.x) {
    const u64 t = base + threadIdx.x;
    u32 go = 0;
    u64 bad = ~0ull;  // this thread's first bad index
    if (t < a.n_tokens) {
      for (u64 k = 0; k < a.topk; ++k) {
        const i64 x = expert_id(a, t * a.topk + k);
        if (bad_expert(a, x)) {
          if (bad == ~0ull) bad = t * a.topk + k;
        } else if (x >= first && x < last) {
          go = 1;
        }
      }
    }
    u32 both;
    const u32 at = block_scan(scan, go + (bad != ~0ull ? BAD : 0), both);
    const u32 pos = at & (BAD - 1), total = both & (BAD - 1);
    if (both >= BAD) {
      // The block's first bad id is the one of its first thread with one: token order.
      if (bad != ~0ull && at < BAD) {
        const u64 x = static_cast<u64>(expert_id(a, bad));
        scan.why = Refusal{OP_EXPERT, static_cast<u32>(a.experts), bad, x};
        // Reported here by the block of rank 0 only (every block sees it).
        if (r == 0) invalid(a, OP_EXPERT, -1, bad, x, static_cast<u32>(a.experts));
      }
      refused = true;
      break;
    }
    if (go && n + pos < a.rows) {
      scan.picked[pos] = t;
      i32* rec = reinterpret_cast<i32*>(recs + (n + pos) * a.record);
      rec[0] = static_cast<i32>(t);
      for (u64 k = 0; k < a.topk; ++k) {
        const i64 x = expert_id(a, t * a.topk + k);
        rec[1 + k] = (x < -1 || x >= static_cast<i64>(a.experts)) ? -1 : static_cast<i32>(x);
      }
    }
    __syncthreads();
    for (u32 j = 0; j < total && n + j < a.rows; ++j) {
      const u64 tok = scan.picked[j];
      Byte* rec = recs + (n + j) * a.record;
      copy_block(rec + ids_bytes, reinterpret_cast<const Byte*>(a.tokens) + tok * a.row_bytes, a.row_bytes);
      if (a.scale_bytes) {
        copy_block(rec + ids_bytes + data_bytes, reinterpret_cast<const Byte*>(a.scales) + tok * a.scale_bytes,
                   a.scale_bytes);
      }
    }
    n += total;
  }
  // More tokens than the slot holds: then some expert of r gets more than its capacity (the
  // slot holds local * capacity), and r needs exact counts, which it cannot take from records
  // that were not written.
  if (refused) n = 0;
  __syncthreads();  // scan.why is written
  if (n > a.rows) {
    for (u64 e = threadIdx.x; e < a.local; e += blockDim.x) {
      u64 c = 0;
      for (u64 i = 0; i < a.n_tokens * a.topk; ++i) c += expert_id(a, i) == first + static_cast<i64>(e);
      per_expert(slot)[e] = static_cast<u32>(c < 0xffffffffull ? c : 0xffffffffull);
    }
  }
  if (threadIdx.x == 0) write_header(slot, a, n, epoch, scan.why);
  publish(w, a, r, direct, slot, refused ? sizeof(Header) : a.header + min(n, a.rows) * a.record, D_READY, epoch);
  if (threadIdx.x == 0) store_release(sent, epoch);
}

FERROCOMM_DEVICE_INLINE void dispatch_recv(const ferrocomm_window_handle& h, const Args& a, u64* counters) {
  const Window w(h);
  if (!w.abi_ok()) return;
  FERROCOMM_SHARED(Scan, scan);
  u64* got = counters + C_DRECV + blockIdx.x;
  const u64 epoch = load_relaxed(got) + 1;
  const Filled filled = wait_filled(w, a, D_READY, epoch);
  if (filled == Filled::Stop) return;
  const i64 first = static_cast<i64>(w.rank()) * a.local;
  const u64 ids_bytes = (4 + 4 * a.topk + 15) / 16 * 16;
  const u64 data_bytes = (a.row_bytes + 15) / 16 * 16;
  Byte* out = reinterpret_cast<Byte*>(a.tokens);
  Byte* out_scales = reinterpret_cast<Byte*>(a.scales);
  i32* src = reinterpret_cast<i32*>(a.src);
  for (u64 e = blockIdx.x; filled == Filled::Yes && e < a.local; e += gridDim.x) {
    const i64 x = first + static_cast<i64>(e);
    u64 count = 0;  // pairs routed to e so far
    u64 at = 0;     // rows of e packed so far (differs from count only after a slot overflowed)
    for (i32 p = 0; p < w.size(); ++p) {
      Byte* slot = w.local_ptr<Byte>(a.region + static_cast<u64>(p) * a.slot);
      const u64 sent = reinterpret_cast<const Header*>(slot)->rows;
      const u64 kept = min(sent, a.rows);
      const Byte* recs = slot + a.header;
      const u64 pairs = kept * a.topk;
      u64 matched = 0;
      for (u64 base = 0; base < pairs; base += blockDim.x) {
        const u64 q = base + threadIdx.x;
        u32 go = 0;
        if (q < pairs) {
          const i32* rec = reinterpret_cast<const i32*>(recs + (q / a.topk) * a.record);
          go = rec[1 + q % a.topk] == x;
        }
        u32 total;
        const u32 pos = block_scan(scan, go, total);
        const u64 row = at + pos;
        if (go && row < a.capacity) {
          const i32* rec = reinterpret_cast<const i32*>(recs + (q / a.topk) * a.record);
          scan.picked[pos] = q / a.topk;
          i32* s = src + (e * a.capacity + row) * 3;
          s[0] = p;
          s[1] = rec[0];
          s[2] = static_cast<i32>(q % a.topk);
        }
        __syncthreads();
        for (u32 j = 0; j < total && at + j < a.capacity; ++j) {
          const Byte* rec = recs + scan.picked[j] * a.record;
          const u64 row = e * a.capacity + at + j;
          copy_block(out + row * a.row_bytes, rec + ids_bytes, a.row_bytes);
          if (a.scale_bytes) copy_block(out_scales + row * a.scale_bytes, rec + ids_bytes + data_bytes, a.scale_bytes);
        }
        at += total;
        matched += total;
      }
      count += sent > a.rows ? per_expert(slot)[e] : matched;
    }
    if (threadIdx.x == 0) {
      reinterpret_cast<i32*>(a.counts)[e] = static_cast<i32>(count < 0x7fffffffull ? count : 0x7fffffffull);
      if (count > a.capacity) invalid(a, OP_CAPACITY, static_cast<i32>(e), a.capacity, count, static_cast<u32>(x));
    }
  }
  signal_consumed(w, D_DONE, epoch);
  if (threadIdx.x == 0) store_release(got, epoch);
}

FERROCOMM_DEVICE_INLINE void combine_send(const ferrocomm_window_handle& h, const Args& a, u64* counters) {
  const Window w(h);
  if (!w.abi_ok()) return;
  const i32 r = static_cast<i32>(blockIdx.x);
  if (r >= w.size()) return;
  FERROCOMM_SHARED(Scan, scan);
  const bool direct = team_is_local(w, r);
  if (!reachable(a, r, direct)) return;
  u64* sent = counters + C_CSENT + r;
  const u64 epoch = load_relaxed(sent) + 1;
  if (!wait_consumed(w, C_DONE, r, epoch)) return;
  Byte* slot = slot_for(w, a, r, direct);
  Byte* recs = slot + a.header;
  const i32* counts = reinterpret_cast<const i32*>(a.counts);
  const i32* src = reinterpret_cast<const i32*>(a.src);
  const Byte* rows = reinterpret_cast<const Byte*>(a.tokens);
  u64 n = 0;
  // Refused: by the host, or at the first bad count or source, in (expert, row) order (every
  // block sees the same one).
  bool refused = a.refuse != 0;
  if (threadIdx.x == 0) scan.why = Refusal{static_cast<u32>(a.refuse), 0, 0, 0};
  for (u64 e = 0; e < a.local && !refused; ++e) {
    const i32 c = counts[e];
    if (c < 0) {
      if (threadIdx.x == 0) {
        scan.why = Refusal{OP_SRC, static_cast<u32>(e), ~0ull, static_cast<u64>(c)};
        if (r == 0) invalid(a, OP_SRC, static_cast<i32>(e), ~0ull, static_cast<u64>(c));
      }
      refused = true;
      break;
    }
    const u64 m = min(static_cast<u64>(c), a.capacity);
    u64 mine = 0;
    for (u64 base = 0; base < m; base += blockDim.x) {
      const u64 i = base + threadIdx.x;
      u32 go = 0, bad = 0;
      if (i < m) {
        const i32* s = src + (e * a.capacity + i) * 3;
        const bool ok = s[0] >= 0 && s[0] < w.size() && s[1] >= 0 && s[2] >= 0 && static_cast<u64>(s[2]) < a.topk;
        bad = !ok;
        go = ok && s[0] == r;
      }
      u32 both;
      const u32 at = block_scan(scan, go + (bad ? BAD : 0), both);
      const u32 pos = at & (BAD - 1), total = both & (BAD - 1);
      if (both >= BAD) {
        if (bad && at < BAD) {
          const i32* s = src + (e * a.capacity + i) * 3;
          const u64 seen = static_cast<u64>(static_cast<u32>(s[0])) << 32 | static_cast<u32>(s[2]);
          scan.why = Refusal{OP_SRC, static_cast<u32>(e), i, seen};
          if (r == 0) invalid(a, OP_SRC, static_cast<i32>(e), i, seen);
        }
        refused = true;
        break;
      }
      if (go) {
        const i32* s = src + (e * a.capacity + i) * 3;
        scan.picked[pos] = i;
        i32* rec = reinterpret_cast<i32*>(recs + (n + pos) * a.record);
        rec[0] = s[1];
        rec[1] = s[2];
      }
      __syncthreads();
      for (u32 j = 0; j < total; ++j) {
        copy_block(recs + (n + j) * a.record + 16, rows + (e * a.capacity + scan.picked[j]) * a.row_bytes, a.row_bytes);
      }
      n += total;
      mine += total;
    }
    if (!refused && threadIdx.x == 0) per_expert(slot)[e] = static_cast<u32>(mine);
  }
  if (refused) n = 0;
  __syncthreads();  // scan.why is written
  if (threadIdx.x == 0) write_header(slot, a, n, epoch, scan.why);
  publish(w, a, r, direct, slot, refused ? sizeof(Header) : a.header + n * a.record, C_READY, epoch);
  if (threadIdx.x == 0) store_release(sent, epoch);
}

FERROCOMM_DEVICE_INLINE float value_at(const Byte* row, u64 j, u64 dtype) {
  if (dtype == 0) return F32::get(reinterpret_cast<const u32*>(row)[j]);
  if (dtype == 1) return F16::get(reinterpret_cast<const u16*>(row)[j]);
  return Bf16::get(reinterpret_cast<const u16*>(row)[j]);
}

FERROCOMM_DEVICE_INLINE void store_at(Byte* row, u64 j, u64 dtype, float v) {
  if (dtype == 0) reinterpret_cast<u32*>(row)[j] = F32::put(v);
  else if (dtype == 1) reinterpret_cast<u16*>(row)[j] = F16::put(v);
  else reinterpret_cast<u16*>(row)[j] = Bf16::put(v);
}

// The record of (t, k) among rank p's records for local expert e, or null.
FERROCOMM_DEVICE_INLINE const Byte* find_row(const Window& w, const Args& a, i32 p, u64 e, i32 t, i32 k) {
  const Byte* slot = w.local_ptr<const Byte>(a.region + static_cast<u64>(p) * a.slot);
  const u32* per = per_expert(slot);
  u64 lo = 0;
  for (u64 i = 0; i < e; ++i) lo += per[i];
  const u64 n = per[e];
  const Byte* recs = slot + a.header;
  const u64 key = static_cast<u64>(static_cast<u32>(t)) << 32 | static_cast<u32>(k);
  auto key_of = [&](u64 i) {
    const i32* rec = reinterpret_cast<const i32*>(recs + (lo + i) * a.record);
    return static_cast<u64>(static_cast<u32>(rec[0])) << 32 | static_cast<u32>(rec[1]);
  };
  u64 l = 0, hi = n;
  while (l < hi) {
    const u64 mid = l + (hi - l) / 2;
    if (key_of(mid) < key) l = mid + 1;
    else hi = mid;
  }
  if (l < n && key_of(l) == key) return recs + (lo + l) * a.record + 16;
  // Not sorted (a src of another order): look at every record of e.
  for (u64 i = 0; i < n; ++i) {
    if (key_of(i) == key) return recs + (lo + i) * a.record + 16;
  }
  return nullptr;
}

struct Found {
  const Byte* row[MOE_MAX_TOPK];
  float weight[MOE_MAX_TOPK];
  bool lost[MOE_MAX_TOPK];  // a bad id or a missing row: the token stays unwritten
};

FERROCOMM_DEVICE_INLINE void combine_recv(const ferrocomm_window_handle& h, const Args& a, u64* counters) {
  const Window w(h);
  if (!w.abi_ok()) return;
  FERROCOMM_SHARED(Found, found);
  u64* got = counters + C_CRECV + blockIdx.x;
  const u64 epoch = load_relaxed(got) + 1;
  const Filled filled = wait_filled(w, a, C_READY, epoch);
  if (filled == Filled::Stop) return;
  // Nothing to read (a source refused, or has another shape): only DONE.
  if (filled == Filled::Skip) {
    signal_consumed(w, C_DONE, epoch);
    if (threadIdx.x == 0) store_release(got, epoch);
    return;
  }
  // Every record must answer a (token, k) of ours routed to its sender's expert (the CPU
  // engine's check): the blocks share the records of each source.
  for (i32 p = 0; p < w.size(); ++p) {
    const Byte* slot = w.local_ptr<const Byte>(a.region + static_cast<u64>(p) * a.slot);
    const Byte* recs = slot + a.header;
    u64 lo = 0;
    for (u64 e = 0; e < a.local; ++e) {
      const u64 n = per_expert(slot)[e];
      const i64 x = static_cast<i64>(p) * static_cast<i64>(a.local) + static_cast<i64>(e);
      for (u64 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const i32* rec = reinterpret_cast<const i32*>(recs + (lo + i) * a.record);
        const bool ok = rec[0] >= 0 && static_cast<u64>(rec[0]) < a.n_tokens && rec[1] >= 0 &&
                        static_cast<u64>(rec[1]) < a.topk && expert_id(a, rec[0] * a.topk + rec[1]) == x;
        if (!ok) invalid(a, OP_STRAY, p, static_cast<u64>(static_cast<u32>(rec[0])), static_cast<u64>(static_cast<u32>(rec[1])));
      }
      lo += n;
    }
  }
  const float* weights = reinterpret_cast<const float*>(a.weights);
  Byte* out = reinterpret_cast<Byte*>(a.out);
  for (u64 t = blockIdx.x; t < a.n_tokens; t += gridDim.x) {
    for (u64 k = threadIdx.x; k < a.topk; k += blockDim.x) {
      const i64 x = expert_id(a, t * a.topk + k);
      const Byte* row = nullptr;
      if (bad_expert(a, x)) {
        invalid(a, OP_EXPERT, -1, t * a.topk + k, static_cast<u64>(x), static_cast<u32>(a.experts));
      } else if (x >= 0) {
        const i32 p = static_cast<i32>(x / static_cast<i64>(a.local));
        row = find_row(w, a, p, static_cast<u64>(x) % a.local, static_cast<i32>(t), static_cast<i32>(k));
        if (!row) {
          invalid(a, OP_MISSING, p, t, k);
          // The largest complement is the smallest (token, k): the CPU engine's first.
          const u64 key = t << 32 | k << 16 | static_cast<u64>(p);
          if (a.errors) atomicMax(reinterpret_cast<unsigned long long*>(counters + C_MISSING), ~key);
        }
      }
      found.row[k] = row;
      found.weight[k] = weights[t * a.topk + k];
      found.lost[k] = x != -1 && !row;
    }
    __syncthreads();
    // A token with a lost row fails the call and keeps its old bits (as in the CPU engine),
    // rather than a sum of the rows that did come back.
    bool whole = true;
    for (u64 k = 0; k < a.topk; ++k) whole = whole && !found.lost[k];
    for (u64 j = whole ? threadIdx.x : a.hidden; j < a.hidden; j += blockDim.x) {
      float acc = 0.0f;
      for (u64 k = 0; k < a.topk; ++k) {
        if (found.row[k]) acc = fmaf(found.weight[k], value_at(found.row[k], j, a.dtype), acc);
      }
      store_at(out + t * a.row_bytes, j, a.dtype, acc);
    }
    __syncthreads();
  }
  signal_consumed(w, C_DONE, epoch);
  if (threadIdx.x == 0) store_release(got, epoch);
}

}  // namespace moe
}  // namespace ferrocomm

extern "C" __global__ void __launch_bounds__(256, 1)
    ferrocomm_moe_dispatch_send(ferrocomm_window_handle h, FERROCOMM_GRID_CONSTANT const ferrocomm::moe::Args a,
                                ferrocomm::u64* counters) {
  ferrocomm::moe::dispatch_send(h, a, counters);
}

extern "C" __global__ void __launch_bounds__(256, 1)
    ferrocomm_moe_dispatch_recv(ferrocomm_window_handle h, FERROCOMM_GRID_CONSTANT const ferrocomm::moe::Args a,
                                ferrocomm::u64* counters) {
  ferrocomm::moe::dispatch_recv(h, a, counters);
}

extern "C" __global__ void __launch_bounds__(256, 1)
    ferrocomm_moe_combine_send(ferrocomm_window_handle h, FERROCOMM_GRID_CONSTANT const ferrocomm::moe::Args a,
                               ferrocomm::u64* counters) {
  ferrocomm::moe::combine_send(h, a, counters);
}

extern "C" __global__ void __launch_bounds__(256, 1)
    ferrocomm_moe_combine_recv(ferrocomm_window_handle h, FERROCOMM_GRID_CONSTANT const ferrocomm::moe::Args a,
                               ferrocomm::u64* counters) {
  ferrocomm::moe::combine_recv(h, a, counters);
}
