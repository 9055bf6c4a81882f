#!/usr/bin/env bash
# Device-code checks that need no GPU: ptxas resource usage of the library kernels (the build
# compiles them; a spill or a compile error already failed it) printed as a table, then a HIP
# compile of the same kernels and of the GPU test kernels (every device-api verb at every
# scope) for gfx90a. Installs Debian's hipcc when it is missing and apt is usable.
set -euo pipefail
cd "$(dirname "$0")/.."

report=$(ls -t target/debug/build/ferrocomm-*/out/ptxas-report.txt 2>/dev/null | head -1 || true)
if [[ -z "$report" ]]; then
  echo "no ptxas report: build with nvcc first (cargo build with CUDA_HOME set)" >&2
  exit 1
fi
echo "ptxas resource usage ($report):"
awk '
  /Compiling entry function/ { k = $7; gsub(/[^A-Za-z0-9_]/, "", k); a = $NF; gsub(/[^A-Za-z0-9_]/, "", a) }
  /bytes stack frame/ { stack = $1; spill = $5 + $9 }
  /Used [0-9]+ registers/ { printf "  %-28s %-7s %4s regs  %4s B stack  %s B spilled\n", k, a, $5, stack, spill }
' "$report"
if grep -E "[1-9][0-9]* bytes spill" "$report"; then
  echo "a kernel spills registers" >&2
  exit 1
fi

if ! command -v hipcc >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    echo "installing hipcc (Debian) for the HIP compile check" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc >&2
  else
    echo "hipcc is missing and cannot be installed here (needs root and apt)" >&2
    exit 1
  fi
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for src in kernels/*.cu tests/gpu/kernels.cu; do
  hipcc --genco --offload-arch=gfx90a -std=c++17 -O3 -Werror -I device-api/include -I kernels "$src" -o "$out/$(basename "$src").hsaco"
  echo "hipcc gfx90a: $src ok"
done
