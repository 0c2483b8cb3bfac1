"""What a trainer object holds and calls as ``self.criterion(out, y)``: a module, or a callable
object of the user's class. Swapped between live objects (a loss per phase, a head per task),
or changed in place (a focal loss's ``gamma``), each replayed the first one silently: the step's
code keyed only ``self``, so the held object was neither keyed nor read (a probe found it)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class FocalLoss:   # (no nn.Module: the callable object the user writes)
    def __init__(self, gamma):
        self.gamma = gamma

    def __call__(self, logits, y):
        logp = F.log_softmax(logits, -1).gather(1, y[:, None]).squeeze(1)
        return (-(1 - logp.exp()) ** self.gamma * logp).mean()


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = nn.Linear(4, 3)
        self.heads = [nn.Linear(3, 3), nn.Linear(3, 3)]
        self.opt = torch.optim.SGD([*self.model.parameters(), *self.heads[0].parameters(),
                                    *self.heads[1].parameters()], lr=0.1)
        self.crits = [nn.CrossEntropyLoss(weight=torch.tensor([1., 2., 3.])),
                      nn.CrossEntropyLoss(weight=torch.tensor([3., 1., 1.])), FocalLoss(2.0)]
        self.criterion, self.head = self.crits[0], self.heads[0]

    def step(self, x, y):
        loss = self.criterion(self.head(self.model(x)), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.detach()


def phase_swap(k, t):
    t.criterion = t.crits[(k // 2) % 2]
    t.head = t.heads[(k // 3) % 2]


def focal(k, t):
    t.criterion = t.crits[2]
    t.crits[2].gamma = 2.0 if k < 3 else 0.5


@pytest.mark.parametrize("change", [phase_swap, focal])
def test_a_held_loss_or_head_swapped_or_changed_between_calls_is_what_the_replay_uses(change):
    e, c = Trainer(), Trainer()
    sg = stepgraph.compile(c.step)
    g = torch.Generator().manual_seed(1)
    for k in range(8):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        change(k, e), change(k, c)
        want, got = e.step(x, y), sg(x, y)
        assert torch.equal(want, got), (k, want, got, sg.stats.recaptures)
    for p, q in zip(e.opt.param_groups[0]["params"], c.opt.param_groups[0]["params"]):
        assert torch.equal(p, q)
    assert sg.stats.replays >= 2
