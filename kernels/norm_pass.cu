// The unfused all_reduce + residual add + RMSNorm: the steps fused_norm.cu fuses, for where it
// cannot run (ranks on several hosts, where NCCL carries the all_reduce) and as the baseline
// the fused kernels are measured against. No window and no peer: the host
// (host/backend/norm_pass.rs) runs
//
//   1. ferrocomm_widen_*: sum[i] = x[i] as f32, into a scratch buffer of its own;
//   2. an all_reduce (sum, f32) of the scratch, by whichever route the backend picks;
//   3. ferrocomm_residual_rmsnorm_*: per token row t, s = sum[t] + residual[t] in f32;
//      residual[t] = s rounded; out[t] = rmsnorm(s) * gamma, rounded or quantised to fp8 with
//      the row's scale (the same rmsnorm_row as the fused kernels, so where the all_reduce sums
//      in rank order from f32 the results are the fused kernels' bits).

#include "ferrocomm/ferrocomm.cuh"

namespace norm_pass {

using namespace ferrocomm;

// host/gpu/kernels.rs mirrors it: device addresses, rows and elements per row.
struct PassArgs {
  u64 sum, residual, gamma, out, scales;  // sum: f32, rows * hidden; scales: 0 unless out is fp8
  u64 rows, hidden;
  float eps;
  u32 vectors;  // every buffer 16-byte aligned and hidden a multiple of 16 bytes' elements
};
static_assert(sizeof(PassArgs) == 64, "PassArgs is mirrored by host/gpu/kernels.rs");

// out[i] = in[i] as f32 for i < n, grid-stride.
template <class E>
FERROCOMM_DEVICE_INLINE void widen(const typename E::Raw* in, float* out, u64 n) {
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  for (u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = E::get(in[i]);
}

// Rows t = blockIdx.x, blockIdx.x + gridDim.x, ...: the residual add in place in `sum` (each
// thread writes and then reads back only its own groups, as rmsnorm_row reads them), then the
// norm of the row.
template <class E, class O>
FERROCOMM_DEVICE_INLINE void residual_rmsnorm(const PassArgs& a) {
  using G = RowGroups<E>;
  using In = typename E::Raw;
  const u64 n = a.hidden;
  const bool vec = a.vectors != 0;
  float* sum = reinterpret_cast<float*>(a.sum);
  In* residual = reinterpret_cast<In*>(a.residual);
  const In* gamma = reinterpret_cast<const In*>(a.gamma);
  typename O::Raw* out = reinterpret_cast<typename O::Raw*>(a.out);
  float* scales = reinterpret_cast<float*>(a.scales);
  for (u64 t = blockIdx.x; t < a.rows; t += gridDim.x) {
    float* s = sum + t * n;
    for (u64 g = threadIdx.x; g < G::count(n); g += blockDim.x) {
      float acc[G::V], r[G::V];
      load_group<F32>(reinterpret_cast<const u32*>(s), n, g, vec, acc);
      load_group<E>(residual + t * n, n, g, vec, r);
#pragma unroll
      for (u32 k = 0; k < G::V; ++k) acc[k] += r[k];
      store_group<E>(residual + t * n, n, g, vec, acc);
      store_group<F32>(reinterpret_cast<u32*>(s), n, g, vec, acc);
    }
    const float scale = rmsnorm_row<E, O>(s, gamma, out + t * n, n, a.eps, vec);
    if (scales && threadIdx.x == 0) scales[t] = scale;
  }
}

}  // namespace norm_pass

// Every (name suffix, activation type) of the widening copy; (suffix, activation, output) of
// the norm pass, the suffixes of fused_norm.cu (host/backend/norm_pass.rs loads them by these).
#define FERROCOMM_WIDEN(name, E)                                                                        \
  extern "C" __global__ void __launch_bounds__(256)                                                     \
      ferrocomm_widen_##name(ferrocomm::u64 in, ferrocomm::u64 out, ferrocomm::u64 n) {                                                  \
    norm_pass::widen<ferrocomm::E>(reinterpret_cast<const ferrocomm::E::Raw*>(in), reinterpret_cast<float*>(out), n); \
  }
FERROCOMM_WIDEN(f32, F32)
FERROCOMM_WIDEN(f16, F16)
FERROCOMM_WIDEN(bf16, Bf16)

#define FERROCOMM_NORM_PASS(name, E, O)                                                                  \
  extern "C" __global__ void __launch_bounds__(256, 1)                                                  \
      ferrocomm_residual_rmsnorm_##name(const norm_pass::PassArgs a) {                                  \
    norm_pass::residual_rmsnorm<ferrocomm::E, ferrocomm::O>(a);                                          \
  }
FERROCOMM_NORM_PASS(f32, F32, F32)
FERROCOMM_NORM_PASS(f16, F16, F16)
FERROCOMM_NORM_PASS(bf16, Bf16, Bf16)
FERROCOMM_NORM_PASS(f32_fp8, F32, E4M3)
FERROCOMM_NORM_PASS(f16_fp8, F16, E4M3)
FERROCOMM_NORM_PASS(bf16_fp8, Bf16, E4M3)
