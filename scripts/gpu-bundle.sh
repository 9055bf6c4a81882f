#!/usr/bin/env bash
# Builds the x86-64 bundle for a GPU machine that has no cargo and no internet: the test
# binaries with GPU tests (and the host-device suite), the fused_put_signal example and
# ferrocomm-bench, NVRTC (compressed: the library is 105 MB), plus run.sh, into .gpu-bundle/.
# NCCL is not carried: its library alone is larger than the 64 MiB a bundle may take along, so
# run.sh names the one the GPU machine's Python has (the nvidia-nccl-cu13 package, found by
# importing it: no search of the filesystem) unless FERROCOMM_NCCL_PATH is set.
# On the GPU machine: `bash .gpu-bundle/run.sh OUTDIR [STEP...]` runs the named steps (all by
# default; each ends well inside 9 minutes, so the suite can be split over calls of 10), and
# writes at most 8 files under OUTDIR: machine.txt, tests.log, bench.log, gpu-rows.md and
# status.txt. `bash .gpu-bundle/run.sh OUTDIR host_device` runs here too (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_HOME=$(scripts/cuda-toolchain.sh)
export CUDA_HOME FERROCOMM_REQUIRE_NVCC=1

rm -rf .gpu-bundle && mkdir -p .gpu-bundle/lib
cargo build --release -p ferrocomm-bench --features host-kernels
# The tests and examples without the release profile's whole-program optimisation, which
# would take minutes per binary; the bench above keeps it, since its timings are reported.
export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
cargo build --release --features host-kernels --bins --examples
cargo test --release --features host-kernels --no-run --message-format=json \
  --test gpu_windows --test gpu_nccl --test gpu_collectives --test gpu_inference --test nccl --test device_compile --test host_device --test host_device_moe 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
  while read -r name exe; do cp "$exe" ".gpu-bundle/$name"; done
cp target/release/ferrocomm-bench target/release/examples/fused_put_signal .gpu-bundle/
# The bundle travels with the working tree, 64 MiB in all: no symbols, everything compressed
# (about 45 MB, NVRTC two thirds of it); run.sh unpacks it on the GPU machine.
mkdir -p .gpu-bundle/bin
for b in ferrocomm-bench fused_put_signal gpu_windows gpu_nccl gpu_collectives gpu_inference nccl device_compile host_device host_device_moe; do
  strip ".gpu-bundle/$b"
  xz -T0 -6 -c ".gpu-bundle/$b" > ".gpu-bundle/bin/$b.xz" && rm ".gpu-bundle/$b"
done
for f in libnvrtc.so.13 libnvrtc-builtins.so.13.0; do
  xz -T0 -6 -c "$CUDA_HOME/lib/$f" > ".gpu-bundle/lib/$f.xz"
done
git rev-parse --short HEAD > .gpu-bundle/COMMIT

cat > .gpu-bundle/run.sh <<'RUN'
#!/usr/bin/env bash
# Runs the GPU suite from the bundle; results go to OUTDIR (default $OUT), at most 8 files:
# machine.txt, tests.log (every test step, appended), bench.log (every benchmark, appended),
# gpu-rows.md (the benchmark tables for docs/results/gpu.md), status.txt (one line a step).
# With step names after OUTDIR only those run:
#   tests:  device_compile nccl gpu_windows gpu_nccl gpu_collectives gpu_inference example host_device
#   bench:  device_put device_pingpong nccl_all_reduce device_all_reduce device_all_reduce_bw device_rmsnorm
# Each step is bounded by `timeout` well inside 9 minutes.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:-/tmp/ferrocomm-gpu}}
shift || true
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(device_compile nccl gpu_windows gpu_nccl gpu_collectives gpu_inference example host_device
  device_put device_pingpong nccl_all_reduce device_all_reduce device_all_reduce_bw device_rmsnorm)
mkdir -p "$out"
export FERROCOMM_REQUIRE_NVRTC=1
# The carried programs and NVRTC, unpacked once per machine and commit.
unpacked=${TMPDIR:-/tmp}/ferrocomm-bundle-$(cat "$here/COMMIT")
lib=$unpacked/lib bin=$unpacked/bin
if [[ ! -e $unpacked/done ]]; then
  mkdir -p "$lib" "$bin"
  for f in "$here"/lib/*.xz; do xz -dc "$f" > "$lib/$(basename "$f" .xz)"; done
  for f in "$here"/bin/*.xz; do xz -dc "$f" > "$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"; done
  touch "$unpacked/done"
fi
export FERROCOMM_NVRTC_PATH=${FERROCOMM_NVRTC_PATH:-$lib}
if [[ -z "${FERROCOMM_NCCL_PATH:-}" ]]; then
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
  [[ -n "$nccl" ]] && export FERROCOMM_NCCL_PATH=$nccl
fi
{ echo "commit $(cat "$here/COMMIT")"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2;
  echo "nvrtc $FERROCOMM_NVRTC_PATH"; echo "nccl ${FERROCOMM_NCCL_PATH:-not found: the nccl steps will say so}"; } | tee "$out/machine.txt"
bench() { # seconds, ferrocomm-bench arguments
  local limit=$1; shift
  { echo "## ferrocomm-bench $*"; timeout "$limit" "$bin/ferrocomm-bench" "$@" 2>&1; } | tee -a "$out/bench.log" |
    tee -a "$out/gpu-rows.md"
}
tests() { # seconds, test binary
  echo "## $2" >> "$out/tests.log"
  timeout "$1" "$bin/$2" --test-threads=1 2>&1 | tee -a "$out/tests.log" | grep -E "^test |test result|panicked"
  tail -n 40 "$out/tests.log" | grep -q "test result: ok"
}
status=0
for step in "${steps[@]}"; do
  t0=$(date +%s)
  case $step in
    device_compile|nccl|gpu_windows|gpu_nccl|gpu_collectives|gpu_inference) FERROCOMM_REQUIRE_GPU=1 tests 480 "$step" ;;
    # The host device needs no GPU: this step also proves the bundle on a machine without one.
    host_device) tests 480 host_device && tests 480 host_device_moe ;;
    example) { echo "## fused_put_signal"; timeout 60 "$bin/fused_put_signal" 2>&1; } | tee -a "$out/tests.log" ;;
    device_put) bench 240 device_put -b 64K -e 1G -f 4 -n 20 -w 5 ;;
    device_pingpong) bench 60 device_pingpong -n 10000 ;;
    nccl_all_reduce) bench 240 nccl_all_reduce -b 8 -e 256M -f 4 -n 200 -w 20 ;;
    device_all_reduce) bench 300 device_all_reduce -b 1K -e 1M -f 2 -n 1000 -w 20 --world 8 ;;
    # Above 1 MiB the kernels run in chunks of the window region; a larger region (fewer
    # launches per call) is the second run.
    device_all_reduce_bw)
      bench 240 device_all_reduce -b 64M -e 1G -f 4 -n 10 -w 2 --world 8 &&
        FERROCOMM_DEVICE_ONESHOT_MAX=16M bench 240 device_all_reduce -b 64M -e 1G -f 4 -n 10 -w 2 --world 8 ;;
    # Tensor-parallel decode and prefill shapes: fused kernels, the steps apart, NCCL + the norm.
    device_rmsnorm)
      bench 150 device_rmsnorm -d bf16 --hidden 4096 --tokens 1,8,32,128,512,2048 -n 500 -w 20 --world 8 --check &&
        bench 150 device_rmsnorm -d bf16 --hidden 7168 --tokens 1,16,128 --fp8 -n 500 -w 20 --world 8 --check ;;
    *) echo "unknown step $step"; false ;;
  esac
  rc=$?
  echo "$step rc=$rc seconds=$(( $(date +%s) - t0 ))" | tee -a "$out/status.txt"
  [[ $rc -eq 0 ]] || status=1
done
echo "gpu suite exit status $status" | tee -a "$out/status.txt"
exit $status
RUN
chmod +x .gpu-bundle/run.sh
du -sh .gpu-bundle
