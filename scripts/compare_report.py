"""Turns the output of scripts/cpu_compare.sh into the collectives section of docs/results/cpu.md
(between the markers below, replaced on every run), which shows one plot per transport
(`ferrocomm-bench plot` draws them from the same JSON, beside CPU_MD).

    compare_report.py OUT_DIR CPU_MD COMMIT COMMAND

OUT_DIR holds one folder of JSON per transport (TOOL-OP-N-rREP[-PART].json: a tool's runs of one
op at N processes in repetition REP, in parts where the tool took one launch per sweep),
notes.txt (how each tool ran, "transport|tool|text" per line) and failures.txt.
"""
import datetime
import glob
import json
import os
import platform
import re
import subprocess
import sys
from collections import defaultdict

BEGIN, END = "<!-- collectives:begin -->", "<!-- collectives:end -->"
TRANSPORTS = ("shm", "tcp-loopback", "tcp-veth")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
PEERS = ("mpich", "openmpi", "gloo")
NAMES = {"ferrocomm": "ferrocomm", "mpich": "MPICH", "openmpi": "Open MPI", "gloo": "Gloo",
         "ferrocommagain": "ferrocomm (second run)"}
# ferrocomm runs twice in each repetition, before the peers and after them. Its time in the
# repetition is the geometric mean of the two ("ferrocomm"); the runs themselves are kept as
# FIRST and AGAIN, whose ratio is the noise floor.
FIRST, AGAIN = "ferrocommfirst", "ferrocommagain"
FILE = re.compile(r"(?P<tool>[a-z]+)-(?P<op>[a-z_]+)-(?P<n>\d+)-r(?P<rep>\d+)(?:-\d+)?\.json")


def image(transport):
    return "cpu-collectives.png" if transport == "shm" else f"cpu-collectives-{transport}.png"


def load(d):
    """runs[transport][(op, n)][tool][rep][bytes] = row."""
    runs = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(dict))))
    for t in TRANSPORTS:
        for path in glob.glob(os.path.join(d, t, "*.json")):
            m = FILE.fullmatch(os.path.basename(path))
            if not m:
                continue
            with open(path) as f:
                rows = json.load(f)["rows"]
            for r in rows:
                runs[t][(m["op"], int(m["n"]))][m["tool"]][int(m["rep"])][r["bytes"]] = r
    for t in runs:
        for tools in runs[t].values():
            if AGAIN in tools and "ferrocomm" in tools:
                tools[FIRST] = tools["ferrocomm"]
                tools["ferrocomm"] = bracketed(tools[FIRST], tools[AGAIN])
    return runs


def bracketed(first, again):
    """ferrocomm's rows per repetition from its two runs there, one before the peers and one
    after: the geometric mean of the two times (and bus bandwidths), so that neither a drift
    across the repetition nor the first place in it counts against ferrocomm or for it. A
    size with one run keeps that run."""
    out = defaultdict(dict)
    for rep, rows in first.items():
        for b, r in rows.items():
            a = again.get(rep, {}).get(b)
            out[rep][b] = r if a is None else {
                **r,
                "time_us": (r["time_us"] * a["time_us"]) ** 0.5,
                "busbw": (r["busbw"] * a["busbw"]) ** 0.5,
            }
    return out


def best(reps, b):
    """The fastest of a tool's repetitions at `b` bytes, or None."""
    rows = [rows[b] for rows in reps.values() if b in rows]
    return min(rows, key=lambda r: r["time_us"]) if rows else None


def paired(tools, b, peers=PEERS):
    """ferrocomm's time / the fastest peer's time of the same repetition, for every repetition
    where both ran: each pair was measured back to back, so it shares the machine's phase (a
    shared VM drifts between fast and slow phases longer than one sweep)."""
    out = []
    for rep, rows in tools.get("ferrocomm", {}).items():
        times = [tools[p][rep][b]["time_us"] for p in peers if b in tools.get(p, {}).get(rep, {})]
        if b in rows and times:
            out.append(rows[b]["time_us"] / min(times))
    return sorted(out)


def against_itself(tools, b):
    """ferrocomm's first run / its second run of the same repetition at `b` bytes, for every
    repetition with both: how far one build moves against itself across the time the peers
    took between the two."""
    first, again = tools.get(FIRST, {}), tools.get(AGAIN, {})
    return sorted(rows[b]["time_us"] / again[rep][b]["time_us"]
                  for rep, rows in first.items() if b in rows and b in again.get(rep, {}))


def spread(ratios):
    """The largest factor by which one build's runs differed (a ratio or its inverse)."""
    return max(max(r, 1 / r) for r in ratios)


def earlier_goals(tools):
    """The goals of the first comparison: shm, 2 processes, all_reduce against MPICH."""
    sizes = {b for rows in tools.get("ferrocomm", {}).values() for b in rows if b <= 65536}
    small = {b: median(paired(tools, b, ("mpich",))) for b in sizes if paired(tools, b, ("mpich",))}
    big = paired(tools, 64 << 20, ("mpich",))
    lines = ["Earlier goals (shm, 2 processes, all_reduce, paired against MPICH):", ""]
    if small:
        worst = max(small, key=small.get)
        lines.append(f"- latency, 8 B–64 KiB: worst ratio {small[worst]:.2f} at {worst} B (goal ≤ 1.0): "
                     f"{'met' if small[worst] <= 1.0 else 'NOT met'}.")
    else:
        lines.append("- latency, 8 B–64 KiB: no paired rows.")
    if big:
        bw = 1 / median(big)  # same bytes: the busbw ratio is the inverse of the time ratio
        lines.append(f"- bandwidth, 64 MiB: busbw ratio {bw:.2f} (goal ≥ 0.9): {'met' if bw >= 0.9 else 'NOT met'}.")
    else:
        lines.append("- bandwidth, 64 MiB: not run.")
    return lines


def median(v):
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def read_notes(d):
    notes = defaultdict(dict)
    path = os.path.join(d, "notes.txt")
    for line in open(path).read().splitlines() if os.path.exists(path) else []:
        t, key, text = line.split("|", 2)
        notes[t][key] = text
    return notes


def sweep_text(spec):
    """"8:65536:2:2000:100 ..." -> "8 B–64 KiB ×2: 2000 (+100 warm-up); ..."."""
    parts = []
    for s in spec.split():
        lo, hi, f, it, wu = (int(x) for x in s.split(":"))
        parts.append(f"{size(lo)}–{size(hi)} ×{f}: {it} (+{wu} warm-up)")
    return "; ".join(parts)


def size(b):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def header(notes, transports, commit, command):
    """Machine, method, iterations, and how each tool ran."""
    cores = os.cpu_count()
    lines = [
        "## Collectives against MPICH, Open MPI and Gloo, over shared memory and TCP (issue: ferrocomm-bench)", "",
        f"- Machine: {cpu_model()}, {cores} cores, Linux {platform.release()}; no GPU.",
        f"- Date: {datetime.date.today()}. Commit: `{commit}`. Command: `{command}`"
        + (" (as root, for the namespaces)." if "tcp-veth" in transports else "."),
        "- Every op of ferrocomm-bench that the peers have, f32, sum, root 0; sizes as nccl-tests count them (the",
        "  per-rank buffer of all_reduce, broadcast and send_recv, all ranks' blocks together for all_gather,",
        "  reduce_scatter and all_to_all). Time = the slowest rank's mean per call; busbw uses the nccl-tests",
        "  factors. The tables show each tool's best repetition. Calls run back to back with no barrier between",
        "  them, as in nccl-tests: where a library lets a rank leave before the others have the data (an MPI",
        "  broadcast of a small message returns at the root once sent, eagerly), consecutive calls overlap and",
        "  the time per call is a throughput rather than a latency.",
        "- Buffers start on a page in both benchmarks (mpi_bench: one malloc of the largest size per buffer,",
        "  which glibc maps afresh; ferrocomm-bench: a page-aligned buffer per size), so a copy from one into",
        "  the other is aligned alike for every library (section \"Buffers on a page in the bench\").",
        "- Before its first size every tool settles: small all_reduces until rank 0 has seen 1 s pass where ranks",
        "  outnumber the cores (0.3 s elsewhere), so that no tool is timed while the scheduler still runs three",
        "  ranks on one core (section \"Ranks placed three to one\").",
        f"- Repetitions: {notes['all'].get('reps', '?')}. Each runs every tool of a transport back to back for one op and",
        "  world size, ferrocomm twice: first and again after the peers. ferrocomm's time in a repetition is",
        "  the geometric mean of its two runs, which bracket the peers', so that neither a drift across the",
        "  repetition nor the first place in it counts for or against any tool. \"paired\" = the median over",
        "  repetitions of that time / the fastest peer's time in the same repetition (min–max in brackets):",
        "  the goal uses it, since a shared VM drifts between fast and slow phases that a comparison of bests",
        "  can straddle. Below 1 ferrocomm is faster.",
        "- Noise floor: \"ferrocomm / itself\" = ferrocomm's first run / its second in the same repetition",
        "  (median [min–max]). Its spread, the larger of a ratio and its inverse, is how far this machine",
        "  moved one build against itself across the time a peer comparison spans; the goal table counts the",
        "  rows lost by more than that. The plots show each tool's fastest run per size, ferrocomm's first runs.",
        "- Transports: **shm** = each library's default between ranks of one host (shared memory; Gloo has none",
        "  and appears only under TCP); **tcp-loopback** = every link TCP over `lo`; **tcp-veth** = every link TCP,",
        "  half the ranks in each of two network namespaces (ranks 0..N/2-1 in the first, for every tool) joined",
        "  by a veth pair.",
    ]
    if "link" in notes["tcp-veth"]:
        lines.append(f"- tcp-veth link: {notes['tcp-veth']['link']}.")
    if "all" in notes["tcp-veth"]:
        lines.append(f"- tcp-veth: {notes['tcp-veth']['all']}.")
    lines += ["", "Iterations per size:", "", "| transport | 2 processes | 4 processes |", "|---|---|---|"]
    for t in transports:
        lines.append(f"| {t} | {sweep_text(notes[t].get('sweeps-2', ''))} | {sweep_text(notes[t].get('sweeps-4', ''))} |")
    lines += ["", notes["all"]["caps"] + ".", ""] if "caps" in notes["all"] else [""]

    lines += ["### How each tool ran", "", "| transport | tool | command and settings |", "|---|---|---|"]
    for t in TRANSPORTS:
        for tool in ("ferrocomm",) + PEERS:
            if tool in notes[t]:
                lines.append(f"| {t} | {NAMES[tool]} | {notes[t][tool]} |")
    if "all" in notes["bind"]:
        lines += ["", notes["bind"]["all"] + "."]
    if 4 > cores:
        lines += ["", f"With more ranks than cores (4 processes on this machine's {cores}) every tool is time-sliced, and",
                  "each ran with its setting for that, where it has one:", ""]
    else:
        lines += ["", f"No run had more ranks than this machine's {cores} cores; with more, each tool would have run with:", ""]
    return lines + [f"- {NAMES[tool]}: {text}" for tool, text in notes["over"].items()]


def failures(d):
    """Runs that failed: those whose rows are missing, and those that wrote their rows first."""
    path = os.path.join(d, "failures.txt")
    failed = [l.split("|") for l in open(path).read().splitlines()] if os.path.exists(path) else []
    lines = []
    lost = [f for f in failed if f[5] != "kept"]
    if lost:
        lines += ["", "Runs that failed, their rows missing (logs in the run's target/compare/logs/):", ""]
        lines += [f"- {t} {NAMES.get(tool, tool)} {op}, {n} processes, repetition {rep}" for t, tool, op, n, rep, _ in lost]
    kept = defaultdict(list)
    for t, tool, op, n, rep, k in failed:
        if k == "kept":
            kept[(t, tool)].append(f"{op} n={n} r{rep}")
    if kept:
        lines += ["", "Runs that exited with an error after writing their rows, which are kept (mpi_bench leaves with",
                  "status 3 after 5 s in MPI_Finalize, which MPICH over UCX's TCP transport sometimes never returns",
                  "from; other causes are in the run's logs):", ""]
        lines += [f"- {t} {NAMES.get(tool, tool)}: {len(v)} ({', '.join(v)})" for (t, tool), v in kept.items()]
    return lines


def results(runs, transports):
    """The goal per transport (worst paired ratio, rows lost) and every table with its plot."""
    summary = ["### Goal: ferrocomm / best peer ≤ 1.0 in every row (paired)", "",
               "| transport | worst paired ratio | its row | rows lost / rows | lost beyond ferrocomm's own spread | ferrocomm against itself: rows > 1.0, worst spread |",
               "|---|---:|---|---:|---:|---|"]
    lost_lines, clear_lines, tables = [], [], []
    for t in transports:
        worst, lost, total, clear, selfs = None, [], 0, [], []
        tables += [f"### {t}", ""]
        for op in OPS:
            for n in (2, 4):
                tools = runs[t].get((op, n))
                if not tools or "ferrocomm" not in tools:
                    continue
                present = [p for p in PEERS if p in tools]
                cols = [NAMES[p] + " us" for p in present]
                tables += [f"#### {t}: {op}, {n} processes", "",
                           "| bytes | ferrocomm us | " + " | ".join(cols) + " | best peer | paired / best peer | ferrocomm / itself | busbw ferrocomm | busbw best peer |",
                           "|---:|---:|" + "---:|" * len(cols) + "---|---:|---:|---:|---:|"]
                for b in sorted({b for rows in tools["ferrocomm"].values() for b in rows}):
                    f = best(tools["ferrocomm"], b)
                    theirs = {p: best(tools[p], b) for p in present}
                    top = min((p for p in present if theirs[p]), key=lambda p: theirs[p]["time_us"], default=None)
                    pr, aa = paired(tools, b), against_itself(tools, b)
                    noise = spread(aa) if aa else None
                    if aa:
                        selfs.append((median(aa), noise, op, n, b))
                    if pr:
                        total += 1
                        m = median(pr)
                        if worst is None or m > worst[0]:
                            worst = (m, op, n, b, top)
                        if m > 1.0:
                            lost.append((op, n, b, m))
                            if noise is not None and m > noise:
                                clear.append((op, n, b, m))
                    cells = [f'{theirs[p]["time_us"]:.2f}' if theirs[p] else "-" for p in present]
                    pt = f"{median(pr):.2f} [{pr[0]:.2f}–{pr[-1]:.2f}]" if pr else "-"
                    st = f"{median(aa):.2f} [{aa[0]:.2f}–{aa[-1]:.2f}]" if aa else "-"
                    bb = f'{theirs[top]["busbw"]:.2f}' if top else "-"
                    tables.append(f'| {b} | {f["time_us"]:.2f} | ' + " | ".join(cells) +
                                  f' | {NAMES[top] if top else "-"} | {pt} | {st} | {f["busbw"]:.2f} | {bb} |')
                tables.append("")
        tables += [f"![{t}: latency and bus bandwidth](./{image(t)})", ""]
        if selfs:
            w = max(selfs, key=lambda x: x[1])
            itself = (f"{sum(1 for x in selfs if x[0] > 1.0)} / {len(selfs)}, {w[1]:.2f}"
                      f" ({w[2]}, {w[3]} processes, {w[4]} B)")
        else:
            itself = "not run"
        if worst:
            m, op, n, b, top = worst
            summary.append(f"| {t} | {m:.2f} ({'met' if m <= 1.0 else 'NOT met'}) | {op}, {n} processes, {b} B"
                           f" (best peer {NAMES[top]}) | {len(lost)} / {total} | {len(clear)} | {itself} |")
        else:
            summary.append(f"| {t} | - | no paired rows | 0 / 0 | - | {itself} |")
        lost_lines.append(f"- {t}: " + by_op(lost))
        clear_lines.append(f"- {t}: " + by_op(clear))
    summary += ["", "Rows where ferrocomm loses (paired ratio > 1.0):", ""] + lost_lines + [""]
    summary += ["Of those, the rows lost by more than ferrocomm's own spread at that row (its first run against",
                "its second in every repetition, the larger of each ratio and its inverse; a loss within it is",
                "one this machine cannot tell from ferrocomm against itself):", ""] + clear_lines + [""]
    return summary + earlier_goals(runs["shm"].get(("all_reduce", 2), {})) + [""], tables


def by_op(rows):
    """"op n=N: size ratio, ...; ..." for (op, n, bytes, ratio) rows."""
    by = defaultdict(list)
    for op, n, b, m in rows:
        by[(op, n)].append(f"{size(b)} {m:.2f}")
    return "; ".join(f"{op} n={n}: {', '.join(v)}" for (op, n), v in by.items()) or "none"


def main():
    d, md, commit, command = sys.argv[1:5]
    runs, notes = load(d), read_notes(d)
    transports = [t for t in TRANSPORTS if runs.get(t)]
    summary, tables = results(runs, transports)
    lines = [BEGIN] + header(notes, transports, commit, command) + failures(d) + [""] + summary + tables
    lines += ["Plots: drawn by `ferrocomm-bench plot` from the same JSON (each size's fastest run per tool), one",
              "per transport.", "", END]
    section = "\n".join(lines)

    text = open(md).read() if os.path.exists(md) else "# CPU results\n"
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    open(md, "w").write(text)


if __name__ == "__main__":
    main()
