"""Gloo peer for ferrocomm-bench: times torch.distributed's collectives on the gloo backend
(f32, sum) with ferrocomm-bench's size conventions (nccl-tests': bytes is the per-rank buffer of
all_reduce, broadcast and send_recv, the total of all ranks' blocks for all_gather,
reduce_scatter and all_to_all), warm-up and timing (the slowest rank's mean time per
iteration), and writes the same JSON.

    torchrun --nproc-per-node N gloo_bench.py OP OUT.json MIN:MAX:FACTOR:ITERS:WARMUP [...]

OP: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast (root 0) or send_recv (a ring:
each rank sends to the right and receives from the left, as the bench's). Several sweeps run in
one launch: starting torch costs seconds, more than many small sizes take to measure.
"""
import json
import sys
import time

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
TOTAL = ("all_gather", "reduce_scatter", "all_to_all")  # sizes that are all ranks' blocks


def bus_factor(op, n):
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    return 1.0 if op in ("broadcast", "send_recv") else (n - 1) / n


def step_for(op, count, rank, n):
    """One call of `op` on buffers of `count` elements per block."""
    a = torch.ones(count * n if op in ("reduce_scatter", "all_to_all") else count)
    b = torch.empty(count * n if op in ("all_gather", "all_to_all") else count)
    right, left = (rank + 1) % n, (rank + n - 1) % n
    if op == "all_reduce":
        return lambda: dist.all_reduce(a)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(b, a)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(b, a)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(b, a)
    if op == "broadcast":
        return lambda: dist.broadcast(a, 0)

    def ring():
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, right), dist.P2POp(dist.irecv, b, left)]):
            w.wait()

    return ring


def main():
    if len(sys.argv) < 4 or sys.argv[1] not in OPS:
        sys.exit("usage: gloo_bench.py OP OUT.json [--settle-ms=MS] MIN:MAX:FACTOR:ITERS:WARMUP [...]; OP: " + ", ".join(OPS))
    op, out = sys.argv[1:3]
    args = sys.argv[3:]
    # --settle-ms=MS: as ferrocomm-bench --settle-ms (crates/ferrocomm-bench/src/settle.rs).
    settle_ms = 0
    if args and args[0].startswith("--settle-ms="):
        settle_ms = int(args.pop(0).split("=", 1)[1])
    sweeps = [tuple(int(x) for x in s.split(":")) for s in args]
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    until = time.perf_counter() + settle_ms / 1e3
    while settle_ms > 0:
        done = torch.tensor([int(rank == 0 and time.perf_counter() >= until)], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item():
            break
    rows = []
    for lo, hi, factor, iters, warmup in sweeps:
        size = lo
        while size <= hi:
            count = size // 4 // (n if op in TOTAL else 1)
            if count > 0:
                step = step_for(op, count, rank, n)
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
