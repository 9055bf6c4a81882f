#!/usr/bin/env bash
# The standard CPU comparison: ferrocomm against MPICH (MPI_Allreduce / MPI_Allgather /
# MPI_Alltoall) and Gloo (PyTorch's CPU collectives) at 2 and 4 processes on this host, in one
# run. Installs what it needs (Debian mpich; torch from PyPI into .toolchain-cache/gloo-venv),
# writes JSON under target/compare/, the collectives section of docs/results/cpu.md, and its
# plot docs/results/cpu-collectives.png (drawn by `ferrocomm-bench plot`).
set -euo pipefail
cd "$(dirname "$0")/.."
cache=.toolchain-cache
out=target/compare
rm -rf "$out"  # stale runs must not mix with this one
mkdir -p "$cache" "$out" target/peers

if ! command -v mpicc >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mpich libmpich-dev
fi
if [ ! -x "$cache/gloo-venv/bin/torchrun" ]; then
  python3 -m venv "$cache/gloo-venv"
  "$cache/gloo-venv/bin/pip" install -q torch numpy
fi
py="$cache/gloo-venv/bin/python"
cargo build --release --quiet -p ferrocomm-bench
mpicc -O2 -Wall -o target/peers/mpi_bench benches/peers/mpi_bench.c
# Cores before OMP_NUM_THREADS is set: GNU nproc honours that variable, and reading it after
# made every run look oversubscribed (50 iterations instead of 2000 at 2 processes).
cores=$(nproc)
export OMP_NUM_THREADS=1

# Small sizes need many iterations for a stable mean; large ones few. Four processes
# oversubscribe a 2-core machine, where MPICH's busy polling costs milliseconds per call, so
# they get fewer.
for n in 2 4; do
  if [ "$n" -le "$cores" ]; then
    sweeps=("small 8 65536 2 2000 100" "large 262144 67108864 4 20 3")
    reps=5
  else
    sweeps=("small 8 65536 2 50 5" "large 262144 67108864 4 5 1")
    reps=3
  fi
  for op in all_reduce all_gather all_to_all; do
    for s in "${sweeps[@]}"; do
      read -r tag lo hi f it wu <<<"$s"
      # Repetitions of every tool, interleaved: the report keeps each size's best mean, and
      # judges the goals by ferrocomm / MPICH of each back-to-back pair (this VM drifts between
      # fast and slow phases, see compare_report.py).
      for rep in $(seq "$reps"); do
        echo "== n=$n $op $tag rep $rep"
        target/release/ferrocomm-bench "$op" -b "$lo" -e "$hi" -f "$f" -n "$it" -w "$wu" --world "$n" \
          --json "$out/ferrocomm-$op-$n-$tag-r$rep.json" >/dev/null
        mpiexec -n "$n" target/peers/mpi_bench "$op" "$lo" "$hi" "$f" "$it" "$wu" "$out/mpich-$op-$n-$tag-r$rep.json" >/dev/null
        gloo_it=$(( it > 200 ? 200 : it ))
        "$cache/gloo-venv/bin/torchrun" --standalone --nproc-per-node "$n" benches/peers/gloo_bench.py \
          "$op" "$lo" "$hi" "$f" "$gloo_it" "$wu" "$out/gloo-$op-$n-$tag-r$rep.json" >/dev/null 2>&1
      done
    done
  done
done

"$py" scripts/compare_report.py "$out" docs/results/cpu.md docs/results/cpu-collectives.png \
  "$(git rev-parse --short HEAD)" "./scripts/cpu_compare.sh"
# Every run of every tool: repeated runs of one tool, op and size merge, each size keeping its
# fastest, as the tables do.
target/release/ferrocomm-bench plot -o docs/results/cpu-collectives.png "$out"/*.json
echo "wrote docs/results/cpu.md and docs/results/cpu-collectives.png"
