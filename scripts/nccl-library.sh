#!/usr/bin/env bash
# Prints a folder holding libnccl.so.2 for FERROCOMM_NCCL_PATH: NCCL's own PyPI wheel
# (nvidia-nccl-cu13, pinned), installed once into .toolchain-cache/nccl. NCCL loads and answers
# version and unique-id queries without a GPU, so CI exercises the real loader with it.
set -euo pipefail
cd "$(dirname "$0")/.."

cache=.toolchain-cache/nccl-2.32.3
lib=$cache/nvidia/nccl/lib
if [[ ! -e $lib/libnccl.so.2 ]]; then
  echo "installing NCCL 2.32.3 (nvidia-nccl-cu13) into $cache" >&2
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$cache" \
    nvidia-nccl-cu13==2.32.3 >&2
fi
readlink -f "$lib"
