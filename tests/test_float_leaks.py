"""No stepgraph float left in the user's objects after a capture (capture/floatleaks.py).

While tracing, live floats are float subclasses carrying a graph node. ReduceLROnPlateau stepped
in the step copied one into its ``_last_lr`` (a checkpoint of the scheduler then failed
``torch.load``'s default ``weights_only=True``), and ``log.append(("loss", step, loss.item()))``
left one in the user's list (``type(x) is float`` false). Found by probes.
"""
import io

import torch
import torch.nn.functional as F
from torch import nn

import stepgraph


def _model():
    torch.manual_seed(0)
    m = nn.Linear(8, 4)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _batch(k):
    g = torch.Generator().manual_seed(k)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def test_a_plateau_scheduler_stepped_in_the_step_keeps_plain_floats_and_its_checkpoint_loads():
    m, opt = _model()
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=100)

    def step(x, y, val_loss):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step(val_loss)
        return loss
    sg = stepgraph.compile(step)
    for k in range(4):
        sg(*_batch(k), 1.0)
        assert all(type(v) is float for v in sched._last_lr), (k, [type(v) for v in sched._last_lr])
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf)["_last_lr"] == [0.1]   # (weights_only=True, the default)


def test_a_read_value_logged_in_a_tuple_is_a_plain_float():
    m, opt = _model()
    log = []

    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        log.append(("loss", 3, loss.item()))   # (warned: replays do not append)
        return loss
    sg = stepgraph.compile(step)
    for k in range(2):
        sg(*_batch(k))
    assert [type(v) for v in log[-1]] == [str, int, float], [type(v) for v in log[-1]]
