"""backend="inductor" on nanoGPT's step with flash attention forced vs PyTorch's own choice (cuDNN
for bf16 on an H100/H200): does the fusion record into a CUDA graph, and what does it save?
(issue 21: GPT-2 124M's fused step spent ~6.6 ms in flash attention, torch.compile ~4.6 ms in
cuDNN's). python3 scripts/probe_cudnn_attention.py [layers]"""
import contextlib
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("STEPGRAPH_INDUCTOR_BACKGROUND", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

import stepgraph  # noqa: E402
from stepgraph.tools import models, models_scale  # noqa: E402

torch.set_float32_matmul_precision("high")
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
cfg = dict(layers=layers, d=768, heads=12, vocab=50304, seq=1024, batch=8, micro=2)


def run(label, cudnn: bool, steps=25):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    choice = (lambda: contextlib.nullcontext()) if cudnn else (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
    try:
        case = models.build("nanogpt", **cfg, seed=0, device="cuda", dtype=torch.float32)
        batches = [case.make_batch(100 + i) for i in range(steps)]
        opt, step = models_scale.opt_and_step(case, case.model)
        sg = stepgraph.compile(step, backend="inductor")
        ev, losses = [], []
        for i, b in enumerate(batches):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            with choice():
                loss = sg(*b)
            e.record()
            torch.cuda.synchronize()
            ev.append(s.elapsed_time(e))
            losses.append(float(loss))
        text = sg.explain()
        att = [ln.strip() for ln in text.splitlines() if "attention" in ln.lower()][:3]
        print(f"{label}: median {statistics.median(ev[5:]):.3f} ms, losses {losses[:3]} ... {losses[-1]:.4f}; "
              f"stats {sg.stats.captures} captures {sg.stats.replays} replays; {att}")
        return losses
    except Exception:
        traceback.print_exc()
    finally:
        torch._dynamo.reset()


a = run("flash", False)
b = run("default (cudnn)", True)
if a and b:
    print("max loss diff", max(abs(x - y) for x, y in zip(a, b)))
