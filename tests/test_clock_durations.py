"""A duration the step measures itself: ``t0 = time.time()`` at its top, ``time.time() - t0`` at
its end, kept in a trainer attribute and a meter. Both clock reads used to be redone together
after each replay (the later one first): a duration of ~0 or negative, silently."""
import time

import torch
from torch import nn

import stepgraph


class _Meter:
    def __init__(self):
        self.val, self.sum, self.count = 0.0, 0.0, 0

    def update(self, v):
        self.val = v
        self.sum += v
        self.count += 1


def _run(compiled: bool, monkeypatch):
    ticks = [0.0]

    def clock():   # (each read one second later: eager's step reads it twice, 1 s apart)
        ticks[0] += 1.0
        return ticks[0]
    monkeypatch.setattr(time, "time", clock)
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    box, meter, seen = {"took": 0.0}, _Meter(), []

    def step(x):
        t0 = time.time()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        box["took"] = time.time() - t0
        return loss
    fn = stepgraph.compile(step) if compiled else step
    for _ in range(6):
        fn(torch.randn(8, 2))
        seen.append(box["took"])
    return seen, fn, model


def test_a_duration_timed_inside_the_step_is_the_replays_own(monkeypatch):
    want, _, m_eager = _run(False, monkeypatch)
    got, fn, m = _run(True, monkeypatch)
    assert fn.stats.replays >= 3, fn.stats
    assert want == [1.0] * 6
    assert all(d > 0 for d in got), got   # (was -1.0 at each replay: t1 read before t0)
    assert got[2:] == want[2:], got      # (the capture reads the clock itself: its duration is its own)
    assert torch.equal(m.weight, m_eager.weight)


def test_a_meter_of_durations_timed_inside_the_step(monkeypatch):
    """torchvision/timm: ``batch_time.update(time.time() - start)`` with ``start`` read at the
    step's top."""
    ticks = [0.0]

    def clock():
        ticks[0] += 1.0
        return ticks[0]
    monkeypatch.setattr(time, "time", clock)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = _Meter()

    @stepgraph.compile
    def step(x):
        start = time.time()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        meter.update(time.time() - start)
        return loss
    vals = []
    for _ in range(6):
        step(torch.randn(8, 2))
        vals.append(meter.val)
    assert step.stats.replays >= 3, step.stats
    assert vals[2:] == [1.0] * 4, vals
    assert meter.count == 6 and meter.sum > 0, (meter.count, meter.sum)
