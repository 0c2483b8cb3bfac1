"""Issue 6 benchmark: a GPT step that logs ``loss.item()`` (so it cannot be captured whole):
eager vs torch.compile(mode="reduce-overhead") of the model vs stepgraph.graph_module(model).

    python scripts/bench_partial.py [--layers 6 --d 384 --heads 6 --batch 8 --seq 256 --vocab 4096]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stepgraph  # noqa: E402
from stepgraph.tools import models  # noqa: E402


def run(variant, args, steps=60, warm=5):
    torch.manual_seed(0)
    case = models.gpt(layers=args.layers, d=args.d, heads=args.heads, vocab=args.vocab, batch=args.batch,
                      seq=args.seq, device="cuda")
    model = case.model
    if variant == "reduce-overhead":
        model = torch.compile(model, mode="reduce-overhead")
    elif variant == "stepgraph.graph_module":
        model = stepgraph.graph_module(model)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    log = []
    batches = [case.make_batch(i) for i in range(steps + warm)]
    t0 = time.perf_counter()
    times = []
    for i, b in enumerate(batches):
        if variant == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        loss = case.loss_fn(model, *b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.append(loss.item())  # the host sync that prevents whole-step capture
        e.record()
        if i == 2:
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
        if i >= warm:
            times.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times), first, log[-1]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for k, v in dict(layers=6, d=384, heads=6, batch=8, seq=256, vocab=4096).items():
        p.add_argument(f"--{k}", type=int, default=v)
    a = p.parse_args()
    print(f"GPT {a.layers}L d{a.d}, step with loss.item() logging, {torch.cuda.get_device_name()}")
    rows = {v: run(v, a) for v in ("eager", "reduce-overhead", "stepgraph.graph_module")}
    e = rows["eager"][0]
    print("| variant | median ms | speed-up vs eager | first 3 steps s | last loss |\n|---|---|---|---|---|")
    for v, (ms, first, last) in rows.items():
        print(f"| {v} | {ms:.3f} | {e / ms:.2f} | {first:.2f} | {last:.4f} |")
