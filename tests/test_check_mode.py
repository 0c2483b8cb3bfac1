"""check mode: the first N replays also run eagerly from the same state and are compared."""
import copy


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph
from parity import ce_step


def _setup():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.GELU(), nn.Linear(16, 4))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def test_check_mode_reports_equal_replays_and_keeps_eager_parity():
    m, opt = _setup()
    twin, topt = copy.deepcopy(m), None
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    step, eager = stepgraph.compile(ce_step(m, opt), check=2), ce_step(twin, topt)
    for i in range(6):
        torch.manual_seed(10 + i)
        a = step(*_batch(i))
        torch.manual_seed(10 + i)
        b = eager(*_batch(i))
        assert torch.equal(a, b)
    assert len(step.stats.check_reports) == 2
    assert all("equals eager" in r for r in step.stats.check_reports), step.stats.check_reports
    for p, q in zip(m.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_check_mode_finds_a_divergence(monkeypatch):
    """A replay that silently differs from eager (here: a value stepgraph's guards cannot see,
    an attribute of an object a function returns) is caught and named."""
    m, opt = _setup()
    m.eval()  # no dropout: only the baked scale differs
    class Scale:   # (slotted: not a record stepgraph tracks, so its value is invisible to guards)
        __slots__ = ("v",)
    scale = Scale()
    scale.v = 1.0

    def get_scale():
        return scale

    def step(x, y):
        loss = F.cross_entropy(m(x), y) * get_scale().v  # read at capture only: baked
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    sg = stepgraph.compile(step, check=1)
    sg(*_batch(0))
    sg(*_batch(1))
    scale.v = 3.0
    with pytest.warns(UserWarning, match="diverged from eager"):
        sg(*_batch(2))
    assert "diverged" in sg.stats.check_reports[0]


def test_check_env(monkeypatch):
    monkeypatch.setenv("STEPGRAPH_CHECK", "1")
    m, opt = _setup()
    sg = stepgraph.compile(ce_step(m, opt))
    for i in range(6):
        sg(*_batch(i))
    assert len(sg.stats.check_reports) == 3


def test_check_mode_with_a_scheduler_stepped_in_the_step_restores_it():
    """The eager shadow must start from the replay's starting point: the scheduler stepped inside
    the step (torchvision's segmentation recipe) and the lr it set. It was stepped twice per
    checked call: a false divergence reported, and the kept eager result trained on a wrong lr."""
    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda x: (1 - x / 8) ** 0.9)

        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            return loss
        return m, opt, step
    m, opt, s = build()
    m2, opt2, eager = build()
    step = stepgraph.compile(s, check=3)
    for i in range(6):
        step(*_batch(i))
        eager(*_batch(i))
        assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"], i
    assert all("equals eager" in r for r in step.stats.check_reports), step.stats.check_reports
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
