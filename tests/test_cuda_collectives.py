"""Collectives the step calls itself, on one GPU (world size 1, NCCL). Skipped without CUDA.

capture/collectives.py traces `dist.all_reduce`, `all_gather_into_tensor`, `all_gather` and
`broadcast` as PyTorch's functional collectives; on the CPU (gloo, 2 ranks) test_distributed
checks parity. Here the same step must record as one CUDA graph over NCCL (no fallback to the
replay backend) and stay equal to an eager twin whose optimizer takes the capturable form
stepgraph switches to.

    STEPGRAPH_TEST_CUDA=1 python -m pytest -q tests/test_cuda_collectives.py
"""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def collectives_step(model, opt, center):
    def step(x, y, shift):
        dist.broadcast(shift, src=0)
        feats = model[0](x + shift)
        everyone = torch.empty(dist.get_world_size() * feats.shape[0], feats.shape[1], device=feats.device)
        dist.all_gather_into_tensor(everyone, feats.detach())
        parts = [torch.empty_like(feats) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, feats.detach())
        loss = F.cross_entropy(model[1:](feats), y) + 1e-3 * (feats @ everyone.T).logsumexp(1).mean() \
            + 1e-3 * (feats * parts[-1]).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            c = feats.sum(0, keepdim=True)
            dist.all_reduce(c)
            center.mul_(0.9).add_(c / len(feats), alpha=0.1)
        return loss
    return step


def test_the_steps_own_collectives_record_as_one_cuda_graph(nccl_world_of_one):
    from stepgraph.optimizers import same_form
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).cuda()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b))
    ca, cb = (torch.zeros(1, 16, device="cuda") for _ in range(2))
    sg, eager = stepgraph.compile(collectives_step(a, oa, ca)), collectives_step(b, ob, cb)
    g = torch.Generator().manual_seed(1)
    diffs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(7):
            x, y = torch.randn(8, 8, generator=g).cuda(), torch.randint(0, 4, (8,), generator=g).cuda()
            if i == 1:
                same_form(ob)
            shift = torch.full((1, 8), 0.5, device="cuda")
            la, lb = sg(x, y, shift.clone()), eager(x, y, shift.clone())
            d = [(p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())]
            diffs.append(max([abs(la.item() - lb.item()), (ca - cb).abs().max().item()] + d))
    fallback = [str(w.message) for w in caught if "chose 'replay'" in str(w.message)]
    assert not fallback, fallback[:2]
    assert sg.stats.captures == 1 and sg.stats.replays == 5, sg.stats
    assert sg.captures[0].backend == "cudagraph", sg.explain()
    assert "all_reduce" in sg.graph.code and "all_gather" in sg.graph.code
    assert max(diffs) <= 1e-6, diffs


def test_collectives_over_gloo_on_cuda_tensors_are_refused_before_they_run(tmp_path):
    """gloo stages CUDA tensors through the host: the functional form's wait killed the process
    while tracing (MoCo v2 on a gloo group, H200: SIGSEGV). Refused at the user's line with the
    fix (an NCCL group); the refused call ran eagerly, so the model holds eager's result."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).cuda()
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        oa, ob = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (a, b))
        ca, cb = (torch.zeros(1, 16, device="cuda") for _ in range(2))
        sg, eager = stepgraph.compile(collectives_step(a, oa, ca)), collectives_step(b, ob, cb)
        g = torch.Generator().manual_seed(1)
        err = None
        for _ in range(2):
            x, y = torch.randn(8, 8, generator=g).cuda(), torch.randint(0, 4, (8,), generator=g).cuda()
            shift = torch.full((1, 8), 0.5, device="cuda")
            eager(x, y, shift.clone())
            try:
                sg(x, y, shift.clone())
            except stepgraph.CaptureError as e:
                err = str(e)
        assert err is not None and "gloo" in err and "nccl" in err.lower(), err
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    finally:
        dist.destroy_process_group()
