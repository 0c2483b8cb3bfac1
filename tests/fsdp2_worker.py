"""One rank of tests/test_fsdp2.py's multi-process scenarios (launched by torchrun): gloo on the
CPU, or NCCL on one GPU per rank with FSDP2_DEVICE=cuda (test_fsdp2's launch sets it when
STEPGRAPH_TEST_CUDA=1 and there are 2 GPUs).

usage: [FSDP2_DEVICE=cuda] torchrun --nproc_per_node 2 tests/fsdp2_worker.py SCENARIO OUT_DIR
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
# (shared with the benchmark and test_cuda_fsdp2; test_fsdp2 imports them from here)
from stepgraph.tools.fsdp2 import gpt_step, graph_ops, match_optimizer_form, max_diff, mesh, sharded_gpt  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
DEVICE = os.environ.get("FSDP2_DEVICE", "cpu")


def sharded_mlp(reshard_after_forward: bool, mp=None) -> nn.Module:
    """Per-block and root fully_shard, as FSDP2's documentation shards a model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)).to(DEVICE)
    kw = dict(reshard_after_forward=reshard_after_forward, mp_policy=mp or MixedPrecisionPolicy(), mesh=mesh(DEVICE))
    for block in (m[0], m[2], m[4]):
        fully_shard(block, **kw)
    return fully_shard(m, **kw)


def gpt(reshard_after_forward: bool, mp=None) -> nn.Module:
    return sharded_gpt(reshard_after_forward, mp, device=DEVICE)


def train_step(model, opt):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def run_case(raf: bool, calls: int = 7, make_step=train_step, mp=None, change_at=None, model=sharded_mlp,
             **compile_kw) -> dict:
    """Capture at call 2, then replays on fresh per-rank batches, against an eager twin."""
    a, b = model(raf, mp), model(raf, mp)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=True)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=True)
    sg = stepgraph.compile(make_step(a, oa), **compile_kw)
    eager = make_step(b, ob)
    g = torch.Generator().manual_seed(100 + RANK)  # every rank its own batches
    errors, diffs, loss_diffs, switched = [], [], [], 0
    for i in range(calls):
        if i == change_at:
            for m in (a, b):
                m.set_reshard_after_forward(not raf)
        if model is gpt:
            x = torch.randint(0, 64, (2, 16), generator=g)
            y = torch.roll(x, -1, 1)
        else:
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        x, y = x.to(DEVICE), y.to(DEVICE)
        try:
            la = sg(x, y)
        except stepgraph.CaptureError as e:
            errors.append(str(e))
            la = None
        # On CUDA stepgraph switches AdamW to its capturable form when it captures (not when it
        # refuses): the twin follows, so both run the same kernels and compare bitwise.
        switched += match_optimizer_form(oa, ob)
        lb = eager(x, y)
        if la is not None:
            loss_diffs.append(abs(la.item() - lb.item()))
        diffs.append(max_diff(a, oa, b, ob))  # state_dict() mid-run included
    s = sg.stats
    unsh = sg.graph.meta.get("unsharded") if s.captures else None
    return {"errors": errors, "backends": [c.backend for c in sg.captures], "twin_switched": switched,
            "unsharded": None if unsh is None else
            {"storages": unsh.storages, "temporaries": unsh.temporaries, "left": len(unsh.left)}, "max_diff": max(diffs), "loss_diff": max(loss_diffs, default=0.0),
            "captures": s.captures, "replays": s.replays, "eager_calls": s.eager_calls,
            "recaptures": s.recaptures,
            "graph_ops": graph_ops(sg)}


def zero_grad_first(model, opt):
    """zero_grad before backward: the DTensor grads live on between calls (refused for now)."""
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def accumulating_step(model, opt):
    """Two micro-batches in one step; FSDP2 reduce-scatters only the second backward."""
    def step(x, y):
        model.set_requires_gradient_sync(False)
        F.cross_entropy(model(x[:4]), y[:4]).backward()
        model.set_requires_gradient_sync(True)
        loss = F.cross_entropy(model(x[4:]), y[4:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def scenario_fsdp2(out):
    for raf in (True, False):
        out[f"raf={raf}"] = run_case(raf)
    os.environ["STEPGRAPH_FSDP2_TEMPORARIES"] = "0"  # the storages resized in the graph, as traced
    try:
        out["resizes_kept"] = run_case(True)
    finally:
        del os.environ["STEPGRAPH_FSDP2_TEMPORARIES"]
    out["settings_change"] = run_case(True, calls=8, change_at=4)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    out["bf16_params"] = run_case(True, mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                 reduce_dtype=torch.float32))
    out["accumulate_in_step"] = run_case(True, make_step=accumulating_step)
    out["gpt"] = run_case(True, make_step=gpt_step, model=gpt)
    out["zero_grad_first"] = run_case(True, make_step=zero_grad_first)
    # The whole step fused by Inductor, collectives included (compiled in the capturing call: a
    # step with collectives is never compiled in the background, where ranks would switch apart).
    out["inductor"] = run_case(True, backend="inductor")
    if DEVICE == "cpu":   # (the first-call check runs on the CPU)
        out["inductor_rank1_diverges"] = _one_rank_fuses_wrongly()
    out["zero_grad_first_eager"] = run_case(True, make_step=zero_grad_first, on_capture_error="eager")


def _one_rank_fuses_wrongly() -> dict:
    """Rank 1's fused code returns NaN (a fusion bug): its first-call check fails, and every rank
    keeps the unfused graph (verify._all_ranks_passed), so the ranks stay replicas of eager."""
    from fusion_bugs import nan_first_output
    from stepgraph.backends import inductor
    orig = inductor._compile
    inductor._compile = nan_first_output(orig, when=lambda: RANK == 1)
    try:
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = run_case(True, backend="inductor")
    finally:
        inductor._compile = orig
    res["warnings"] = [str(w.message) for w in caught if "did not match" in str(w.message)]
    return res


def main():
    scenario, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if DEVICE == "cuda":   # one GPU per rank, as bench_fsdp2 and ddp_worker
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", RANK)))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("PG_TIMEOUT", "60"))))
    out: dict = {}
    globals()[f"scenario_{scenario}"](out)
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    os._exit(0)  # (gloo's teardown sometimes aborts at exit: see ddp_worker.py)


if __name__ == "__main__":
    main()
