"""Issue 17's speed target: GPT-2L (SDPA) with one host read mid-step, as CUDA-graph segments.

    python scripts/bench_segments.py [--steps 200] [--inductor]

Prints median ms/step (CUDA events) for eager, stepgraph without a read, and stepgraph with a
``torch.isfinite(loss)`` skip branch (a guard between the forward and the backward), and the
share of the unsegmented speed-up the segmented step keeps. ``--inductor`` adds the same two
stepgraph rows with ``backend="inductor"`` (each segment fused, backends/inductor_segments.py).
"""
import argparse
import statistics

import torch

import stepgraph
from stepgraph.tools import models


def make_step(case, opt, read):
    def step(x, y):
        loss = case.loss_fn(case.model, x, y)
        if read and not torch.isfinite(loss):
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def timed(fn, batch, steps):
    for _ in range(5):
        fn(*batch)
    ts = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*batch)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--case", default="gpt2l")
    ap.add_argument("--inductor", action="store_true")
    args = ap.parse_args()
    from stepgraph.tools.bench import CASES
    cfg = CASES[args.case]
    out = {}
    rows = [("eager", False, False), ("eager+read", True, False),
            ("stepgraph", False, True), ("stepgraph+read (segments)", True, True)]
    if args.inductor:
        rows += [("inductor", False, "inductor"), ("inductor+read (segments)", True, "inductor")]
    for name, read, compiled in rows:
        case = models.build(cfg.family, **cfg.config, device="cuda")
        opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
        fn = make_step(case, opt, read)
        if compiled:
            fn = stepgraph.compile(fn, backend=compiled if isinstance(compiled, str) else "auto")
            if isinstance(compiled, str):
                batch = case.make_batch(0)
                for _ in range(3):
                    fn(*batch)
                fn.wait_compiled()   # (the unsegmented step compiles in the background)
        out[name] = timed(fn, case.make_batch(0), args.steps)
        if compiled:
            e = fn.captures[-1]
            segs = len(e.run.segments or []) or 1
            print(f"{name}: backend {e.backend}, {segs} CUDA graph(s)")
    for k, v in out.items():
        print(f"{k:28s} {v:8.3f} ms")
    kept = (out["eager+read"] / out["stepgraph+read (segments)"]) / (out["eager"] / out["stepgraph"])
    print(f"speed-up over eager: unsegmented {out['eager'] / out['stepgraph']:.2f}x, with the read "
          f"{out['eager+read'] / out['stepgraph+read (segments)']:.2f}x ({kept:.0%} kept); device "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.inductor:
        kept = (out["eager+read"] / out["inductor+read (segments)"]) / (out["eager"] / out["inductor"])
        print(f"inductor: unsegmented {out['eager'] / out['inductor']:.2f}x, with the read "
              f"{out['eager+read'] / out['inductor+read (segments)']:.2f}x ({kept:.0%} kept)")


if __name__ == "__main__":
    main()
