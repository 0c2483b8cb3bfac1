"""Attributes the step's first call makes (no ``__init__`` set them): ``self.last_loss =
loss.item()`` on a trainer, ``self.in_shape = x.shape`` in a forward. The step's code was scanned
before its first call, when they did not exist, so they were never found: replays left
``last_loss`` at the captured call's value -- silently, the loop's logging read a frozen loss
(and the stored shape stayed the last captured batch's). Found again after the warm-up
(``PyValues.partial``); a stored shape is written after each replay like a stored literal."""
import pytest
import torch
from torch import nn

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class Trainer:
    def __init__(self, m, opt):
        self.m, self.opt = m, opt   # (last_loss, last_t: made by the first step)

    def step(self, x):
        loss = self.m(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.last_loss = loss.item()
        self.last_t = loss.detach()
        return loss.detach()


def _trainer(compiled):
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    t = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1))
    f = stepgraph.compile(t.step) if compiled else t.step
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(6):
        f(torch.randn(3, 4, generator=g))
        seen.append((t.last_loss, t.last_t.clone()))
    return f, seen


def test_a_number_the_first_call_stores_on_the_trainer_is_replayed():
    sg, got = _trainer(True)
    _, want = _trainer(False)
    assert [a for a, _ in got] == [b for b, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    assert sg.stats.replays == 4, sg.stats


class AE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(12, 4), nn.Linear(4, 12)

    def forward(self, x):
        self.in_shape = x.shape   # (read back below: the decoder's output takes the input's shape)
        return self.dec(self.enc(x.flatten(1))).view(self.in_shape)


def _ae(compiled, sizes):
    torch.manual_seed(0)
    m = AE()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)

    def step(x):
        loss = (m(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    f = stepgraph.compile(step) if compiled else step
    g = torch.Generator().manual_seed(1)
    seen = [(f(torch.randn(n, 3, 4, generator=g)), m.in_shape) for n in sizes]
    return f, seen, [p.detach().clone() for p in m.parameters()]


def test_a_shape_the_forward_stores_follows_the_batch():
    """A smaller last batch (drop_last=False): its graph stores its own shape, the full batch's
    graph stores the full one. It was refused (once found) or left stale (before)."""
    sizes = [4, 4, 4, 4, 3, 4, 4, 3, 4]
    sg, got, params = _ae(True, sizes)
    _, want, want_params = _ae(False, sizes)
    assert [s for _, s in got] == [s for _, s in want]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert sg.stats.replays >= 4, sg.stats
