"""Peak CUDA memory of one step function: eager vs stepgraph, for the MLP-512 bench case.

    python scripts/diag_memory.py        (run with STEPGRAPH_TRACE_STREAM=side|current)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stepgraph  # noqa: E402
from stepgraph.tools import models  # noqa: E402


def run(compiled: bool) -> float:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    case = models.mlp(width=512, depth=8, batch=64, device="cuda")
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)

    def step(x, y):
        loss = case.loss_fn(case.model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    f = stepgraph.compile(step) if compiled else step
    for i in range(6):
        f(*case.make_batch(i))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


if __name__ == "__main__":
    mode = os.environ.get("STEPGRAPH_TRACE_STREAM", "side")
    print(f"trace_stream={mode}: eager {run(False):.1f} MiB, stepgraph {run(True):.1f} MiB")
