#!/usr/bin/env bash
# ferrocomm against itself: the ferrocomm-bench of two revisions, run in interleaved pairs
# (old, new, old, new, ...) so that the drift of a shared machine hits both alike, and the
# median new/old time ratio per op and size. For changes that must not cost speed (moves,
# refactors). Usage:
#   scripts/compare_revisions.sh OLD NEW [ROUNDS] [WORLD]
# Builds each revision's release binary (scripts/revision_bench.sh), writes JSON under
# target/revisions/runs/ and prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
old=$(git rev-parse --short "$1") new=$(git rev-parse --short "$2")
rounds=${3:-5} world=${4:-2}
base=target/revisions
for rev in "$old" "$new"; do scripts/revision_bench.sh "$rev" >/dev/null; done
runs="$base/runs" && rm -rf "$runs" && mkdir -p "$runs"
# op, sizes: small messages for latency, one large one for bandwidth.
sweeps=("all_reduce 8 65536 8 20000 1000" "all_reduce 4194304 4194304 2 50 5"
        "all_gather 8 65536 8 20000 1000" "all_to_all 8 65536 8 20000 1000"
        "broadcast 8 65536 8 20000 1000" "reduce_scatter 64 65536 8 20000 1000")
for r in $(seq "$rounds"); do
  for s in "${sweeps[@]}"; do
    read -r op lo hi f it wu <<<"$s"
    for rev in "$old" "$new"; do
      "$base/bin-$rev" "$op" -b "$lo" -e "$hi" -f "$f" -n "$it" -w "$wu" --world "$world" \
        --json "$runs/$rev-$op-$lo-r$r.json" >/dev/null
    done
  done
done
python3 - "$runs" "$old" "$new" "$rounds" <<'EOF'
import glob, json, statistics, sys
runs, old, new, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def rows(path):
    d = json.load(open(path))
    return {(d["op"], r["bytes"]): r["time_us"] for r in d["rows"]}
pairs = {}
for r in range(1, rounds + 1):
    for f in glob.glob(f"{runs}/{old}-*-r{r}.json"):
        a, b = rows(f), rows(f.replace(f"/{old}-", f"/{new}-"))
        for k in a:
            pairs.setdefault(k, []).append((a[k], b[k]))
print(f"| op | bytes | {old} µs (median) | {new} µs (median) | median ratio new/old |")
print("|---|---|---|---|---|")
worst = (0, None)
for (op, size), p in sorted(pairs.items()):
    ratio = statistics.median(n / o for o, n in p)
    worst = max(worst, (ratio, f"{op} {size} B"))
    print(f"| {op} | {size} | {statistics.median(o for o, _ in p):.2f} | "
          f"{statistics.median(n for _, n in p):.2f} | {ratio:.3f} |")
print(f"\nworst median ratio: {worst[0]:.3f} ({worst[1]}), {rounds} interleaved rounds")
EOF
