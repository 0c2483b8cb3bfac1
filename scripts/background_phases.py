"""Where backend="inductor"'s time to the fused graph goes (issue 4): child start-up, compile,
save, and load + record at the switch.  python3 scripts/background_phases.py [cases]"""
import sys
import time

import torch

torch.set_float32_matmul_precision("high")   # (as the bench runs the real-scale cases)

import stepgraph
from stepgraph.tools import bench, models, models_scale

for name in (sys.argv[1] if len(sys.argv) > 1 else "mlp512").split(","):
    bc = bench.CASES[name]
    case = models.build(bc.family, **bc.config, seed=0, device="cuda", dtype=torch.float32)
    opt, step = models_scale.opt_and_step(case, case.model)   # (a real-scale case's own recipe)
    sg = stepgraph.compile(step, backend="inductor")
    t0 = time.perf_counter()
    for i in range(3):
        sg(*case.make_batch(i))
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    sg.wait_compiled()
    sg(*case.make_batch(3))
    torch.cuda.synchronize()
    print(f"{name}: first {first:.2f}s, fused {time.perf_counter() - t0:.1f}s;",
          [ln.strip() for ln in sg.explain().splitlines() if "Inductor graph" in ln])
