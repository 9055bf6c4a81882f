// all_reduce + residual add + RMSNorm in one kernel (TensorRT-LLM's RESIDUAL_RMS_NORM fusion,
// optionally quantising the output to fp8), on the device backend's collective window. Per
// token row t: s = the sum of every rank's x[t] in rank order in f32, plus residual[t];
// residual[t] = s rounded; out[t] = rmsnorm(s) * gamma, rounded or quantised with the row's
// scale (ferrocomm/norm.cuh; the host's definition is host/contracts/inference.rs).
//
// One-shot (few rows): each rank copies its x into its segment and signals READY; block b then
// computes the rows t = b, b + grid, ... from every segment, so every rank computes every row,
// with the same code in the same order: the same bits everywhere.
// Two-shot (many rows): the rows are cut into one run per rank (rank r: rows r * rows / size
// to (r + 1) * rows / size, as the CPU engine cuts them); rank r computes its run only, puts
// each result (residual row, out row, scale) in its segment and signals REDUCED; every rank
// then copies the other runs' results. Every rank's residual must then be the same, as a
// tensor-parallel residual stream is: rank r's residual makes run r.
//
// Block b handles the rows t = b (mod grid) in every phase, so READY / REDUCED of block b cover
// exactly the rows block b of each peer reads. Each block writes a header (row bytes, the
// launch's rows, the call's rows, kernel and eps) with its rows: a peer whose header differs
// made another call, and every rank then records MISMATCH (the relation is symmetric, so all
// of them do) and computes nothing. The f32 sums of a row wait in a private scratch row of the
// block in our own segment, which no peer reads. The protocol (epochs, ids, segment reuse) is
// in collective.cuh; the host cuts larger calls into launches of whole rows
// (host/backend/device/collectives/norm.rs).
//
// Mismatched calls end in the same launch on every rank, with every rank's epochs in step. A
// block that waits for a peer's block that never comes ends only by the timeout, and leaves
// its READY signal ahead of that peer's epochs, so the next call would read a segment before
// its peer wrote it. Hence:
// - the grid is always MAX_BLOCKS, however few the rows (blocks past them only take part in
//   the protocol): with grids that follow the rows, a block of the larger grid would wait for
//   a block its peer never launched;
// - the header carries the call's rows: calls cut into other launches (other row counts or
//   lengths) differ in their first launch already, and calls whose first launches agree agree
//   in every launch (the cut depends only on the header, the world size and the region);
// - the first launch of a call notes in device memory (the word after the mismatch count)
//   whether it found a mismatch, and the call's later launches, which the peers may not have,
//   then end at once, before they take an epoch or signal anything. Not the window's status:
//   the host may take and clear that between two launches of a call (on a GPU it reads it
//   when the next call is issued, while the launches may still wait on their stream).

#include "collective.cuh"

using namespace ferrocomm;
using namespace ferrocomm::coll;

// Named, not anonymous: the kernels are compiled as one unit (build.rs), and alltoall.cu's
// anonymous namespace has names of its own.
namespace fused_norm {

// host/gpu/kernels.rs mirrors it: device addresses, rows of this launch, elements per row.
struct NormArgs {
  u64 x, residual, gamma, out, scales;  // scales: 0 unless out is fp8
  u64 rows, hidden;
  float eps;
  u32 vectors;     // every buffer 16-byte aligned and hidden a multiple of 16 bytes' elements
  u64 mismatches;  // u64[2]: blocks that found a mismatched call (see `report`), then whether
                   // the call's first launch found one (see the top of the file)
  u64 call_rows;   // rows of the whole call
  u64 launch;      // this launch's index in its call
  u64 refused;     // 0, or this rank's host refused the call (an argument error): the launch
                   // only tells the peers (see REFUSED_HEADER)
};
static_assert(sizeof(NormArgs) == 96, "NormArgs is mirrored by host/gpu/kernels.rs");

FERROCOMM_DEVICE_INLINE constexpr u64 pad16(u64 b) { return (b + 15) / 16 * 16; }

// Per block: row bytes, the launch's rows, the call's rows, then the kernel code (two-shot
// 0x100) and the eps bits (the high half) in one word.
constexpr u64 HEADER_BYTES = 32;
// The last header word of a refused call (no kernel code is 0xffff): its peers then record
// FERROCOMM_STATUS_REFUSED naming it, as the CPU engine's peers fail at once naming a rank that
// refused its call, instead of waiting for rows that never come.
constexpr u64 REFUSED_HEADER = 0xffff;

// Where one launch keeps what in a segment (byte offsets; host/backend/device/collectives/norm.rs
// computes the same to bound the rows per launch): the blocks' headers, every row of x, the
// two-shot results of our run (`own` rows: residual row, out row, scale, each 16-byte aligned),
// then one f32 scratch row per block.
struct Layout {
  u64 x, results, result_row, result_out, result_scale, scratch, scratch_row;
  FERROCOMM_DEVICE_INLINE Layout(u64 rows, u64 hidden, u64 in_size, u64 out_size, u64 own) {
    x = HEADER_BYTES * MAX_BLOCKS;
    results = x + pad16(rows * hidden * in_size);
    result_out = pad16(hidden * in_size);
    result_scale = result_out + pad16(hidden * out_size);
    result_row = result_scale + 16;
    scratch = results + own * result_row;
    scratch_row = pad16(hidden * 4);
  }
};

// dst[i] = src[i] for i < n at block scope, 16 bytes at a time where both are aligned.
template <class Raw>
FERROCOMM_DEVICE_INLINE void copy_row(Raw* dst, const Raw* src, u64 n) {
  constexpr u64 V = 16 / sizeof(Raw);
  const bool vec = ((reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src)) & 15u) == 0;
  const u64 vhi = vec ? n / V * V : 0;
  for (u64 g = threadIdx.x; g < vhi / V; g += blockDim.x) {
    reinterpret_cast<uint4*>(dst)[g] = reinterpret_cast<const uint4*>(src)[g];
  }
  for (u64 i = vhi + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// The first row t >= lo that this block handles (t = blockIdx.x mod gridDim.x).
FERROCOMM_DEVICE_INLINE u64 first_row(u64 lo) { return lo + (blockIdx.x + gridDim.x - lo % gridDim.x) % gridDim.x; }

// A peer whose header for this block differs from ours: its rank (or -1), the bytes of x of
// its call (row bytes times the call's rows), and whether it refused its call.
struct Disagreement {
  i32 peer;
  u64 bytes;
  bool refused;
};

FERROCOMM_DEVICE_INLINE Disagreement disagreeing(const Window& w, const u64 (&mine)[4]) {
  for (i32 p = 0; p < w.size(); ++p) {
    const u64* theirs = w.peer_ptr<const u64>(p, HEADER_BYTES * blockIdx.x);
    if (theirs[0] != mine[0] || theirs[1] != mine[1] || theirs[2] != mine[2] || theirs[3] != mine[3]) {
      return Disagreement{p, theirs[0] * theirs[2], theirs[3] == REFUSED_HEADER};
    }
  }
  return Disagreement{-1, 0, false};
}

// Records a mismatched call once every block of the launch has ended its part of the protocol
// (every block finds it: a launch's headers are the same in all its blocks). A status recorded
// earlier would end the waits of blocks still exchanging (Window::failed), leaving their
// epochs behind their peers'. As alltoall.cu: the bytes of x of our call and of theirs, or all
// ones where those agree but the call does not.
FERROCOMM_DEVICE_INLINE void report(const Window& w, const NormArgs& a, Disagreement d, u64 mine) {
  if (threadIdx.x != 0) return;
  u64* blocks = reinterpret_cast<u64*>(a.mismatches);
  if (atomicAdd(blocks, 1ull) + 1 < gridDim.x) return;
  // Atomic too: a plain store would race with the other blocks' atomicAdds, which happen
  // before it only in the word's modification order (relaxed), not in program order.
  store_relaxed(blocks, 0);
  // A refusal is recorded on every rank that takes part, the refusing one naming itself: on a
  // GPU a call's status is reported (and the call skipped) by the rank's next call, so every
  // rank skips the same one. (The host device reports it inside the call: the refusing rank's
  // host clears its own.)
  if (a.refused || d.refused) {
    const i32 who = a.refused ? w.rank() : d.peer;
    record_status(w.handle().status, FERROCOMM_STATUS_REFUSED, FERROCOMM_OP_COLLECTIVE, who, READY_ID + blockIdx.x,
                  mine, 0);
    return;
  }
  record_status(w.handle().status, FERROCOMM_STATUS_MISMATCH, FERROCOMM_OP_COLLECTIVE, d.peer, READY_ID + blockIdx.x,
                mine, d.bytes != mine ? d.bytes : ~0ull);
}

// Row t: s = the sum of every segment's x row in rank order + residual; residual = s rounded;
// s kept in f32 in `scratch`, cut as rmsnorm_row reads it (no barrier needed between).
template <class E>
FERROCOMM_DEVICE_INLINE void sum_row(const Window& w, u64 x_offset, typename E::Raw* residual, float* scratch, u64 n,
                                     bool vec) {
  using G = RowGroups<E>;
  for (u64 g = threadIdx.x; g < G::count(n); g += blockDim.x) {
    float acc[G::V], v[G::V];
    reduce_group<E>(w, x_offset, n, g, vec, acc);
    load_group<E>(residual, n, g, vec, v);
#pragma unroll
    for (u32 k = 0; k < G::V; ++k) acc[k] += v[k];
    store_group<E>(residual, n, g, vec, acc);
    store_group<F32>(reinterpret_cast<u32*>(scratch), n, g, vec, acc);
  }
}

template <class E, class O, u32 KIND>
FERROCOMM_DEVICE_INLINE void all_reduce_rmsnorm(const ferrocomm_window_handle& h, const NormArgs& a, u64* counters,
                                                bool two_shot) {
  using In = typename E::Raw;
  using Out = typename O::Raw;
  const Window w(h);
  const u64 n = a.hidden, size = static_cast<u64>(w.size()), me = static_cast<u64>(w.rank());
  const u64 row_in = n * sizeof(In);
  // Rank r's run of rows in the two-shot (the largest has own_max rows).
  auto run = [&](u64 r) { return r * a.rows / size; };
  const u64 own_max = two_shot ? (a.rows + size - 1) / size : 0;
  const Layout l(a.rows, n, sizeof(In), sizeof(Out), own_max);
  const bool vec = a.vectors != 0;
  const In* x = reinterpret_cast<const In*>(a.x);
  In* residual = reinterpret_cast<In*>(a.residual);
  const In* gamma = reinterpret_cast<const In*>(a.gamma);
  Out* out = reinterpret_cast<Out*>(a.out);
  float* scales = reinterpret_cast<float*>(a.scales);
  // Whether this call's first launch found a mismatch: then the peers may not have this launch.
  u64* mismatched = reinterpret_cast<u64*>(a.mismatches) + 1;
  if (a.launch > 0 && load_relaxed(mismatched) != 0) return;
  Step s;
  if (!begin(w, counters, s)) return;
  float* scratch = w.local_ptr<float>(l.scratch + blockIdx.x * l.scratch_row);
  // A refused call has no rows (a.rows is 0) and a header no call has.
  const u64 header[4] = {a.refused ? 0 : row_in, a.rows, a.call_rows,
                         a.refused ? REFUSED_HEADER
                                   : KIND | (two_shot ? 0x100u : 0u) | static_cast<u64>(__float_as_uint(a.eps)) << 32};
  if (threadIdx.x < 4) w.local_ptr<u64>(HEADER_BYTES * blockIdx.x)[threadIdx.x] = header[threadIdx.x];
  for (u64 t = blockIdx.x; t < a.rows; t += gridDim.x) copy_row(w.local_ptr<In>(l.x + t * row_in), x + t * n, n);
  // Our own rows are read group by group, by other threads than copied them (the exchange
  // syncs the block only where there are peers to signal).
  __syncthreads();
  if (!exchange(w, s, s.ready)) return;
  // Read before `end`: after our DONE a peer may start its next call and rewrite its header.
  const Disagreement other = disagreeing(w, header);
  // Every block of the launch finds the same, so they all store the same value (atomically),
  // and the kernel boundary orders the stores before the next launch's loads.
  if (a.launch == 0 && threadIdx.x == 0) store_relaxed(mismatched, other.peer >= 0 ? 1 : 0);
  if (other.peer < 0) {
    const u64 lo = two_shot ? run(me) : 0, hi = two_shot ? run(me + 1) : a.rows;
    for (u64 t = first_row(lo); t < hi; t += gridDim.x) {
      sum_row<E>(w, l.x + t * row_in, residual + t * n, scratch, n, vec);
      const float scale = rmsnorm_row<E, O>(scratch, gamma, out + t * n, n, a.eps, vec);
      if (scales && threadIdx.x == 0) scales[t] = scale;
      if (two_shot) {
        // The rows were written group by group by other threads than copy_row's.
        __syncthreads();
        unsigned char* r = w.local_ptr<unsigned char>(l.results + (t - lo) * l.result_row);
        copy_row(reinterpret_cast<In*>(r), residual + t * n, n);
        copy_row(reinterpret_cast<Out*>(r + l.result_out), out + t * n, n);
        if (threadIdx.x == 0) *reinterpret_cast<float*>(r + l.result_scale) = scale;
      }
    }
    // Blocks past the rows have no results (on every rank alike: the headers agree).
    if (two_shot && blockIdx.x < a.rows) {
      if (!exchange(w, s, s.reduced)) return;
      for (i32 p = 0; p < w.size(); ++p) {
        if (p == w.rank()) continue;
        const u64 plo = run(static_cast<u64>(p)), phi = run(static_cast<u64>(p) + 1);
        for (u64 t = first_row(plo); t < phi; t += gridDim.x) {
          const unsigned char* r = w.peer_ptr<const unsigned char>(p, l.results + (t - plo) * l.result_row);
          copy_row(residual + t * n, reinterpret_cast<const In*>(r), n);
          copy_row(out + t * n, reinterpret_cast<const Out*>(r + l.result_out), n);
          if (scales && threadIdx.x == 0) scales[t] = *reinterpret_cast<const float*>(r + l.result_scale);
        }
      }
    }
  }
  end(w, counters, s);
  if (other.peer >= 0) report(w, a, other, row_in * a.call_rows);
}

}  // namespace fused_norm

// Every (name suffix, activation type, output type, kernel code) of the fused norm; the host
// (host/backend/device/collectives/norm.rs, `norm_suffix`) loads them by these suffixes.
#define FERROCOMM_FOR_EACH_NORM(M) \
  M(f32, F32, F32, 1)              \
  M(f16, F16, F16, 2)              \
  M(bf16, Bf16, Bf16, 3)           \
  M(f32_fp8, F32, E4M3, 4)         \
  M(f16_fp8, F16, E4M3, 5)         \
  M(bf16_fp8, Bf16, E4M3, 6)

#define FERROCOMM_NORM(name, E, O, KIND)                                                                   \
  extern "C" __global__ void __launch_bounds__(256, 1)                                                     \
      ferrocomm_rmsnorm_oneshot_##name(ferrocomm_window_handle h, const fused_norm::NormArgs a, u64* counters) {      \
    fused_norm::all_reduce_rmsnorm<E, O, KIND>(h, a, counters, false);                                                 \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(256, 1)                                                     \
      ferrocomm_rmsnorm_twoshot_##name(ferrocomm_window_handle h, const fused_norm::NormArgs a, u64* counters) {      \
    fused_norm::all_reduce_rmsnorm<E, O, KIND>(h, a, counters, true);                                                  \
  }

FERROCOMM_FOR_EACH_NORM(FERROCOMM_NORM)
