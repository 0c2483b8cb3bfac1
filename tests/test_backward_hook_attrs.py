"""Numbers a module's backward hooks read on the module they are given: a full backward (pre-)hook
scaling the grads by an annealed ``mod.grad_scale`` (fairseq's GradMultiply idiom as a hook).
Only forward hooks were scanned (capture/forward_attrs.py): replays kept the captured scale."""
import pytest
import torch
import torch.nn as nn

import stepgraph


def _run(kind, compiled):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    m[2].grad_scale = 1.0
    if kind == "full":
        m[2].register_full_backward_hook(lambda mod, gi, go: tuple(g * mod.grad_scale for g in gi))
    else:
        m[2].register_full_backward_pre_hook(lambda mod, go: tuple(g * mod.grad_scale for g in go))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()
    f = stepgraph.compile(step) if compiled else step
    for i in range(6):
        f(torch.full((3, 4), 1.0 + i))
        m[2].grad_scale = 1.0 / (2 + i)
    return [p.detach().clone() for p in m.parameters()], f


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_an_attribute_a_backward_hook_reads_changed_between_calls(kind):
    want, _ = _run(kind, False)
    got, f = _run(kind, True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert f.stats.replays >= 1
