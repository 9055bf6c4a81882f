#!/usr/bin/env bash
# The instructions one call of each op executes, counted by callgrind for each revision given:
# a measure of the library's own cost per call that, unlike a time on a shared machine, does
# not drift. Each count is the difference of two runs of one size, of N and 3N calls, divided
# by 2N, so that start-up and set-up cancel; repeated counts agree within a few instructions.
#   -w 1 (default): a world of one, all of the library's layers and no peer's timing.
#   -w 2: two processes, the busier rank's instructions outside the functions a shared-memory
#         round waits in (their count depends on the peer's timing); send_recv waits inside
#         the engine's sweep, which also does its work, so it has no such count ("-").
# Needs valgrind (`apt-get install valgrind`). Usage:
#   scripts/call_instructions.sh [-b BYTES] [-n N] [-w 1|2] REV...
set -euo pipefail
cd "$(dirname "$0")/.."
bytes=64 n=10000 world=1
while getopts "b:n:w:" o; do
  case $o in b) bytes=$OPTARG ;; n) n=$OPTARG ;; w) world=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] && [[ $world == [12] ]] || { echo "usage: $0 [-b BYTES] [-n N] [-w 1|2] REV..." >&2; exit 2; }
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
ops=(all_reduce all_gather reduce_scatter all_to_all broadcast send_recv)
# The functions a shared-memory round waits in.
waits='await_round|await_peer|Pacer::stalled|back_off|sched_yield'
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Instructions of the busiest process of one run (the bench's rank, or its busier rank; the
# launcher is idle), without the wait functions' own at world 2.
count() {
  valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$out/cg.%p" \
    "$1" "$2" --world "$world" --bind-to core -b "$bytes" -e "$bytes" -n "$3" -w 10 --settle-ms 0 \
    >/dev/null 2>"$out/log"
  for f in "$out"/cg.*; do
    callgrind_annotate --inclusive=no "$f" 2>/dev/null | awk -v world="$world" -v waits="$waits" '
      /PROGRAM TOTALS/ { gsub(",", "", $1); total = $1 }
      world == 2 && $0 ~ waits && $1 ~ /^[0-9,]+$/ { v = $1; gsub(",", "", v); wait += v }
      END { print total - wait }'
  done | sort -n | tail -1
  rm -f "$out"/cg.*
}
printf "| op (%s B, world %s) |" "$bytes" "$world"
for rev in "$@"; do printf " %s |" "$(git rev-parse --short "$rev")"; done
printf "\n|---|"; for _ in "$@"; do printf -- "---:|"; done; echo
bins=()
for rev in "$@"; do bins+=("$(scripts/revision_bench.sh "$rev")"); done
for op in "${ops[@]}"; do
  printf "| %s |" "$op"
  for bin in "${bins[@]}"; do
    if [ "$world" = 2 ] && [ "$op" = send_recv ]; then printf " - |"; continue; fi
    a=$(count "$bin" "$op" "$n") b=$(count "$bin" "$op" $((3 * n)))
    printf " %d |" $(((b - a) / (2 * n)))
  done
  echo
done
