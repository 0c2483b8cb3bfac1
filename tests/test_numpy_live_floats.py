"""numpy meeting a float the step reads live (a global or an ``args`` attribute the loop
anneals): CutMix's ``r = np.random.rand(1); if r < args.cutmix_prob`` raised a TypeError the user
never wrote at the capturing call (numpy gave up on the live float) and lost that call's update;
``np.exp(-10 * p)`` (DANN's schedule) did the same. Now numpy's scalar maths on it stays live,
and anything else computes on its value, guarded. Each call compared bitwise with eager."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class args:
    cutmix_prob = 0.5
    p = 0.1


def _world():
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _cutmix(m, opt, x, y):
    r = np.random.rand(1)
    if r < args.cutmix_prob:
        loss = F.cross_entropy(m(x * 0.5), y)
    else:
        loss = F.cross_entropy(m(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _dann(m, opt, x, y):
    alpha = 2.0 / (1.0 + np.exp(-10 * args.p)) - 1
    loss = F.cross_entropy(m(x), y) * alpha
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("body", [_cutmix, _dann])
def test_numpy_on_a_live_float_is_eagers(body):
    (me, oe), (mc, oc) = _world(), _world()
    step = stepgraph.compile(lambda x, y: body(mc, oc, x, y))
    for i in range(6):
        args.p = 0.1 * (i + 1)   # (annealed between calls, as DANN's p)
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        np.random.seed(i)
        want = body(me, oe, x, y)
        np.random.seed(i)
        got = step(x, y)
        assert torch.equal(want, got), (i, want, got)
        assert torch.equal(me.weight, mc.weight)
    if body is _dann:
        assert step.stats.captures == 1, step.stats.recaptures   # (np.exp of it is live)


it, epoch, per_epoch = 0, 0, 100


def test_float_of_a_moving_counter_says_to_drop_the_float_call(caplog):
    """DANN's ``p = float(i + epoch * len_dataloader) / total``: float() hands Python a plain copy,
    a graph per value; the recapture names the call and the fix (without it the number is live)."""
    m, opt = _world()

    @stepgraph.compile
    def step(x, y):
        p = float(it + epoch * per_epoch) / 1000
        loss = F.cross_entropy(m(x), y) * (1 + p)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    global it
    with caplog.at_level("WARNING", logger="stepgraph"):
        for it in range(4):
            step(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    assert "float() on test_numpy_live_floats.py" in caplog.text and "drop the float()" in caplog.text, caplog.text


def test_numpy_on_a_number_from_the_steps_arguments_is_live():
    """DANN's schedule from the iteration the loop passes, once the float() is dropped as the
    hint says: ``p = (i + epoch * n) / total; alpha = 2 / (1 + np.exp(-10 * p)) - 1``. numpy
    computed on the tracked number's value (guarded): a graph per call, after the hint's fix too
    (helper-91 F4). Now np.exp of it is an expression, as math.exp's."""
    (me, oe), (mc, oc) = _world(), _world()

    def body(m, opt, epoch, i, x, y):
        p = (i + epoch * 4) / 2 / 4
        alpha = 2.0 / (1.0 + np.exp(-10 * p)) - 1
        loss = F.cross_entropy(m(x), y) * alpha
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    step = stepgraph.compile(lambda epoch, i, x, y: body(mc, oc, epoch, i, x, y))
    for k in range(8):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        want, got = body(me, oe, k // 4, k % 4, x, y), step(k // 4, k % 4, x, y)
        assert torch.equal(want, got), k
        assert torch.equal(me.weight, mc.weight)
    assert step.stats.captures <= 2 and step.stats.replays >= 5, step.stats.recaptures


@pytest.mark.parametrize("fn", ["exp", "tanh", "log10", "maximum"])
def test_numpy_maths_on_a_live_float_is_numpys_own(fn):
    """``w = 2 / (1 + np.exp(-10 * p)) - 1`` with ``p`` a live float: recomputed with math.exp at
    each replay, the last bit differed from numpy's for some inputs (exp 4%, tanh 47%, log10 20%
    of helper-94's): float64 parameters diverged, silently. numpy's own function now; np.maximum
    (a warm-up's ``np.maximum(p, 0.01)``) stays live too."""
    ps = [0.001, 0.007, 0.024, 0.043, 0.052, 0.079, 0.096, 0.098, 0.109]
    f = {"exp": lambda p: 2.0 / (1.0 + np.exp(-10 * p)) - 1, "tanh": lambda p: np.tanh(3 * p),
         "log10": lambda p: np.log10(1 + 7 * p), "maximum": lambda p: np.maximum(p, 0.05)}[fn]

    def world():
        torch.manual_seed(0)
        m = nn.Linear(4, 1).double()
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def body(m, opt, x):
        w = f(args.p)
        loss = m(x).pow(2).mean() * w
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    (me, oe), (mc, oc) = world(), world()
    step = stepgraph.compile(lambda x: body(mc, oc, x))
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for p in ps:
        args.p = p
        assert torch.equal(body(me, oe, x), step(x)), p
        assert torch.equal(me.weight, mc.weight), p
    assert step.stats.captures <= 2, step.stats.recaptures


def test_np_isnan_of_a_value_read_behind_dropout_is_a_guarded_predicate():
    """Mean Teacher's ``assert not (np.isnan(loss.item()) or loss.item() > 1e5)`` with dropout in
    the model: numpy took the read value with float(), refused with a fix to drop a float() the
    user never wrote (helper-94 F10); math.isnan's guarded predicate now, as for math.isnan."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    @stepgraph.compile
    def step(x):
        loss = m(x).pow(2).mean()
        assert not (np.isnan(loss.item()) or loss.item() > 1e5), "Loss explosion: {}".format(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    for _ in range(4):
        step(torch.randn(5, 4))
    assert step.stats.captures == 1 and step.stats.replays == 2, step.stats
