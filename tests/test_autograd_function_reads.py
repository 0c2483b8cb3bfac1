"""Numbers a user ``torch.autograd.Function`` reads outside its arguments: DANN's gradient
reversal scale as a global read in ``backward``, read in ``forward`` into ``ctx``, or a class
attribute. ``Fn.apply`` runs them through torch's code, so they were never scanned: replays kept
the captured scale, silently (0.28 after 5 calls, helper-91). capture/chains.autograd_parts."""
import pytest
import torch
import torch.nn as nn

import stepgraph

LAMBDA = 1.0


class GlobalInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -LAMBDA * g


class GlobalInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.lambd = LAMBDA
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lambd * g


class ClassAttribute(torch.autograd.Function):
    lambd = 1.0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ClassAttribute.lambd * g


class Net(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.a, self.b = fn, nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.fn.apply(self.a(x)))


def _run(fn, compiled):
    global LAMBDA
    torch.manual_seed(0)
    LAMBDA = ClassAttribute.lambd = 1.0
    m = Net(fn)
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
        LAMBDA = ClassAttribute.lambd = 2.0 / (1 + 10 ** (i / 3))   # (DANN's schedule, roughly)
    return [p.detach().clone() for p in m.parameters()], f


@pytest.mark.parametrize("fn", [GlobalInBackward, GlobalInForward, ClassAttribute])
def test_a_number_an_autograd_function_reads_changed_between_calls(fn):
    want, _ = _run(fn, False)
    got, f = _run(fn, True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert f.stats.replays >= 1
