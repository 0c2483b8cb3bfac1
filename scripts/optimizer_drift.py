"""How far stepgraph on CUDA drifts from the user's eager optimizer form, over 100 steps.

On CUDA a whole-step graph cannot hold the host floats PyTorch's default (foreach) Adam computes
from its step counter, so stepgraph switches optimizers to their capturable form (PyTorch's
own). This script trains one small conv net per optimizer three ways from the same start and
batches: eager as the user wrote it, eager in the capturable form (switched at the second call,
where stepgraph captures), and stepgraph; it prints the largest relative parameter difference
after 8 and 100 steps as a markdown table.

    python scripts/optimizer_drift.py [--out docs/optimizer_drift.md]
"""
from __future__ import annotations

import argparse
import datetime

import torch
from torch import nn

import stepgraph
from stepgraph.optimizers import make_capturable
from stepgraph.capture.state import discover

OPTS = {
    "Adam (default foreach)": lambda p: torch.optim.Adam(p, lr=1e-3),
    "AdamW (default foreach)": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "AdamW fused=True": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "Adam capturable=True": lambda p: torch.optim.Adam(p, lr=1e-3, capturable=True),
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
}


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10)).cuda()


def run(make_opt, mode: str, steps: int):
    m = net()
    opt = make_opt(m.parameters())
    lossf = nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad()
        loss = lossf(m(x), y)
        loss.backward()
        opt.step()
        return loss
    f = stepgraph.compile(step) if mode == "stepgraph" else step
    g = torch.Generator(device="cuda").manual_seed(1)
    snaps = {}
    for k in range(steps):
        if mode == "capturable" and k == 1:
            make_capturable(discover(step))
        x = torch.randn(32, 3, 16, 16, device="cuda", generator=g)
        y = torch.randint(0, 10, (32,), device="cuda", generator=g)
        f(x, y)
        if k + 1 in (8, steps):
            snaps[k + 1] = [p.detach().clone() for p in m.parameters()]
    return snaps


def rel(a, b) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    rows = []
    for name, make in OPTS.items():
        user, capt, sg = (run(make, mode, args.steps) for mode in ("user", "capturable", "stepgraph"))
        rows.append(f"| {name} | {rel(sg[8], user[8]):.1e} | {rel(sg[args.steps], user[args.steps]):.1e} | "
                    f"{rel(sg[args.steps], capt[args.steps]):.1e} |")
    text = "\n".join([
        f"# Optimizer drift on CUDA ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{datetime.date.today()})", "",
        f"`python scripts/optimizer_drift.py` -- conv net, batch 32, {args.steps} steps; largest relative "
        "parameter difference (max |a-b| / max |b| over tensors).", "",
        "| optimizer as the user wrote it | stepgraph vs user's eager, 8 steps | "
        f"stepgraph vs user's eager, {args.steps} steps | stepgraph vs eager in the capturable form, "
        f"{args.steps} steps |", "|---|---|---|---|", *rows, ""])
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
