#!/usr/bin/env bash
# The instructions one call of each op executes in a world of one (all of the library's layers
# and none of a peer's timing), counted by callgrind for each revision given: a measure of the
# library's own cost per call that, unlike a time on a shared machine, does not drift. Each
# count is the difference of two runs of one size, of N and 3N calls, divided by 2N, so that
# start-up and set-up cancel. Needs valgrind (`apt-get install valgrind`). Usage:
#   scripts/call_instructions.sh [-b BYTES] [-n N] REV...
set -euo pipefail
cd "$(dirname "$0")/.."
bytes=64 n=10000
while getopts "b:n:" o; do
  case $o in b) bytes=$OPTARG ;; n) n=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { echo "usage: $0 [-b BYTES] [-n N] REV..." >&2; exit 2; }
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
ops=(all_reduce all_gather reduce_scatter all_to_all broadcast send_recv)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Instructions of the busiest process of one run (the bench's rank; the launcher is idle).
count() {
  valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$out/cg.%p" \
    "$1" "$2" --world 1 -b "$bytes" -e "$bytes" -n "$3" -w 10 --settle-ms 0 >/dev/null 2>"$out/log"
  grep -o 'Collected : [0-9,]*' "$out/log" | tr -d ',' | awk '{print $3}' | sort -n | tail -1
  rm -f "$out"/cg.*
}
printf "| op (%s B, world 1) |" "$bytes"
for rev in "$@"; do printf " %s |" "$(git rev-parse --short "$rev")"; done
printf "\n|---|"; for _ in "$@"; do printf -- "---:|"; done; echo
bins=()
for rev in "$@"; do bins+=("$(scripts/revision_bench.sh "$rev")"); done
for op in "${ops[@]}"; do
  printf "| %s |" "$op"
  for bin in "${bins[@]}"; do
    a=$(count "$bin" "$op" "$n") b=$(count "$bin" "$op" $((3 * n)))
    printf " %d |" $(((b - a) / (2 * n)))
  done
  echo
done
