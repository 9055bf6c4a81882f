// The device API in one include: windows and their verbs at thread, warp and block scope, and
// multicast access where a window has it.
#pragma once
#include "ferrocomm/window.cuh"
#include "ferrocomm/multimem.cuh"
