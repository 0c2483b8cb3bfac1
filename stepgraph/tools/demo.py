"""The main job: train small real models eagerly and with stepgraph, print parity and speed.

    python -m stepgraph                 # CPU (GPU when present)
    python -m stepgraph --device cpu --steps 60 --families mlp,gpt

Each family trains twice from the same seed on the same batches: once eager, once through
``stepgraph.compile``. The table shows the largest relative difference between the two runs'
parameters (0 means bitwise equal) and the median step time of each.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

import stepgraph
from stepgraph.tools import models

FAMILIES = {
    "mlp": dict(width=64, depth=8, batch=32),
    "cnn_bn": {},
    "gpt": dict(layers=2, d=64, heads=4, vocab=256, seq=32),
    "embedding_model": {},
    "hooked_mlp": {},
    "tied": {},
}


@dataclass
class Result:
    family: str
    steps: int
    eager_ms: float
    stepgraph_ms: float
    capture_s: float
    max_rel_diff: float
    final_loss: float
    stats: str


def _train(case, steps: int, compiled: bool, device: str):
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    step = models.train_step(case.model, case.loss_fn, opt)
    fn = stepgraph.compile(step) if compiled else step
    times, loss = [], None
    batches = [case.make_batch(i) for i in range(steps)]
    for b in batches:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = fn(*b)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return fn, times, loss


def run_family(name: str, steps: int, device: str) -> Result:
    a = models.build(name, device=device, **FAMILIES[name])
    b = a.fresh()
    _, t_eager, _ = _train(a, steps, False, device)
    fn, t_sg, loss = _train(b, steps, True, device)
    diff = 0.0
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        if not torch.equal(p, q):
            diff = max(diff, ((p - q).norm() / q.norm().clamp_min(1e-30)).item())
    skip = 3  # warm-up, capture, first replay
    st = fn.stats
    return Result(name, steps, statistics.median(t_eager[skip:]) * 1e3, statistics.median(t_sg[skip:]) * 1e3,
                  st.capture_seconds, diff, float(loss),
                  f"eager={st.eager_calls} captures={st.captures} replays={st.replays}")


def _families(text: str) -> list[str]:
    """``--families a,b``: every name checked here, so a typo is a usage error, not a KeyError mid-table."""
    names = [f.strip() for f in text.split(",")]
    bad = [f for f in names if f not in FAMILIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown famil{'y' if len(bad) == 1 else 'ies'} "
                                         f"{', '.join(map(repr, bad))}; choose from: {', '.join(FAMILIES)}")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stepgraph", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--families", type=_families, default=list(FAMILIES),
                   help=f"comma-separated, from: {','.join(FAMILIES)}")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
    print(f"stepgraph {stepgraph.__version__} demo | torch {torch.__version__} | {name} | "
          f"{args.steps} AdamW steps per run, same seed and batches for eager and stepgraph\n")
    print("| model | eager ms/step | stepgraph ms/step | speedup | capture s | max rel param diff | final loss | calls |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for fam in args.families:
        r = run_family(fam, args.steps, dev)
        ok &= r.max_rel_diff <= (0.0 if dev == "cpu" else 1e-3)
        print(f"| {r.family} | {r.eager_ms:.3f} | {r.stepgraph_ms:.3f} | {r.eager_ms / r.stepgraph_ms:.2f}x | "
              f"{r.capture_s:.2f} | {r.max_rel_diff:.1e} | {r.final_loss:.4f} | {r.stats} |")
    print("\nparity:", "OK (bitwise on CPU)" if ok and dev == "cpu" else ("OK" if ok else "MISMATCH"))
    print("more: python -m stepgraph.bench (eager vs torch.compile vs hand-written CUDA graph vs stepgraph)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
