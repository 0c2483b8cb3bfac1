"""Buffers the step rebinds (DINO's ``DINOLoss.update_center``: ``self.center = self.center * m
+ batch_center * (1 - m)``; a custom BatchNorm's ``self.running_mean = ...``): one graph, which
copies the new value into the buffer (capture/rebound.py). Before, the step was refused ("the
step changes the Python value self.center")."""
import pytest
import torch
from torch import nn

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class CenteredLoss(nn.Module):
    def __init__(self, momentum=0.9):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("center", torch.zeros(1, 4))

    def forward(self, s, t):
        loss = ((s - (t - self.center)) ** 2).mean()
        self.update_center(t)
        return loss

    @torch.no_grad()
    def update_center(self, t):
        self.center = self.center * self.momentum + t.mean(0, keepdim=True) * (1 - self.momentum)


class RunningNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running_mean = 0.9 * self.running_mean + 0.1 * x.mean(0)
                self.steps = self.steps + 1
        return x - self.running_mean


def _run(compiled, make_crit, calls=6):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    crit = make_crit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        if isinstance(crit, CenteredLoss):
            loss = crit(model(x), x * 2)
        else:
            loss = crit(model(x)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    f = stepgraph.compile(step) if compiled else step
    g = torch.Generator().manual_seed(1)
    losses = [f(torch.randn(8, 4, generator=g)).detach() for _ in range(calls)]
    return losses, dict(crit.named_buffers()), list(model.parameters()), getattr(f, "stats", None)


@pytest.mark.parametrize("make", [CenteredLoss, lambda: RunningNorm(4)], ids=["dino_center", "running_mean"])
def test_a_rebound_buffer_is_one_graph_equal_to_eager(make):
    got, gb, gp, stats = _run(True, make)
    want, wb, wp, _ = _run(False, make)
    for a, b in zip(got + gp, want + wp):
        assert torch.equal(a, b)
    assert gb.keys() == wb.keys()
    for k in gb:
        assert torch.equal(gb[k], wb[k]), k
    assert stats.captures == 1 and stats.replays == 4, stats


def test_a_buffer_rebound_to_another_shape_is_still_correct():
    class Grow(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(0))

        def forward(self, x):
            self.seen = torch.cat([self.seen, x.detach().mean(0, keepdim=True)[:, 0]])
            return x * 2
    got, gb, gp, stats = _run(True, Grow, calls=4)
    want, wb, wp, _ = _run(False, Grow, calls=4)
    for a, b in zip(got + gp, want + wp):
        assert torch.equal(a, b)
    assert torch.equal(gb["seen"], wb["seen"])


def test_a_buffer_counted_in_place_outside_the_step_is_no_new_registration():
    """ema_pytorch's ``EMA.update()``, called after the step: ``self.step += 1`` on a registered
    buffer adds in place and assigns the same tensor back. That fired the buffer-registration hook,
    read as "a module parameter, buffer or submodule was assigned": a capture at every call, none
    replayed (helper-77)."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    m.register_buffer("count", torch.zeros((), dtype=torch.long))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    f = stepgraph.compile(step)
    for i in range(6):
        f(torch.randn(3, 4))
        m.count += 1
    assert (f.stats.captures, f.stats.replays) == (1, 4), f.stats
    assert int(m.count) == 6
