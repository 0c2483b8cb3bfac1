"""Eager FSDP2 vs the captured FSDP2 step on the CPU (gloo), median step time per rank.

usage: OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 scripts/bench_fsdp2_cpu.py [--layers 4 --d 64]
"""
import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import stepgraph  # noqa: E402
from fsdp2_worker import gpt_step, sharded_gpt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    size = dict(layers=a.layers, d=a.d, heads=4, vocab=256, seq=64)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (4, 64), generator=g) for _ in range(a.steps)]
    times = {}
    for name in ("eager", "stepgraph", "eager ", "stepgraph "):  # twice, interleaved
        m = sharded_gpt(True, **size)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
        step = gpt_step(m, opt)
        if name.startswith("stepgraph"):
            step = stepgraph.compile(step)
        ts = []
        for ids in batches:
            dist.barrier()
            t0 = time.perf_counter()
            step(ids, torch.roll(ids, -1, 1))
            ts.append(time.perf_counter() - t0)
        times.setdefault(name.strip(), []).extend(ts[3:])  # after warm-up and capture
    if rank == 0:
        e, s = statistics.median(times["eager"]), statistics.median(times["stepgraph"])
        print(f"FSDP2 GPT {a.layers}L d={a.d}, 2 gloo ranks, 1 thread each: eager {e * 1e3:.2f} ms/step, "
              f"stepgraph (replay) {s * 1e3:.2f} ms/step, {e / s:.2f}x")
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
