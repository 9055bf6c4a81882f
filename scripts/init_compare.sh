#!/usr/bin/env bash
# Communicator creation, two ferrocomm-bench binaries against each other: `ferrocomm-bench
# init` for each configuration below, old and new alternately (old, new, old, new, ...) so that
# the drift of a shared machine hits both alike; the load average before each run; then per
# configuration and binary the median over the rounds of each run's median (ready, first op)
# and of the cold and process-start figures. Usage:
#   scripts/init_compare.sh OLD_BIN NEW_BIN [ROUNDS] [OUT_DIR]
# An empty OLD_BIN runs the new binary alone. Configurations whose name is in SKIP_OLD (space
# separated) run only the new binary.
set -euo pipefail
old=$1 new=$2 rounds=${3:-3} out=${4:-target/init-compare}
mkdir -p "$out" && rm -f "$out"/*.json "$out"/load.txt
# name | ferrocomm-bench init arguments
configs=(
  "proc2-shm|--world 2 -n 10 -w 1"
  "proc8-shm|--world 8 -n 10 -w 1"
  "proc64-shm|--world 64 -n 3 -w 1"
  "proc2-tcp|--world 2 -n 10 -w 1 --transport tcp"
  "proc8-tcp|--world 8 -n 10 -w 1 --transport tcp"
  "proc64-tcp|--world 64 -n 3 -w 1 --transport tcp"
  "thr8|--world 8 --threads -n 10 -w 1"
  "thr64|--world 64 --threads -n 3 -w 1"
  "thr1024|--world 1024 --threads -n 5 -w 1"
)
for r in $(seq "$rounds"); do
  for c in "${configs[@]}"; do
    name=${c%%|*} args=${c#*|}
    for which in old new; do
      bin=$([ "$which" = old ] && echo "$old" || echo "$new")
      [ -n "$bin" ] || continue
      [ "$which" = old ] && [[ " ${SKIP_OLD:-} " == *" $name "* ]] && continue
      echo "$which $name r$r $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/load.txt"
      # shellcheck disable=SC2086
      "$bin" init $args --check --json "$out/$which-$name-r$r.json" >/dev/null
    done
  done
done
python3 - "$out" <<'EOF'
import json, os, statistics as st, sys
out = sys.argv[1]
runs = {}
for f in sorted(os.listdir(out)):
    if not f.endswith(".json"):
        continue
    which, rest = f[:-5].split("-", 1)
    name = rest.rsplit("-r", 1)[0]
    j = json.load(open(os.path.join(out, f)))
    assert all(r["wrong"] == 0 for r in j["rows"]), f
    runs.setdefault((name, which), []).append(j)
def med(v):
    v = [x for x in v if x is not None]
    return st.median(v) if v else float("nan")
print("| configuration | binary | runs | ready ms (median of run medians) [min-max of rows] | first op ms | first p2p ms | cold ready ms | process start ms |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for (name, which), js in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] != "old")):
    rows = [r for j in js for r in j["rows"]]
    cold = [j["cold"]["ready_after_last_ms"] if j.get("cold") else None for j in js]
    start = [j.get("process_start_ms") for j in js]
    print(f"| {name} | {which} | {len(js)} | {med([j['ready_ms']['median'] for j in js]):.2f} "
          f"[{min(r['ready_ms'] for r in rows):.2f}-{max(r['ready_ms'] for r in rows):.2f}] | "
          f"{med([j['first_op_ms']['median'] for j in js]):.2f} | "
          f"{med([j['first_p2p_ms']['median'] for j in js if 'first_p2p_ms' in j]):.2f} | {med(cold):.2f} | {med(start):.2f} |")
loads = [float(l.split()[3]) for l in open(os.path.join(out, "load.txt"))]
print(f"\n1-minute load average before the runs: min {min(loads):.2f}, median {st.median(loads):.2f}, max {max(loads):.2f}")
EOF
