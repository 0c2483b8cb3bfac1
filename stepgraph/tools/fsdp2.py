"""FSDP2 pieces shared by the FSDP2 benchmark (bench_fsdp2.py) and its tests (tests/fsdp2_worker.py,
tests/test_cuda_fsdp2.py): the sharded zoo GPT and its step, the comparison with an eager twin,
and the GPU memory accounting."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# The zoo GPT at the size test_cuda_fsdp2 measured on one GPU (8 x 128 tokens per rank), and a tiny one.
GPU_SIZE = dict(layers=6, d=384, heads=6, vocab=512, seq=128, sdpa=False)
TINY_SIZE = dict(layers=2, d=32, heads=2, vocab=64, seq=16, sdpa=False)
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "resize_storage_bytes_")


def mesh(device: str):
    """Named explicitly: fully_shard's default mesh is on CUDA whenever a GPU is present."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device, (dist.get_world_size(),))


def sharded_gpt(reshard_after_forward: bool = True, mp=None, device="cpu", **size) -> nn.Module:
    """The zoo's GPT (tied embedding/head) with one fully_shard per block and one at the root,
    as FSDP2's documentation shards a model. Same seed on every rank (each keeps its shard)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from stepgraph.tools import models
    torch.manual_seed(0)
    kw = dict(TINY_SIZE, dropout=0.0) | size
    m = models.GPT(**kw).to(device)
    shard = dict(reshard_after_forward=reshard_after_forward, mp_policy=mp or MixedPrecisionPolicy(),
                 mesh=mesh(device))
    for blk in m.blocks:
        fully_shard(blk, **shard)
    return fully_shard(m, **shard)


# The cases of tests/test_cuda_fsdp2.py and bench_fsdp2.py (fused AdamW: CUDA only there).
CASES = {
    "raf=True": dict(raf=True),
    "raf=False": dict(raf=False),
    "bf16 params, fp32 reduce": dict(raf=True, bf16=True),
    "fused AdamW": dict(raf=True, fused=True),
}


def twins(case: dict, device: str, **size) -> tuple:
    """Two identical sharded GPTs with AdamW (foreach, or fused): ``(a, opt_a, b, opt_b)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.get("bf16") else None
    a, b = (sharded_gpt(case["raf"], mp, device=device, **size) for _ in range(2))
    form = dict(fused=True) if case.get("fused") else dict(foreach=True)
    oa, ob = (torch.optim.AdamW(m.parameters(), lr=1e-3, **form) for m in (a, b))
    return a, oa, b, ob


def gpt_step(model, opt):
    def step(ids, targets):
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def max_diff(a, oa, b, ob) -> float:
    """Largest difference of local shards: parameters, grads, optimizer state, state_dict."""
    d = 0.0
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


def optimizer_form(opt) -> tuple:
    """(capturable, lr a tensor): what optimizers.make_capturable changes."""
    g = opt.param_groups[0]
    return bool(g.get("capturable")), isinstance(g["lr"], torch.Tensor)


def match_optimizer_form(sg_opt, eager_opt) -> bool:
    """Give the eager twin the optimizer form stepgraph switched its own to (on CUDA: capturable,
    a device lr; optimizers.make_capturable), so the two run the same kernels and can be
    compared bitwise. Call after each stepgraph call, before the twin's: stepgraph switches at
    its capture, and not at all when it refuses the step (that call runs the user's form).
    Returns whether it switched the twin."""
    if optimizer_form(sg_opt) == optimizer_form(eager_opt):
        return False
    from stepgraph.optimizers import same_form
    same_form(eager_opt)
    assert optimizer_form(sg_opt) == optimizer_form(eager_opt), (optimizer_form(sg_opt), optimizer_form(eager_opt))
    return True


def graph_ops(step) -> dict:
    """How often each collective (and storage resize) appears in the step's last graph."""
    code = step.graph.code if step.stats.captures else ""
    return {op: code.count(f".{op}.default(") for op in COLLECTIVES}


# ---- GPU time and memory (test_cuda_fsdp2's accounting) -------------------------------------
def seconds_per_step(step, batches) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ids, tg in batches:
        step(ids, tg)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(batches)


def graph_pool_bytes(step) -> int:
    """Free bytes of the step's CUDA-graph private pool: blocks a replay uses for its
    temporaries but the allocator counts as free, so max_memory_allocated does not see them.
    (The pool's allocated blocks, e.g. static outputs, are counted already.) Only this step's
    pool: in a run of several test files, other steps' graphs still hold theirs (counting every
    pool read 411 MiB where this step's was 139 MiB, H100)."""
    if getattr(step, "_pool", None) is None:
        return 0   # no CUDA graph recorded (replay backend)
    segs = torch.cuda.memory._snapshot().get("segments", [])
    return sum(s["total_size"] - s.get("allocated_size", 0) for s in segs
               if tuple(s.get("segment_pool_id", (0, 0))) == tuple(step._pool))


def transient(step, batches, pool: int) -> int:
    """Bytes a step needs beyond what is allocated before it runs (both twins' state)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds_per_step(step, batches)
    return torch.cuda.max_memory_allocated() - base + pool


def state_bytes(model, opt) -> int:
    """One model's sharded state: local parameter shards and optimizer state."""
    loc = [getattr(t, "_local_tensor", t) for t in model.parameters()]
    loc += [getattr(v, "_local_tensor", v) for s in opt.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in loc)
