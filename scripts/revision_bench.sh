#!/usr/bin/env bash
# Prints the path of a release ferrocomm-bench built from revision REV, building it first in a
# worktree under target/revisions/ (kept between runs) if it is not there yet. Usage:
#   scripts/revision_bench.sh REV
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$(git rev-parse --short "$1")
base=target/revisions
mkdir -p "$base"
if [ ! -x "$base/bin-$rev" ]; then
  [ -d "$base/src-$rev" ] || git worktree add --detach "$base/src-$rev" "$rev" >/dev/null
  # ferrocomm-bench became a package of its own (crates/ferrocomm-bench); before, it was a
  # binary of the library's package. Its command line is the same in both.
  if [ -f "$base/src-$rev/crates/ferrocomm-bench/Cargo.toml" ]; then which=(-p ferrocomm-bench); else which=(--bin ferrocomm-bench); fi
  CARGO_TARGET_DIR="$PWD/$base/target" cargo build --release --quiet "${which[@]}" \
    --manifest-path "$base/src-$rev/Cargo.toml" >&2
  cp "$base/target/release/ferrocomm-bench" "$base/bin-$rev"
fi
echo "$PWD/$base/bin-$rev"
