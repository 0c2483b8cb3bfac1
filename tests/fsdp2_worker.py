"""One rank of tests/test_fsdp2.py's multi-process scenarios (launched by torchrun, gloo on the CPU).

usage: torchrun --nproc_per_node 2 tests/fsdp2_worker.py SCENARIO OUT_DIR
Each rank writes OUT_DIR/rank{r}.json: per case, what it measured against an eager FSDP2 twin.
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import stepgraph  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def sharded_mlp(reshard_after_forward: bool) -> nn.Module:
    """Per-block and root fully_shard, as FSDP2's documentation shards a model."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    for block in (m[0], m[2], m[4]):
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    return fully_shard(m, reshard_after_forward=reshard_after_forward)


def train_step(model, opt):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def max_diff(a, oa, b, ob) -> float:
    """Largest difference of local shards: parameters, grads, optimizer state, state_dict."""
    d = 0.0

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    for p, q in zip(a.parameters(), b.parameters()):
        pairs = [(p, q)] + ([(p.grad, q.grad)] if p.grad is not None or q.grad is not None else [])
        pairs += [(oa.state[p][k], ob.state[q][k]) for k in oa.state.get(p, {})]
        for x, y in pairs:
            if x is None or y is None:
                return float("inf")
            d = max(d, (local(x).double() - local(y).double()).abs().max().item())
    for (k, x), (k2, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert k == k2
        d = max(d, (local(x).double() - local(y).double()).abs().max().item())
    return d


def run_case(raf: bool, on_capture_error: str, calls: int = 6) -> dict:
    a, b = sharded_mlp(raf), sharded_mlp(raf)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=True)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=True)
    sg = stepgraph.compile(train_step(a, oa), on_capture_error=on_capture_error)
    eager = train_step(b, ob)
    g = torch.Generator().manual_seed(100 + RANK)  # every rank its own batches
    errors, diffs, loss_diffs = [], [], []
    for _ in range(calls):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        try:
            la = sg(x, y)
        except stepgraph.CaptureError as e:
            errors.append(str(e))
            la = None
        lb = eager(x, y)
        if la is not None:
            loss_diffs.append(abs(la.item() - lb.item()))
        diffs.append(max_diff(a, oa, b, ob))
    s = sg.stats
    return {"errors": errors, "max_diff": max(diffs), "loss_diff": max(loss_diffs, default=0.0),
            "captures": s.captures, "replays": s.replays, "eager_calls": s.eager_calls}


def scenario_fsdp2(out):
    for raf in (True, False):
        for mode in ("raise", "eager"):
            out[f"raf={raf},{mode}"] = run_case(raf, mode)


def main():
    scenario, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("PG_TIMEOUT", "60"))))
    out: dict = {}
    globals()[f"scenario_{scenario}"](out)
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    os._exit(0)  # (gloo's teardown sometimes aborts at exit: see ddp_worker.py)


if __name__ == "__main__":
    main()
