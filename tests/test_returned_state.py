"""A step that returns the metrics dict it keeps (a global ``info``, a learner's ``self.info``:
``info['n'] += 1; return info``, as RL learners do). The count is written back into the dict
after each replay; the returned one held the capture's count, silently (a probe found it).
Compared with an eager twin at every call. (The returned dict is not the user's object after a
replay, footgun (ret): tests/test_footguns.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class Learner:
    def __init__(self):
        torch.manual_seed(0)
        self.model = nn.Linear(8, 4)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.info = {"loss": None, "n": 0, "lr": 1e-2, "updates": [0, 0]}

    def step(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.info["loss"] = loss.detach()
        self.info["n"] += 1
        self.info["updates"][1] += 2
        return self.info


@pytest.mark.parametrize("shape", ["dict", "tuple"])
def test_a_kept_dict_the_step_returns_holds_this_calls_counts(shape):
    e, c = Learner(), Learner()
    sg = stepgraph.compile(c.step)
    g = torch.Generator().manual_seed(1)
    for k in range(6):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        want, got = e.step(x, y), sg(x, y)
        if shape == "tuple":
            want, got = (want["n"], want), (got["n"], got)
        assert torch.equal(want["loss"] if shape == "dict" else want[1]["loss"],
                           got["loss"] if shape == "dict" else got[1]["loss"])
        wd, gd = (want, got) if shape == "dict" else (want[1], got[1])
        assert (wd["n"], wd["lr"], wd["updates"]) == (gd["n"], gd["lr"], gd["updates"]) == \
            (c.info["n"], c.info["lr"], c.info["updates"]), (k, gd, c.info)
    assert sg.stats.replays >= 3, sg.stats.recaptures
