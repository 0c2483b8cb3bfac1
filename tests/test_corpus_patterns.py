"""Patterns found by the real-program corpus (clients/), each reduced to a minimal step and
compared with eager PyTorch: capture on one batch, replay on fresh ones, bitwise on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def same(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n} differs from eager"
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n


class TransposedLinear(nn.Linear):
    """pytorch/examples mnist_forward_forward's Layer: ``torch.mm(x, self.weight.T)``; ``.T`` reads
    as a new tensor object at every access. It owns its optimizer, as that Layer does."""

    def __init__(self, a, b):
        super().__init__(a, b)
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)

    def forward(self, x):
        return torch.relu(torch.mm(x, self.weight.T) + self.bias.unsqueeze(0))


def test_a_view_attribute_of_a_parameter_in_forward_is_not_a_python_value():
    """``self.weight.T`` in a forward (and ``.data``, ``.mT``) was keyed as a Python value by
    identity: a new tensor each read, so the capture was refused as "the step changes the
    Python value self.weight.T" (or recaptured at random when CPython reused the address). It
    is the parameter itself, which the graph reads: captured, bitwise eager."""
    torch.manual_seed(0)
    m = nn.Sequential(TransposedLinear(8, 16), nn.Linear(16, 4))
    m2 = copy.deepcopy(m)
    opt, opt2 = torch.optim.Adam(m.parameters(), lr=1e-2), torch.optim.Adam(m2.parameters(), lr=1e-2)

    def make(model, o):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
            return loss
        return step
    sg, eager = stepgraph.compile(make(m, opt)), make(m2, opt2)
    g = torch.Generator().manual_seed(1)
    for k in range(6):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        assert torch.equal(sg(x, y), eager(x, y)), k
        same(m, m2)
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats


def test_a_step_called_with_each_layer_as_self_trains_each_layer_like_eager():
    """Forward-Forward: one step function, called with each layer (owning its optimizer) as
    its first argument; every layer gets its own graph and trains as eager."""
    torch.manual_seed(0)
    layers = [TransposedLinear(8, 8), TransposedLinear(8, 8)]
    twins = copy.deepcopy(layers)

    def step(self, x_pos, x_neg):
        g_pos = self.forward(x_pos).pow(2).mean(1)
        g_neg = self.forward(x_neg).pow(2).mean(1)
        loss = torch.log1p(torch.exp(torch.cat([-g_pos + 2.0, g_neg - 2.0]))).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss
    sg = stepgraph.compile(step)
    g = torch.Generator().manual_seed(2)
    x_pos, x_neg = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    for a, b in zip(layers, twins):
        for k in range(4):
            assert torch.equal(sg(a, x_pos, x_neg), step(b, x_pos, x_neg)), k
            same(a, b)
        x_pos, x_neg = a(x_pos).detach(), a(x_neg).detach()
    assert sg.stats.replays >= 4, sg.stats
