"""``torch.tensor([t1, t2])`` of tensors the step computed (Lightning's ``grad_norm`` utility
builds its total norm this way) reads their values on the host: each replay must compute it
from that call's tensors, not hand back the capture's values."""
from __future__ import annotations

import torch

import stepgraph


def _make(dtype=None):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        loss = m(x).square().mean()
        loss.backward()
        norms = [p.grad.norm() for p in m.parameters()]
        total = torch.tensor(norms, dtype=dtype).norm()
        nested = torch.as_tensor([[norms[0], 2.0], [norms[1], norms[2]]])
        opt.step()
        opt.zero_grad()
        return loss, total, nested
    return step


def test_torch_tensor_of_step_tensors_is_recomputed_at_each_replay():
    for dtype in (None, torch.float64, torch.bfloat16):
        step, eager = stepgraph.compile(_make(dtype)), _make(dtype)
        for k in range(6):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(k))
            got, want = step(x), eager(x)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b), (dtype, k, a, b)
        assert (step.stats.eager_calls, step.stats.captures, step.stats.replays) == (1, 1, 4), step.stats
