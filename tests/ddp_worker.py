"""One rank of tests/test_distributed.py's multi-process scenarios (launched by torchrun).

usage: torchrun --nproc_per_node 2 tests/ddp_worker.py SCENARIO OUT_DIR
Each rank writes OUT_DIR/rank{r}.json: per scenario, what it measured against an eager DDP twin.
"""
import contextlib
import copy
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import stepgraph  # noqa: E402
from stepgraph.tools import models  # noqa: E402

RANK = int(os.environ["RANK"])
DEVICE = os.environ.get("DDP_DEVICE", "cpu")


def twins(model_fn, opt_fn, **ddp_kw):
    torch.manual_seed(0)
    base = model_fn().to(DEVICE)
    ids = [RANK % torch.cuda.device_count()] if DEVICE == "cuda" else None
    a = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=ids, **ddp_kw)
    b = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=ids, **ddp_kw)
    return a, opt_fn(a.parameters()), b, opt_fn(b.parameters())


def max_diff(a_mod, a_opt, b_mod, b_opt) -> float:
    d = 0.0
    for x, y in zip(list(a_mod.parameters()) + list(a_mod.buffers()),
                    list(b_mod.parameters()) + list(b_mod.buffers())):
        d = max(d, (x.double() - y.double()).abs().max().item())
    for p, q in zip(a_mod.parameters(), b_mod.parameters()):
        sa, sb = a_opt.state.get(p, {}), b_opt.state.get(q, {})
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                d = max(d, (sa[k].double().cpu() - sb[k].double().cpu()).abs().max().item())
    return d


def plain_step(model, opt, loss_fn):
    return models.train_step(model, loss_fn, opt)  # (the argument order of accumulating_step)


def accumulating_step(model, opt, loss_fn):
    """Two micro-batches in one step; DDP syncs only the second backward (no_sync)."""
    def step(x, y):
        half = x.shape[0] // 2
        with model.no_sync():
            loss_fn(model, x[:half], y[:half]).backward()
        loss = loss_fn(model, x[half:], y[half:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def mlp_bn():
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 4))


def same_form(opt) -> None:
    """At the capturing call on the GPU, the eager twin takes the optimizer form stepgraph switches
    to (PyTorch's capturable path), so the comparison is kernel for kernel."""
    if DEVICE == "cuda":
        from stepgraph.optimizers import same_form
        same_form(opt)


def run_parity(name, model_fn, opt_fn, step_fn, make_batch, calls=6, backend="auto", **ddp_kw):
    a, oa, b, ob = twins(model_fn, opt_fn, **ddp_kw)
    sg, eager = stepgraph.compile(step_fn(a, oa, _LOSS), backend=backend), step_fn(b, ob, _LOSS)
    g = torch.Generator().manual_seed(100 + RANK)  # every rank its own data
    losses = []
    for i in range(calls):
        batch = [t.to(DEVICE) for t in make_batch(g)]
        if i == 1:
            same_form(ob)
        la, lb = sg(*batch), eager(*batch)
        losses.append(abs(la.item() - lb.item()))
    return {"max_diff": max_diff(a, oa, b, ob), "loss_diff": max(losses), "captures": sg.stats.captures,
            "replays": sg.stats.replays, "recaptures": sg.stats.recaptures,
            "explain_has_collective": "collectives in the graph" in sg.explain() and "all_reduce" in sg.graph.code,
            "loss_rel": max(losses) / abs(lb.item())}


def _LOSS(model, x, y):
    out = model(x)
    if out.dim() == 3:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy(out, y)


def batch_mlp(g, n=8):
    return torch.randn(n, 8, generator=g).to(DEVICE), torch.randint(0, 4, (n,), generator=g).to(DEVICE)


def batch_gpt(g):
    ids = torch.randint(0, 64, (2, 16), generator=g)
    return ids.to(DEVICE), torch.roll(ids, -1, 1).to(DEVICE)


def gpt_model():
    return models.GPT(layers=2, d=32, heads=2, vocab=64, seq=16, dropout=0.0, sdpa=False)


def scenario_parity(out):
    out["mlp_bn_adamw"] = run_parity("mlp", mlp_bn, lambda p: torch.optim.AdamW(p, lr=1e-2), plain_step, batch_mlp)
    out["gpt_sgd_buckets"] = run_parity(
        "gpt", gpt_model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), plain_step, batch_gpt,
        bucket_cap_mb=0.01)
    out["bucket_view_static_graph"] = run_parity(
        "views", mlp_bn, lambda p: torch.optim.AdamW(p, lr=1e-2), plain_step, batch_mlp,
        gradient_as_bucket_view=True, static_graph=True)
    out["accumulate_no_sync"] = run_parity("acc", mlp_bn, lambda p: torch.optim.Adam(p, lr=1e-2),
                                           accumulating_step, batch_mlp)
    if os.environ.get("DDP_INDUCTOR", "1") == "1":
        out["inductor"] = run_parity("ind", lambda: nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)),
                                     lambda p: torch.optim.AdamW(p, lr=1e-2), plain_step, batch_mlp,
                                     backend="inductor")
    # Accumulation across calls: backward-only steps under no_sync(), every 3rd call syncs and
    # the optimizer steps outside the step function.
    a, oa, b, ob = twins(mlp_bn, lambda p: torch.optim.SGD(p, lr=0.1))

    def backward_only(model):
        def step(x, y):
            loss = _LOSS(model, x, y)
            loss.backward()
            return loss
        return step
    sg, eager = stepgraph.compile(backward_only(a)), backward_only(b)
    g = torch.Generator().manual_seed(7 + RANK)
    for i in range(9):
        x, y = batch_mlp(g)
        for f, m, o in ((sg, a, oa), (eager, b, ob)):
            ctx = m.no_sync() if i % 3 != 2 else contextlib.nullcontext()
            with ctx:
                f(x, y)
            if i % 3 == 2:
                o.step()
                o.zero_grad()
    out["accumulate_across_calls"] = {"max_diff": max_diff(a, oa, b, ob), "captures": sg.stats.captures,
                                      "recaptures": sg.stats.recaptures}

    # A forward in the step whose backward runs outside it: refused; no state half updated.
    a, oa, b, ob = twins(lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)),
                         lambda p: torch.optim.SGD(p, lr=0.1))
    sg, eager = stepgraph.compile(lambda x, y: _LOSS(a, x, y)), (lambda x, y: _LOSS(b, x, y))
    err = None
    g = torch.Generator().manual_seed(3 + RANK)
    for i in range(3):
        x, y = batch_mlp(g)
        try:
            la = sg(x, y)
        except stepgraph.CaptureError as e:
            err = str(e)
            la = None
        lb = eager(x, y)
        lb.backward()
        ob.step()
        ob.zero_grad()
        if la is not None:
            la.backward()
        else:  # the refused call returned nothing: the user reruns it eagerly
            _LOSS(a, x, y).backward()
        oa.step()
        oa.zero_grad()
    out["backward_outside"] = {"error": err, "max_diff": max_diff(a, oa, b, ob)}


def collectives_step(model, opt, center, world):
    """Collectives the step calls itself (no DDP): rank 0's offsets broadcast, every rank's
    features gathered (MoCo/SimCLR negatives), a hand-written gradient all-reduce and DINO's
    center update (collectives.py traces them as functional collectives)."""
    def step(x, y, shift):
        dist.broadcast(shift, src=0)
        feats = model[0](x + shift)
        everyone = torch.empty(world * feats.shape[0], feats.shape[1], device=feats.device)
        dist.all_gather_into_tensor(everyone, feats.detach())
        parts = [torch.empty_like(feats) for _ in range(world)]
        dist.all_gather(parts, feats.detach())
        loss = F.cross_entropy(model[1:](feats), y) + 1e-3 * (feats @ everyone.T).logsumexp(1).mean() \
            + 1e-3 * (feats * parts[-1]).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            c = feats.sum(0, keepdim=True)
            dist.all_reduce(c, op=dist.ReduceOp.SUM)
            center.mul_(0.9).add_(c / (len(feats) * world), alpha=0.1)
        return loss
    return step


def scenario_direct_collectives(out):
    world = dist.get_world_size()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(DEVICE)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b))
    ca, cb = (torch.zeros(1, 16, device=DEVICE) for _ in range(2))
    sg, eager = stepgraph.compile(collectives_step(a, oa, ca, world)), collectives_step(b, ob, cb, world)
    g = torch.Generator().manual_seed(100 + RANK)
    diffs = []
    for i in range(6):
        x, y = batch_mlp(g)
        shift = torch.full((1, 8), float(RANK), device=DEVICE)
        if i == 1:   # (2 H200s over NCCL: 4e-7 apart without it)
            same_form(ob)
        la, lb = sg(x, y, shift.clone()), eager(x, y, shift.clone())
        diffs.append(abs(la.item() - lb.item()))
    out["collectives"] = {"max_diff": max(max_diff(a, oa, b, ob), (ca - cb).abs().max().item()),
                          "loss_diff": max(diffs), "captures": sg.stats.captures, "replays": sg.stats.replays,
                          "recaptures": sg.stats.recaptures, "graph_has_collective": "all_reduce" in sg.graph.code}

    def async_step(x, y):   # a Work handle in the user's hands: refused at this line
        loss = F.cross_entropy(a(x), y)
        loss.backward()
        work = dist.all_reduce(a[0].weight.grad, async_op=True)
        work.wait()
        return loss
    sg = stepgraph.compile(async_step)
    err = None
    for _ in range(3):
        try:
            sg(*batch_mlp(g))
        except stepgraph.CaptureError as e:
            err = str(e)
    out["async"] = {"error": err}


def scenario_direct_disagree(out):
    """A step that all-reduces its gradients itself (no DDP), rank 1's batches smaller from the
    start: the warm-up saw the collective, so the ranks meet before the first capture and both
    refuse (the graphs would differ)."""
    torch.manual_seed(0)
    m = nn.Linear(8, 4).to(DEVICE)
    o = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad)
        o.step()
        o.zero_grad()
        return loss
    sg = stepgraph.compile(step)
    g = torch.Generator().manual_seed(RANK)
    t0 = time.time()
    try:
        for _ in range(3):
            sg(*batch_mlp(g, 8 if RANK == 0 else 6))
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.time() - t0


def scenario_disagree_shapes(out):
    """Rank 1's batches are smaller from the start: both ranks capture, with different shapes."""
    a, oa, _, _ = twins(mlp_bn, lambda p: torch.optim.SGD(p, lr=0.1))
    sg = stepgraph.compile(plain_step(a, oa, _LOSS))
    g = torch.Generator().manual_seed(RANK)
    n = 8 if RANK == 0 else 6
    t0 = time.time()
    try:
        for _ in range(3):
            sg(*batch_mlp(g, n))
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.time() - t0


def scenario_one_rank_recaptures(out):
    """At call 4 only rank 1 sees a new batch shape: it recaptures while rank 0 replays. Rank 1
    then stays alive (a user who catches the error), so rank 0 cannot rely on its peer dying."""
    a, oa, _, _ = twins(mlp_bn, lambda p: torch.optim.SGD(p, lr=0.1))
    sg = stepgraph.compile(plain_step(a, oa, _LOSS))
    g = torch.Generator().manual_seed(RANK)
    t0 = time.time()
    try:
        for i in range(8):
            n = 6 if (RANK == 1 and i == 3) else 8
            sg(*batch_mlp(g, n)).item()  # a host sync each call, as a logging loop would do
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.time() - t0
    if RANK == 1:
        time.sleep(float(os.environ.get("LINGER", "12")))


def scenario_host_read_after_allreduce(out):
    """A host read after the backward, whose gradients DDP all-reduced (``if gate.item() > 0:
    opt.step()``, a skip-step guard): at call 5 it differs on rank 0 only. The graph's first
    segment (forward, backward, all-reduce) has run when the read misses; capturing that call
    again would all-reduce a second time on rank 0 alone: refused (test_distributed.py). With
    SAME_GATE=1 the value changes on every rank at the same call: both recapture, and match eager."""
    a, oa, b, ob = twins(mlp_bn, lambda p: torch.optim.SGD(p, lr=0.1))

    def gated(model, opt):
        def step(x, y, gate):
            loss = _LOSS(model, x, y)
            loss.backward()
            if gate.item() > 0:
                opt.step()
            opt.zero_grad()
            return loss
        return step
    sg, eager = stepgraph.compile(gated(a, oa)), gated(b, ob)
    g = torch.Generator().manual_seed(RANK)
    t0 = time.time()
    try:
        losses = []
        for i in range(8):
            x, y = batch_mlp(g)
            off = i == 4 and (RANK == 0 or os.environ.get("SAME_GATE"))   # (SAME_GATE: on every rank)
            gate = torch.tensor(0 if off else 1, device=DEVICE)
            la, lb = sg(x, y, gate), eager(x, y, gate)
            losses.append(abs(la.item() - lb.item()))
        out["error"] = None
        out["max_diff"], out["loss_diff"] = max_diff(a, oa, b, ob), max(losses)
        out["captures"], out["replays"] = sg.stats.captures, sg.stats.replays
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.time() - t0


def main():
    scenario, out_dir = sys.argv[1], sys.argv[2]
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    if DEVICE == "cuda":
        torch.cuda.set_device(RANK % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=int(os.environ.get("PG_TIMEOUT", "60"))))
    out: dict = {}
    globals()[f"scenario_{scenario}"](out)
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(out, f)
    if not out.get("error"):  # (an error scenario breaks the group on purpose)
        dist.barrier()
    # Skip the group's teardown: gloo's sometimes aborts at exit ("terminate called without an
    # active exception"), with or without stepgraph, which would only add noise here.
    os._exit(0)


if __name__ == "__main__":
    main()
