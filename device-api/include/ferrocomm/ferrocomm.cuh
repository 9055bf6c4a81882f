// The device API in one include: windows and their verbs at thread, warp and block scope.
#pragma once
#include "ferrocomm/window.cuh"
