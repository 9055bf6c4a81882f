"""Turns the JSON of scripts/cpu_compare.sh into the collectives section of
docs/results/cpu.md (between the markers below, replaced on every run), which shows the plot
PLOT_PNG (`ferrocomm-bench plot` draws it from the same JSON).

    compare_report.py JSON_DIR CPU_MD PLOT_PNG COMMIT COMMAND
"""
import datetime
import glob
import json
import os
import platform
import subprocess
import sys

BEGIN, END = "<!-- collectives:begin -->", "<!-- collectives:end -->"


def load(d, tool, op, n):
    """Rows by size; of the repeated runs, each size keeps its fastest mean."""
    rows = {}
    for path in glob.glob(os.path.join(d, f"{tool}-{op}-{n}-*-r*.json")):
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if r["bytes"] not in rows or r["time_us"] < rows[r["bytes"]]["time_us"]:
                    rows[r["bytes"]] = r
    return rows


def paired_ratios(d, op, n):
    """ferrocomm / MPICH time per size and repetition, each pair measured back to back. This VM
    drifts between fast and slow phases that last longer than one tool's sweep, so a ratio of
    two bests can compare a fast phase with a slow one; a pair shares its phase."""
    ratios = {}
    for path in glob.glob(os.path.join(d, f"ferrocomm-{op}-{n}-*-r*.json")):
        peer = path.replace(f"{os.sep}ferrocomm-", f"{os.sep}mpich-")
        if not os.path.exists(peer):
            continue
        with open(path) as f, open(peer) as g:
            mine = {r["bytes"]: r["time_us"] for r in json.load(f)["rows"]}
            theirs = {r["bytes"]: r["time_us"] for r in json.load(g)["rows"]}
        for b in mine.keys() & theirs.keys():
            ratios.setdefault(b, []).append(mine[b] / theirs[b])
    return {b: sorted(v) for b, v in ratios.items()}


def median(v):
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def main():
    d, md, png, commit, command = sys.argv[1:6]
    lines = [BEGIN, "## Collectives against MPICH and Gloo (issue: ferrocomm-bench)", ""]
    lines += [
        f"- Machine: {cpu_model()}, {os.cpu_count()} cores, Linux {platform.release()}; no GPU.",
        f"- Date: {datetime.date.today()}. Commit: `{commit}`. Command: `{command}`.",
        "- f32, sum. Time = the slowest rank's mean per call, best of the interleaved runs per tool",
        "  (5 at 2 processes, 3 at 4); busbw uses the nccl-tests factors. \"paired\" = the median over runs",
        "  of ferrocomm's time / MPICH's time measured right after it (min–max in brackets): the goals use it,",
        "  since this VM drifts between fast and slow phases that a best-of comparison can straddle.",
        "  Iterations (up to as many processes as cores): 8 B–64 KiB 2000 (Gloo 200), 256 KiB–64 MiB 20;",
        "  with more processes than cores: 50 and 5, and every tool is time-sliced. Ratios are ferrocomm / peer:",
        "  time ratio < 1 and busbw ratio > 1 mean ferrocomm is faster.",
        "",
    ]
    header_end = len(lines)
    verdicts = []
    for op in ("all_reduce", "all_gather", "all_to_all"):
        for n in (2, 4):
            fc, mp, gl = (load(d, t, op, n) for t in ("ferrocomm", "mpich", "gloo"))
            if not fc:
                continue
            lines += [f"### {op}, {n} processes", "",
                      "| bytes | ferrocomm us | MPICH us | Gloo us | time / MPICH | paired | busbw ferrocomm | busbw MPICH | busbw / MPICH |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            paired = paired_ratios(d, op, n)
            for b in sorted(fc):
                f, m, g = fc[b], mp.get(b), gl.get(b)
                tr = f["time_us"] / m["time_us"] if m else float("nan")
                br = f["busbw"] / m["busbw"] if m and m["busbw"] > 0 else float("nan")
                gt = f'{g["time_us"]:.1f}' if g else "-"
                mt = f'{m["time_us"]:.2f}' if m else "-"
                mb = f'{m["busbw"]:.2f}' if m else "-"
                pr = paired.get(b)
                pt = f"{median(pr):.2f} [{pr[0]:.2f}–{pr[-1]:.2f}]" if pr else "-"
                lines.append(f'| {b} | {f["time_us"]:.2f} | {mt} | {gt} | {tr:.2f} | {pt} | {f["busbw"]:.2f} | {mb} | {br:.2f} |')
            lines.append("")
            if op == "all_reduce" and n == 2 and mp:
                small = {b: median(paired[b]) for b in paired if b <= 65536}
                worst = max(small, key=small.get) if small else None
                big = paired.get(64 << 20)
                bw = 1 / median(big) if big else float("nan")  # same bytes: busbw ratio = 1 / time ratio
                if worst is None:
                    verdicts.append("- all_reduce latency, 2 processes: no paired runs")
                else:
                    verdicts.append(f"- all_reduce latency, 2 processes, 8 B–64 KiB: worst paired time ratio to MPICH "
                                    f"{small[worst]:.2f} at {worst} B (goal ≤ 1.0): "
                                    f"{'met' if small[worst] <= 1.0 else 'NOT met'}.")
                verdicts.append(f"- all_reduce bandwidth, 2 processes, 64 MiB: paired busbw ratio to MPICH "
                                f"{bw:.2f} (goal ≥ 0.9): {'met' if bw >= 0.9 else 'NOT met'}.")
    lines[header_end:header_end] = ["Goals:", ""] + verdicts + [""]
    lines += [f"![latency and bus bandwidth](./{os.path.basename(png)})", "",
              "Drawn by `ferrocomm-bench plot` from the same JSON (each size's fastest run per tool).", "", END]
    section = "\n".join(lines)

    text = open(md).read() if os.path.exists(md) else "# CPU results\n"
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    open(md, "w").write(text)


if __name__ == "__main__":
    main()
