// The one header that decides CUDA, HIP or the host device (CPU threads; FERROCOMM_HOST_DEVICE,
// see host/runtime.h). Every other header includes it and tests only the macros it defines;
// none names a vendor itself.
#pragma once

#if defined(FERROCOMM_HOST_DEVICE)
#define FERROCOMM_HOST 1
#include "ferrocomm/host/runtime.h"
#define FERROCOMM_WARP_SIZE 32
#define FERROCOMM_SYNC_WARP() __syncwarp()
#elif defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#define FERROCOMM_HIP 1
#include <hip/hip_runtime.h>
#define FERROCOMM_WARP_SIZE 64
// A wavefront executes in lockstep; the fence makes each lane's stores visible to the others.
#define FERROCOMM_SYNC_WARP()                                 \
  do {                                                        \
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");   \
    __builtin_amdgcn_wave_barrier();                          \
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");   \
  } while (0)
#else
#define FERROCOMM_CUDA 1
#define FERROCOMM_WARP_SIZE 32
#define FERROCOMM_SYNC_WARP() __syncwarp()
#endif

// A by-value kernel parameter that device code indexes at run time: on CUDA it stays in
// parameter space instead of being copied to the stack.
#if FERROCOMM_CUDA
#define FERROCOMM_GRID_CONSTANT __grid_constant__
#else
#define FERROCOMM_GRID_CONSTANT
#endif

#define FERROCOMM_DEVICE_INLINE __device__ __forceinline__
// A static shared-memory variable of the block.
#if FERROCOMM_HOST
#define FERROCOMM_SHARED(type, name) FERROCOMM_HOST_SHARED(type, name)
#else
#define FERROCOMM_SHARED(type, name) __shared__ type name
#endif
#define FERROCOMM_SYNC_BLOCK() __syncthreads()
// Block barrier that also tells whether `pred` held on every thread.
#define FERROCOMM_SYNC_BLOCK_AND(pred) (__syncthreads_and(pred) != 0)

#include "ferrocomm/abi.h"

namespace ferrocomm {
using u64 = ferrocomm_u64;
using u32 = ferrocomm_u32;
using i32 = ferrocomm_i32;
}  // namespace ferrocomm
