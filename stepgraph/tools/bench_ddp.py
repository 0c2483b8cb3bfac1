"""Data-parallel benchmark: eager DistributedDataParallel vs stepgraph DDP, one run, every rank.

    torchrun --standalone --nproc_per_node 2 -m stepgraph.bench_ddp               # GPUs: NCCL
    torchrun --standalone --nproc_per_node 2 -m stepgraph.bench_ddp --device cpu  # gloo

Each variant gets a fresh model (same seed on every rank, as DDP requires), AdamW, and per-rank
batches (rank r, step i: batch 1000 + i + 100000 r). Step times are CUDA-event medians (wall
clock on the CPU) of rank 0; ``max over ranks`` is the slowest rank's median. Rank 0 prints a
markdown table and, with ``--out``, writes ``bench_ddp.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from stepgraph.tools import models
from stepgraph.tools.bench import CASES


def run_variant(name, case_name, dev, rank, steps, warmup) -> dict:
    import stepgraph
    bench = CASES[case_name]
    case = models.build(bench.family, **bench.config, seed=0, device=dev)
    ids = [dev.index] if dev.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(case.model, device_ids=ids)
    opt = torch.optim.AdamW(ddp.parameters())
    step = models.train_step(ddp, case.loss_fn, opt)
    if name.startswith("stepgraph"):
        step = stepgraph.compile(step, backend=name[len("stepgraph["):-1] if "[" in name else "auto")
    total = 3 + warmup + steps
    batches = [case.make_batch(1000 + i + 100000 * rank) for i in range(total)]
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    for i in range(3):
        loss = step(*batches[i])
    sync()
    first_s = time.perf_counter() - t0
    for i in range(3, 3 + warmup):
        loss = step(*batches[i])
    sync()
    dist.barrier()
    times = []
    if dev.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for (a, b), i in zip(ev, range(3 + warmup, total)):
            a.record()
            loss = step(*batches[i])
            b.record()
        sync()
        times = [a.elapsed_time(b) for a, b in ev]
    else:
        for i in range(3 + warmup, total):
            t = time.perf_counter()
            loss = step(*batches[i])
            times.append((time.perf_counter() - t) * 1e3)
    med = statistics.median(times)
    worst = torch.tensor([med], dtype=torch.float64, device=dev if dev.type == "cuda" else "cpu")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    out = dict(case=case_name, variant=name, median_ms=med, max_rank_median_ms=worst.item(), first_s=first_s,
               final_loss=float(loss.detach()), steps=steps)
    if name.startswith("stepgraph"):
        st = step.stats
        out.update(captures=st.captures, replays=st.replays, recaptures=list(st.recaptures))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default=None, help="comma list; GPU default gpt2l,gpt6l, CPU mlp64")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stepgraph-backends", default="", help="extra stepgraph backends, e.g. inductor")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    cases = (args.cases or ("gpt2l,gpt6l" if dev.type == "cuda" else "mlp64")).split(",")
    rows = []
    for c in cases:
        extra = [f"stepgraph[{b}]" for b in args.stepgraph_backends.split(",") if b]
        for v in ("eager", "stepgraph", *extra):
            rows.append(run_variant(v, c, dev, rank, args.steps, args.warmup))
    if rank == 0:
        world = dist.get_world_size()
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        lines = [f"DDP, {world} ranks x {name}, torch {torch.__version__}, median of {args.steps} steps",
                 "", "| case | variant | step ms (rank 0) | max over ranks | eager/this | first 3 calls s | captures/replays |",
                 "|---|---|---|---|---|---|---|"]
        eager = {r["case"]: r["median_ms"] for r in rows if r["variant"] == "eager"}
        for r in rows:
            ratio = eager[r["case"]] / r["median_ms"]
            cr = f"{r.get('captures', '-')}/{r.get('replays', '-')}"
            lines.append(f"| {r['case']} | {r['variant']} | {r['median_ms']:.3f} | {r['max_rank_median_ms']:.3f} | "
                         f"{ratio:.2f} | {r['first_s']:.2f} | {cr} |")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_ddp.json"), "w") as f:
                json.dump(dict(world=world, device=name, torch=torch.__version__, rows=rows), f, indent=1)
            with open(os.path.join(args.out, "bench_ddp.md"), "w") as f:
                f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
