#!/usr/bin/env bash
# The cost of sealed TCP links (FERROCOMM_ENCRYPT): ferrocomm-bench over the TCP transport,
# 2 processes on this host, each op swept with sealing off and on back to back, three
# interleaved repetitions (this VM drifts between fast and slow phases; a pair shares its
# phase). Writes the "Sealed TCP links" section of docs/results/cpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p ferrocomm-bench
bench=target/release/ferrocomm-bench
out=target/encrypt-cost
rm -rf "$out"
mkdir -p "$out"
reps=${REPS:-3}
for op in all_reduce all_gather send_recv; do
  for rep in $(seq "$reps"); do
    for mode in off on; do
      echo "== $op rep $rep encrypt=$mode"
      FERROCOMM_TRANSPORT=tcp FERROCOMM_ENCRYPT=$mode "$bench" "$op" -b 8 -e 64M -f 8 -n 50 -w 5 --world 2 \
        --json "$out/$op-$mode-r$rep.json" >/dev/null
    done
  done
done
python3 - "$out" docs/results/cpu.md "$(git rev-parse --short HEAD)" "$reps" <<'PY'
import glob, json, os, platform, statistics, subprocess, sys, datetime
d, md, commit, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
BEGIN, END = "<!-- encrypt:begin -->", "<!-- encrypt:end -->"
def rows(path):
    with open(path) as f:
        return {r["bytes"]: r["time_us"] for r in json.load(f)["rows"]}
def human(b):
    for unit, s in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= s:
            return f"{b // s} {unit}"
    return f"{b} B"
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
lines = [BEGIN, "", "## Sealed TCP links (FERROCOMM_ENCRYPT)", "",
    f"Machine: {cpu}, {os.cpu_count()} cores, Linux {platform.release()}. "
    f"Date {datetime.date.today()}, commit `{commit}`, command `./scripts/encrypt_cost.sh`. "
    "Two processes on this host over the TCP transport (loopback), sealing off and on run back to back, "
    f"{reps} interleaved repetitions; each cell is the median over repetitions of the time per call (µs), "
    "and the ratio is the median of the paired ratios (on / off).", ""]
for op in ("all_reduce", "all_gather", "send_recv"):
    pairs = []
    for r in range(1, reps + 1):
        a, b = f"{d}/{op}-off-r{r}.json", f"{d}/{op}-on-r{r}.json"
        if os.path.exists(a) and os.path.exists(b):
            pairs.append((rows(a), rows(b)))
    if not pairs:
        continue
    lines += [f"### {op}", "", "| size | off (µs) | on (µs) | on / off | on, GB/s (algorithm) |", "|---:|---:|---:|---:|---:|"]
    for size in sorted(pairs[0][0]):
        off = statistics.median(p[0][size] for p in pairs if size in p[0] and size in p[1])
        on = statistics.median(p[1][size] for p in pairs if size in p[0] and size in p[1])
        ratio = statistics.median(p[1][size] / p[0][size] for p in pairs if size in p[0] and size in p[1])
        lines.append(f"| {human(size)} | {off:.1f} | {on:.1f} | {ratio:.2f} | {size / on / 1e3:.2f} |")
    lines.append("")
lines.append(END)
text = open(md).read()
block = "\n".join(lines)
if BEGIN in text:
    text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
else:
    text = text.rstrip("\n") + "\n\n" + block + "\n"
open(md, "w").write(text)
print(block)
PY
