"""Sharded-training benchmark: eager FSDP2 (``fully_shard``) vs the stepgraph-captured step, every rank.

    torchrun --standalone --nproc_per_node 2 -m stepgraph.bench_fsdp2 --out DIR               # GPUs: NCCL
    torchrun --standalone --nproc_per_node 2 -m stepgraph.bench_fsdp2 --device cpu --out DIR  # gloo

The zoo GPT with one ``fully_shard`` per block and one at the root (GPU: 6 layers, d=384, vocab
512, 8 x 128 tokens per rank, as tests/test_cuda_fsdp2.py; CPU: a tiny one). Cases:
reshard_after_forward True and False, bf16 parameters with fp32 reduction, fused AdamW (CUDA).
Each case builds two identical models from the same seed, the eager twin and the compiled step,
fed the same per-rank batches (rank r, call i: seed 1000 + i + 100000 r). On CUDA the twin takes
the capturable AdamW stepgraph switches to at its capture (fsdp2.match_optimizer_form), so the
two run the same kernels and are compared bitwise: after each of the first 7 calls (capture at
call 2) and after the timed ones, the largest difference of the local shards of parameters,
gradients, optimizer state and state_dict (and of the loss), max over ranks.

Step times are medians of CUDA events (wall clock on the CPU): rank 0's and the slowest rank's.
Memory (CUDA) is test_cuda_fsdp2's: one model's sharded state + the step's peak above what was
allocated before it, the step's CUDA-graph pool counted. Rank 0 prints a markdown table and,
with ``--out``, writes ``bench_fsdp2.json`` and ``bench_fsdp2.md``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
import traceback
import warnings

import torch
import torch.distributed as dist

from stepgraph.tools import fsdp2

PARITY_CALLS = 7   # call 1 eager, 2 captured, 5 replays: as the tests
MIB = 2 ** 20


def _batches(size: dict, batch: int, rank: int, start: int, n: int, dev) -> list:
    out = []
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(1000 + i + 100000 * rank)   # every rank its own data
        ids = torch.randint(0, size["vocab"], (batch, size["seq"]), generator=g)
        out.append((ids.to(dev), torch.roll(ids, -1, 1).to(dev)))
    return out


def _now(dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def _step_ms(step, batches, dev) -> list[float]:
    """Per-step milliseconds: CUDA events around each call (the host runs ahead), or wall clock."""
    if dev.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in batches]
        for (a, b), (x, y) in zip(ev, batches):
            a.record()
            step(x, y)
            b.record()
        torch.cuda.synchronize(dev)
        return [a.elapsed_time(b) for a, b in ev]
    out = []
    for x, y in batches:
        t = time.perf_counter()
        step(x, y)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _per_rank(values: list[float], dev) -> list[list[float]]:
    """Every rank's ``values`` (float64), gathered on every rank."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def run_case(name: str, dev, rank: int, size: dict, batch: int, steps: int, warmup: int) -> dict:
    import stepgraph
    a, oa, b, ob = fsdp2.twins(fsdp2.CASES[name], dev.type, **size)
    sg, eager = stepgraph.compile(fsdp2.gpt_step(a, oa)), fsdp2.gpt_step(b, ob)
    data = _batches(size, batch, rank, 0, PARITY_CALLS + warmup + steps, dev)
    first = {"stepgraph": [], "eager": []}
    diffs, loss_diffs = [], []
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data[:PARITY_CALLS]):
            t = _now(dev)
            la = sg(x, y)
            t_sg = _now(dev) - t
            fsdp2.match_optimizer_form(oa, ob)   # before the twin's call (stepgraph switched in its own)
            t = _now(dev)
            lb = eager(x, y)
            t_eager = _now(dev) - t
            if i < 3:
                first["stepgraph"].append(t_sg)
                first["eager"].append(t_eager)
            loss_diffs.append(abs(la.item() - lb.item()))
            diffs.append(fsdp2.max_diff(a, oa, b, ob))
        timed = data[PARITY_CALLS:]
        ms = {}
        for label, step in (("stepgraph", sg), ("eager", eager)):
            _step_ms(step, timed[:warmup], dev)
            dist.barrier()
            ms[label] = statistics.median(_step_ms(step, timed[warmup:], dev))
        mem = [0.0] * 4
        if dev.type == "cuda":   # test_cuda_fsdp2's accounting, on the timed batches again
            pool = fsdp2.graph_pool_bytes(sg)
            tr_sg, tr_eager = fsdp2.transient(sg, timed[:3], pool), fsdp2.transient(eager, timed[:3], 0)
            state = fsdp2.state_bytes(a, oa)
            mem = [(state + tr_sg) / MIB, (state + tr_eager) / MIB, pool / MIB, state / MIB]
        diffs.append(fsdp2.max_diff(a, oa, b, ob))   # after every call, the timed ones included
    fallback = [str(w.message) for w in caught if "chose 'replay'" in str(w.message)]
    mine = [ms["stepgraph"], ms["eager"], sum(first["stepgraph"]), sum(first["eager"]),
            max(diffs), max(loss_diffs), *mem]
    ranks = _per_rank(mine, dev)
    col = list(zip(*ranks))   # one tuple per value, one entry per rank
    st = sg.stats
    row = dict(case=name, stepgraph_ms=ms["stepgraph"], eager_ms=ms["eager"],
               stepgraph_ms_max_rank=max(col[0]), eager_ms_max_rank=max(col[1]),
               first3_s=dict(stepgraph=first["stepgraph"], eager=first["eager"]),
               max_diff=max(col[4]), loss_diff=max(col[5]), bitwise=max(col[4]) == 0.0 and max(col[5]) == 0.0,
               captures=st.captures, replays=st.replays, eager_calls=st.eager_calls, recaptures=list(st.recaptures),
               backends=[c.backend for c in sg.captures], fallback_warnings=fallback[:2],
               optimizer_form=dict(zip(("capturable", "tensor_lr"), fsdp2.optimizer_form(oa))),
               graph_ops=fsdp2.graph_ops(sg), steps=steps, per_rank=ranks)
    if dev.type == "cuda":
        row.update(mem_mib_stepgraph=list(col[6]), mem_mib_eager=list(col[7]), pool_mib=list(col[8]),
                   state_mib=list(col[9]), mem_ratio_max=max(s / e for s, e in zip(col[6], col[7])))
    return row


def _table(rows: list, head: str, cuda: bool) -> str:
    cols = ["case", "eager ms", "stepgraph ms", "x eager", "max over ranks (eager / stepgraph)",
            "first 3 calls s (eager / stepgraph)"]
    cols += ["memory MiB rank 0 (stepgraph / eager)", "x eager (worst rank)"] if cuda else []
    cols += ["parity", "captures/replays", "backend", "in the graph: all-gather / reduce-scatter / all-reduce"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error'].splitlines()[-1][:150]} |")
            continue
        f = r["first3_s"]
        cells = [r["case"], f"{r['eager_ms']:.2f}", f"{r['stepgraph_ms']:.2f}", f"{r['stepgraph_ms'] / r['eager_ms']:.2f}",
                 f"{r['eager_ms_max_rank']:.2f} / {r['stepgraph_ms_max_rank']:.2f}",
                 f"{sum(f['eager']):.2f} / {sum(f['stepgraph']):.2f}"]
        if cuda:
            cells += [f"{r['mem_mib_stepgraph'][0]:.0f} / {r['mem_mib_eager'][0]:.0f}", f"{r['mem_ratio_max']:.2f}"]
        ops = r["graph_ops"]
        cells += ["bitwise" if r["bitwise"] else f"max diff {max(r['max_diff'], r['loss_diff']):.1e}",
                  f"{r['captures']}/{r['replays']}", ",".join(r["backends"]) or "-",
                  f"{ops['all_gather_into_tensor']} / {ops['reduce_scatter_tensor']} / {ops['all_reduce']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _write(out: str, text: str, data: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_fsdp2.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out, "bench_fsdp2.md"), "w") as f:
        f.write(text + "\n")


def _init(device: str):
    timeout = datetime.timedelta(seconds=int(os.environ.get("PG_TIMEOUT", "300")))
    if device == "cuda":   # one GPU per rank, as bench_ddp
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dev


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--case", action="append", choices=list(fsdp2.CASES),
                    help="repeatable; default every case (fused AdamW on CUDA only)")
    ap.add_argument("--size", choices=("gpu", "tiny"), default=None, help="default: gpu on CUDA, tiny on the CPU")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per twin (default 50 on CUDA, 10 on the CPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = _init(args.device)
    cuda = dev.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)   # gloo ranks share the CPU's cores
    rank, world = dist.get_rank(), dist.get_world_size()
    big = (args.size or ("gpu" if cuda else "tiny")) == "gpu"
    size, batch = (fsdp2.GPU_SIZE, 8) if big else (fsdp2.TINY_SIZE, 2)
    steps = args.steps or (50 if cuda else 10)
    names = args.case or [n for n, c in fsdp2.CASES.items() if cuda or not c.get("fused")]
    dname = torch.cuda.get_device_name(dev) if cuda else "cpu"
    head = (f"FSDP2 (per-block + root fully_shard), {world} ranks x {dname}, torch {torch.__version__}: "
            f"GPT-{size['layers']}L d={size['d']} vocab {size['vocab']}, {batch}x{size['seq']} tokens per rank, "
            f"median of {steps} steps; x eager = stepgraph / eager (rank 0)")
    rows = []
    for name in names:
        try:
            rows.append(run_case(name, dev, rank, size, batch, steps, args.warmup))
        except Exception as e:   # noqa: BLE001 - one case's failure must not cost the others' numbers
            print(f"rank {rank}: case {name!r} failed:\n{traceback.format_exc()}", flush=True)
            rows.append(dict(case=name, error=f"{type(e).__name__}: {e}"))
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if rank == 0:
            print(_table(rows[-1:], "", cuda).splitlines()[-1], flush=True)   # progress
        if rank == 0 and args.out:   # after every case: a run cut short keeps what it measured
            meta = dict(world=world, device=dname, torch=torch.__version__, size=size, batch=batch, steps=steps)
            _write(args.out, _table(rows, head, cuda), dict(meta, rows=rows, done=len(rows) == len(names)))
    if rank == 0:
        print(_table(rows, head, cuda), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
