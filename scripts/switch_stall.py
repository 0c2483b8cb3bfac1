"""How long the call that switches to the background-compiled Inductor graph takes (issue 21),
against an ordinary unfused call and an ordinary fused call, on the CPU.

    python scripts/switch_stall.py [mlp|gpt] [repeats]

Waits for the child process to finish *without* switching, so the switching call's time is
what a training loop sees; loading, the first fused call and the parity check are printed
in the progress lines; with the watcher thread, calls made while it loads are timed too."""
import statistics
import sys
import time

import torch

import stepgraph
from stepgraph.tools import models

torch.set_num_threads(1)
family = sys.argv[1] if len(sys.argv) > 1 else "gpt"
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
cfg = {"mlp": dict(width=256, depth=4), "gpt": dict(layers=2, d=64, heads=4, vocab=256, seq=32)}[family]
rows = []
for r in range(repeats):
    case = models.build(family, **cfg)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    sg = stepgraph.compile(models.train_step(case.model, case.loss_fn, opt), backend="inductor")
    sg(*case.make_batch(0))
    sg(*case.make_batch(1))
    run = sg._order[0].run
    unfused = []
    for i in range(2, 5):
        t0 = time.perf_counter()
        sg(*case.make_batch(i))
        unfused.append(time.perf_counter() - t0)
    job = run.job
    job.proc.wait()
    ready = getattr(job, "ready", None)
    during = []
    if ready is not None:  # the artifact is loaded in a thread before the job counts as done:
        while not ready.is_set():  # the calls meanwhile (on the unfused graph) share the GIL with it
            t0 = time.perf_counter()
            sg(*case.make_batch(4))
            during.append(time.perf_counter() - t0)
    job.wait()
    time.sleep(0.2)
    t0 = time.perf_counter()
    sg(*case.make_batch(5))
    switch = time.perf_counter() - t0
    assert run.state == "fused", run.state
    fused = []
    for i in range(6, 9):
        t0 = time.perf_counter()
        sg(*case.make_batch(i))
        fused.append(time.perf_counter() - t0)
    rows.append(switch)
    print(f"{family} run {r}: switching call {switch:.3f}s; unfused call {statistics.median(unfused)*1e3:.1f} ms, "
          f"fused call {statistics.median(fused)*1e3:.1f} ms; switch_seconds {run.switch_seconds:.3f}"
          + (f"; {len(during)} calls while loading, slowest {max(during)*1e3:.0f} ms" if during else ""),
          flush=True)
print(f"{family}: median switching call {statistics.median(rows):.3f}s over {repeats} runs")
