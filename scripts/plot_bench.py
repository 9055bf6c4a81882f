"""Plots benchmark JSON files (ferrocomm-bench, the MPICH and Gloo peers): latency and bus
bandwidth against message size, one line per tool / op / world size.

    python3 scripts/plot_bench.py -o out.png a.json b.json ...
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    args = sys.argv[1:]
    if len(args) < 3 or args[0] != "-o":
        sys.exit("usage: plot_bench.py -o out.png file.json...")
    out, files = args[1], args[2:]
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for path in files:
        with open(path) as f:
            d = json.load(f)
        rows = d["rows"]
        label = f'{d["tool"]} {d["op"]} n={d["world"]}'
        x = [r["bytes"] for r in rows]
        lat.plot(x, [r["time_us"] for r in rows], marker=".", label=label)
        bw.plot(x, [r["busbw"] for r in rows], marker=".", label=label)
    for ax, title, unit in ((lat, "latency", "time (us)"), (bw, "bus bandwidth", "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    lat.set_yscale("log")
    bw.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
