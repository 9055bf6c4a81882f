#!/usr/bin/env bash
# Prints a CUDA root (a folder with bin/nvcc) for build.rs. Order: $CUDA_HOME, nvcc on PATH,
# then the project's cache: CUDA 13.0's compiler wheels from PyPI (nvcc, cicc, ptxas, headers,
# NVRTC), installed once into .toolchain-cache/cuda-13.0. Every version is pinned, because the
# wheels' own requirements are unpinned and would mix a newer cicc with this ptxas.
# CUDA 13.0 matches the R580 drivers of the GPU machines we test on, and targets sm_80..sm_100.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then
  echo "$CUDA_HOME"; exit 0
fi
if command -v nvcc >/dev/null 2>&1; then
  dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"; exit 0
fi

cache=.toolchain-cache/cuda-13.0
root=$cache/nvidia/cu13
if [[ ! -x $root/bin/nvcc || ! -e $root/lib/libnvrtc.so.13 ]]; then
  echo "installing CUDA 13.0 compiler wheels into $cache" >&2
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$cache" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88 >&2
fi
readlink -f "$root"
