#!/usr/bin/env bash
# Coverage-guided fuzzing of the store protocol on the stable toolchain: builds
# fuzz/fuzz_targets/store_frames.rs with the sanitizer-coverage passes cargo-fuzz uses (no
# address sanitizer, which needs nightly) and runs libFuzzer for SECONDS (default 60).
# With nightly and cargo-fuzz installed, `cargo fuzz run store_frames` works as well.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-60}
target=x86_64-unknown-linux-gnu
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
cargo build --release --quiet --target "$target" --target-dir target/cov
mkdir -p corpus/store_frames
"target/cov/$target/release/store_frames" corpus/store_frames -max_total_time="$seconds" \
  -rss_limit_mb=512 -max_len=4096
