#!/usr/bin/env bash
# Builds the x86-64 bundle for a GPU machine that has no cargo: the test binaries with GPU
# tests, the fused_put_signal example and ferrocomm-bench, plus run.sh, into .gpu-bundle/.
# NCCL is not carried (its library is over 300 MB): run.sh uses the machine's own, found by
# ferrocomm's search (FERROCOMM_NCCL_PATH, the loader's path, the nvidia-nccl wheels).
# On the GPU machine: `bash .gpu-bundle/run.sh OUTDIR [STEP...]` runs every GPU test (a missing
# GPU fails them there: FERROCOMM_REQUIRE_GPU=1), the example, and the device benchmarks, or
# the named steps only (see run.sh), and writes logs and tables under OUTDIR.
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_HOME=$(scripts/cuda-toolchain.sh)
export CUDA_HOME FERROCOMM_REQUIRE_NVCC=1

rm -rf .gpu-bundle && mkdir -p .gpu-bundle
cargo build --release --bins --examples
cargo test --release --no-run --message-format=json --test gpu_windows --test gpu_nccl --test gpu_collectives --test nccl --test device_compile 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
  while read -r name exe; do cp "$exe" ".gpu-bundle/$name"; done
cp target/release/ferrocomm-bench target/release/examples/fused_put_signal .gpu-bundle/
# The bundle travels with the working tree, 64 MiB in all: no symbols.
strip .gpu-bundle/*
git rev-parse --short HEAD > .gpu-bundle/COMMIT

cat > .gpu-bundle/run.sh <<'RUN'
#!/usr/bin/env bash
# Runs the GPU suite from the bundle; logs go to OUTDIR (default $OUT). With step names after
# OUTDIR only those run, so that the suite can be split over calls of limited length:
#   tests:  device_compile nccl gpu_windows gpu_nccl gpu_collectives example
#   bench:  device_put device_pingpong nccl_all_reduce device_all_reduce device_all_reduce_bw
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:-/tmp/ferrocomm-gpu}}
shift || true
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(device_compile nccl gpu_windows gpu_nccl gpu_collectives example
  device_put device_pingpong nccl_all_reduce device_all_reduce device_all_reduce_bw)
mkdir -p "$out"
export FERROCOMM_REQUIRE_GPU=1 FERROCOMM_REQUIRE_NVRTC=1
if [[ -z "${FERROCOMM_NVRTC_PATH:-}" ]]; then
  nvrtc=$( (ls /usr/local/cuda/lib64/libnvrtc.so.13 2>/dev/null;
            find / -name libnvrtc.so.13 -not -path '/proc/*' 2>/dev/null) | head -1)
  [[ -n "$nvrtc" ]] && export FERROCOMM_NVRTC_PATH=$nvrtc
fi
if [[ -z "${FERROCOMM_NCCL_PATH:-}" ]]; then
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
  [[ -n "$nccl" ]] && export FERROCOMM_NCCL_PATH=$nccl
fi
{ echo "commit $(cat "$here/COMMIT")"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  echo "nvrtc ${FERROCOMM_NVRTC_PATH:-not found}"; echo "nccl ${FERROCOMM_NCCL_PATH:-searched by ferrocomm}"; } | tee "$out/machine.txt"
bench() { # seconds, log name, ferrocomm-bench arguments
  local limit=$1 log=$2; shift 2
  timeout "$limit" "$here/ferrocomm-bench" "$@" 2>&1 | tee "$out/$log.txt"
}
status=0
for step in "${steps[@]}"; do
  case $step in
    device_compile|nccl|gpu_windows|gpu_nccl|gpu_collectives)
      (cd "$here" && timeout 300 "./$step" --test-threads=1 2>&1) | tee "$out/$step.log" | grep -E "^test |test result|panicked"
      grep -q "test result: ok" "$out/$step.log" ;;
    example) timeout 60 "$here/fused_put_signal" 2>&1 | tee "$out/fused_put_signal.log" ;;
    device_put) bench 120 device_put device_put -b 64K -e 1G -f 4 -n 20 -w 5 ;;
    device_pingpong) bench 60 device_pingpong device_pingpong -n 10000 ;;
    nccl_all_reduce) bench 120 nccl_all_reduce nccl_all_reduce -b 8 -e 256M -f 4 -n 200 -w 20 ;;
    device_all_reduce) bench 180 device_all_reduce device_all_reduce -b 1K -e 1M -f 2 -n 1000 -w 20 --world 8 ;;
    # Above 1 MiB the kernels run in chunks of the window region; a larger region (fewer
    # launches per call) is the second run.
    device_all_reduce_bw)
      bench 240 device_all_reduce_bw device_all_reduce -b 64M -e 1G -f 4 -n 10 -w 2 --world 8 &&
        FERROCOMM_DEVICE_ONESHOT_MAX=16M bench 240 device_all_reduce_bw16m device_all_reduce -b 64M -e 1G -f 4 -n 10 -w 2 --world 8 ;;
    *) echo "unknown step $step"; false ;;
  esac || { echo "step $step failed"; status=1; }
done
echo "gpu suite exit status $status"
exit $status
RUN
chmod +x .gpu-bundle/run.sh
du -sh .gpu-bundle
