#!/usr/bin/env bash
# Runs every kernel of kernels/ and tests/gpu/kernels.cu on the host device with 1, 2, 3, 4 (and
# 8) ranks at once under ThreadSanitizer, then under AddressSanitizer + UndefinedBehaviorSanitizer
# (tests/host-device/kernel_driver.cpp, which checks every result). The kernels, the device-api
# headers and the host-device runtime are all instrumented; a report fails the run. No
# suppressions. Needs g++ with libtsan and libasan (Debian's gcc).
#
# Usage: scripts/host-device-sanitize.sh [max ranks under TSan, default 4] [moe]
# (`moe`: the MoE kernels' checks alone, under both.)
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-4}
only=${2:-}
out=${TMPDIR:-/tmp}/ferrocomm-host-device-sanitize
mkdir -p "$out"
flags=(-std=c++20 -O1 -g -pthread -Wall -Wno-unknown-pragmas -Wno-unused-parameter
  -I device-api/include -I kernels tests/host-device/kernel_driver.cpp device-api/host/runtime.cpp)

# GCC warns that TSan does not model standalone fences (fence_acq_rel, fence_sc): ignoring an
# ordering can only make TSan report more races, never hide one, so the warning is silenced.
g++ "${flags[@]}" -fsanitize=thread -Wno-tsan -o "$out/driver-tsan"
echo "ThreadSanitizer, up to $ranks ranks:"
TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$out/driver-tsan" "$ranks" $only

g++ "${flags[@]}" -fsanitize=address,undefined -fno-sanitize-recover=all -o "$out/driver-asan"
echo "AddressSanitizer + UndefinedBehaviorSanitizer, up to 8 ranks:"
ASAN_OPTIONS="detect_leaks=1" "$out/driver-asan" 8 $only
