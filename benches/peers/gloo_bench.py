"""Gloo peer for ferrocomm-bench: times torch.distributed all_reduce / all_gather /
all_to_all on the gloo backend (f32), with ferrocomm-bench's size conventions, warm-up and
timing (the slowest rank's mean time per iteration), and writes the same JSON.

    torchrun --standalone --nproc-per-node N gloo_bench.py OP MIN MAX FACTOR ITERS WARMUP OUT.json
"""
import json
import sys
import time

import torch
import torch.distributed as dist


def bus_factor(op, n):
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def main():
    op, lo, hi, factor, iters, warmup, out = sys.argv[1:8]
    lo, hi, factor, iters, warmup = int(lo), int(hi), int(factor), int(iters), int(warmup)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    size = lo
    while size <= hi:
        count = size // 4 // (1 if op == "all_reduce" else n)
        if count > 0:
            a = torch.ones(count if op != "all_to_all" else count * n)
            b = torch.empty(count * n)
            outs = list(b.chunk(n)) if op == "all_gather" else None

            def step():
                if op == "all_reduce":
                    dist.all_reduce(a)
                elif op == "all_gather":
                    dist.all_gather(outs, a)
                else:
                    dist.all_to_all_single(b, a)

            for _ in range(warmup):
                step()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            secs = t.item()
            algbw = size / secs / 1e9
            rows.append({"bytes": size, "count": count, "time_us": secs * 1e6, "algbw": algbw,
                         "busbw": algbw * bus_factor(op, n), "wrong": 0})
            if rank == 0:
                print(f"{size:>12} {count:>13} {secs * 1e6:>12.2f} {algbw:>6.2f}", flush=True)
        size *= factor
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"tool": "gloo", "backend": "gloo", "op": op, "world": n, "dtype": "f32",
                       "redop": "sum", "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
