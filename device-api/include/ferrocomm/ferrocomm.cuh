// The device API in one include: windows and their verbs at thread, warp and block scope
// (window.cuh), who is in the window and who is load/store reachable (team.cuh), multicast
// access where a window has it (multimem.cuh), the element types, reductions and copies
// ferrocomm's collectives are built from (dtype.cuh, fp8.cuh, reduce_copy.cuh), and the pieces
// of its fused norm: fp8 scales, row loads, block reductions, RMSNorm of a row (norm.cuh).
#pragma once
#include "ferrocomm/window.cuh"
#include "ferrocomm/team.cuh"
#include "ferrocomm/multimem.cuh"
#include "ferrocomm/dtype.cuh"
#include "ferrocomm/fp8.cuh"
#include "ferrocomm/reduce_copy.cuh"
#include "ferrocomm/norm.cuh"
