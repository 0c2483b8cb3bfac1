"""Slots the step reads that hold more than numbers: a function rebound between calls (a global,
an attribute, a closure cell, a dict entry, a library module's attribute), a ``functools.partial``
whose keywords the loop changes in place, a mutable default argument used as state, and the
environment (``os.environ``, ``os.getenv``). Each replayed the first call's values silently
(found by a probe); each is compared with an eager twin here, bitwise."""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


def batch(k, n=6, d=8, classes=4):
    g = torch.Generator().manual_seed(700 + k)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def twins(world, calls=6, change=lambda k, w: None):
    """Runs ``world()``'s step eagerly and compiled side by side; ``change(k, w)`` changes each
    world before call ``k``. Compares outputs, parameters and ``w['py']()`` at every call."""
    e, c = world(), world()
    sg = stepgraph.compile(c["step"])
    for k in range(calls):
        change(k, e), change(k, c)
        want, got = e["step"](*batch(k)), sg(*batch(k))
        assert torch.equal(want, got), (k, want, got, sg.stats.recaptures)
        for p, q in zip(e["model"].parameters(), c["model"].parameters()):
            assert torch.equal(p, q), k
        assert e.get("py", lambda: None)() == c.get("py", lambda: None)(), k
    return sg


def sgd_world(make_loss):
    """A world whose step computes ``make_loss(w)(out, y)``, ``w`` the world's dict (which the
    function closes over: the slots it reads are rooted there)."""
    def world():
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        w = {"model": model}
        loss_of = make_loss(w)

        def step(x, y):
            loss = loss_of(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        w["step"] = step
        return w
    return world


def ce(o, y):
    return F.cross_entropy(o, y)


def ce_double(o, y):
    return 2.0 * F.cross_entropy(o, y)


# ---- 1. a function the step calls, rebound -------------------------------------------------
_SRC = """
def make(model, opt):
    def step(x, y):
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        return loss.detach()
    return step
"""


def test_a_global_function_rebound_recaptures():
    def world():
        g = {"loss_fn": ce}
        exec(_SRC, g)
        model = net()
        return {"model": model, "g": g, "step": g["make"](model, torch.optim.SGD(model.parameters(), lr=0.1))}

    def change(k, w):
        w["g"]["loss_fn"] = ce_double if k in (3, 4) else ce
    sg = twins(world, 7, change)
    assert any("loss_fn" in r and "ce_double" in r for r in sg.stats.recaptures), sg.stats.recaptures
    assert sg.stats.captures <= 3, sg.stats.recaptures


class Holder:
    pass


def test_an_attribute_function_rebound_recaptures():
    def world():
        w = sgd_world(lambda w: lambda o, y: w["obj"].criterion(o, y))()
        w["obj"] = Holder()
        w["obj"].criterion = ce
        return w

    def change(k, w):
        if k == 3:
            w["obj"].criterion = ce_double
    sg = twins(world, 6, change)
    assert any("criterion" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_closure_cell_function_rebound_recaptures():
    def world():
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        criterion = ce

        def step(x, y):
            loss = criterion(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        def rebind(f):
            nonlocal criterion
            criterion = f
        return {"model": model, "step": step, "rebind": rebind}

    def change(k, w):
        if k == 3:
            w["rebind"](ce_double)
    sg = twins(world, 6, change)
    assert any("criterion" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_dict_entry_rebound_to_another_library_function_recaptures():
    def world():
        w = sgd_world(lambda w: lambda o, y: w["crit"]["f"](o, y))()
        w["crit"] = {"f": F.cross_entropy}
        return w

    def change(k, w):
        if k == 3:
            w["crit"]["f"] = F.multi_margin_loss
    sg = twins(world, 6, change)
    assert any("['f']" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_library_module_function_monkeypatched_recaptures(monkeypatch):
    def change(k, w):
        if k == 3:
            monkeypatch.setattr(F, "cross_entropy", F.multi_margin_loss)
    sg = twins(sgd_world(lambda w: lambda o, y: F.cross_entropy(o, y)), 6, change)
    assert any("F.cross_entropy" in r and "multi_margin_loss" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_lambda_with_the_same_code_and_a_new_closure_recaptures():
    def mk(scale):
        return lambda loss: loss * scale

    def world():
        w = sgd_world(lambda w: lambda o, y: w["obj"].post(F.cross_entropy(o, y)))()
        w["obj"] = Holder()
        w["obj"].post = mk(1.0)
        return w

    def change(k, w):
        if k == 3:
            w["obj"].post = mk(3.0)
    sg = twins(world, 6, change)
    assert any("post" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_new_lambda_each_call_is_a_new_function():
    # (keyed by identity, as a lambda passed as an argument is: correct, one graph per call)
    def world():
        w = sgd_world(lambda w: lambda o, y: w["hooks"]["post"](F.cross_entropy(o, y)))()
        w["hooks"] = {}
        return w

    def change(k, w):
        epoch = k // 3
        w["hooks"]["post"] = lambda loss: loss * (1.0 + epoch)
    sg = twins(world, 7, change)
    assert any("['post']" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_partial_rebound_then_its_new_keywords_changed_in_place_recaptures():
    def world():
        w = sgd_world(lambda w: lambda o, y: w["cfg"]["loss_fn"](o, y))()
        w["cfg"] = {"loss_fn": functools.partial(focal, gamma=2.0)}
        return w

    def change(k, w):
        if k == 2:
            w["cfg"]["loss_fn"] = functools.partial(focal, gamma=1.0)
        if k == 4:
            w["cfg"]["loss_fn"].keywords["alpha"] = 0.5
    sg = twins(world, 6, change)
    assert len(sg.stats.recaptures) == 2 and "keywords" in sg.stats.recaptures[1], sg.stats.recaptures


def test_a_bound_method_of_another_object_rebound_recaptures():
    class Loss:
        def __init__(self, w):
            self.w = w

        def compute(self, o, y):
            return self.w * F.cross_entropy(o, y)

    def world():
        w = sgd_world(lambda w: lambda o, y: w["obj"].compute(o, y))()
        w["a"], w["b"], w["obj"] = Loss(1.0), Loss(2.0), Holder()
        w["obj"].compute = w["a"].compute
        return w

    def change(k, w):
        if k == 3:
            w["obj"].compute = w["b"].compute
    sg = twins(world, 6, change)
    assert any("compute" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_stable_functions_keep_one_graph():
    def helper(o, y):
        return ce(o, y) + 0.0 * torch.tanh(o).sum()
    sg = twins(sgd_world(lambda w: lambda o, y: helper(o, y)), 6)
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats.recaptures


# ---- 2. a partial's keywords changed in place ------------------------------------------------
def focal(logits, y, gamma=2.0, alpha=1.0):
    ce_ = F.cross_entropy(logits, y, reduction="none")
    return (alpha * (1 - torch.exp(-ce_)) ** gamma * ce_).mean()


@pytest.mark.parametrize("func,first,later", [
    (F.cross_entropy, {"label_smoothing": 0.0}, {"label_smoothing": 0.3}),
    (focal, {"gamma": 2.0, "alpha": 1.0}, {"gamma": 0.5}),
    (focal, {"gamma": 2.0}, {"alpha": 0.25}),   # a keyword the partial did not bind before
])
def test_a_partial_whose_keywords_change_in_place_recaptures(func, first, later):
    def world():
        w = sgd_world(lambda w: lambda o, y: w["loss"](o, y))()
        w["loss"] = functools.partial(func, **first)
        return w

    def change(k, w):
        if k == 3:
            w["loss"].keywords.update(later)
    sg = twins(world, 6, change)
    assert any("keywords" in r for r in sg.stats.recaptures), sg.stats.recaptures


# ---- 3. a mutable default argument -------------------------------------------------------------
def test_a_mutable_default_counter_is_state():
    def world():
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y, _state={"n": 0}):
            loss = F.cross_entropy(model(x), y)
            if _state["n"] % 3 == 2:
                loss = loss * 0.5
            opt.zero_grad()
            loss.backward()
            opt.step()
            _state["n"] += 1
            return loss.detach()
        return {"model": model, "step": step, "py": lambda: dict(step.__defaults__[0])}
    sg = twins(world, 8)   # (the count is replayed: a tracked number written back, as a cell's)
    assert sg.stats.replays == 5 and "_state['n']" in sg.stats.recaptures[0], sg.stats.recaptures


def test_a_default_changed_between_calls_recaptures():
    def world():
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y, weights=[1.0, 1.0, 1.0, 1.0], *, opts={"scale": 1.0}):
            loss = F.cross_entropy(model(x), y, weight=torch.tensor(weights)) * opts["scale"]
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return {"model": model, "step": step}

    def change(k, w):
        f = w["step"]
        if k == 2:
            f.__defaults__[0][0] = 3.0
        if k == 3:
            f.__kwdefaults__["opts"]["scale"] = 0.5
        if k == 4:
            f.__defaults__ = ([1.0, 2.0, 1.0, 1.0],)
    sg = twins(world, 6, change)   # (``opts["scale"]``, a float, is read live: no recapture for it)
    assert len(sg.stats.recaptures) == 2 and all("weights" in r for r in sg.stats.recaptures), sg.stats.recaptures


# ---- 4. the environment -----------------------------------------------------------------------
from os import environ, getenv  # noqa: E402 - the step reads these names too

_READS = {
    "environ.get": lambda: float(os.environ.get("SG_TEST_SCALE", "1")),
    "environ[]": lambda: float(os.environ["SG_TEST_SCALE"]) if "SG_TEST_SCALE" in os.environ else 1.0,
    "getenv": lambda: 2.0 if os.getenv("SG_TEST_SCALE") == "2" else 1.0,
    "from os import": lambda: float(environ.get("SG_TEST_SCALE", "1")) * float(getenv("SG_TEST_SCALE") or 1),
}


@pytest.mark.parametrize("how", list(_READS))
def test_an_environment_variable_the_step_reads_is_guarded(how, monkeypatch):
    monkeypatch.delenv("SG_TEST_SCALE", raising=False)
    read = _READS[how]

    def change(k, w):
        if k == 3:
            os.environ["SG_TEST_SCALE"] = "2"
    sg = twins(sgd_world(lambda w: lambda o, y: F.cross_entropy(o, y) * read()), 6, change)
    assert any("SG_TEST_SCALE" in r for r in sg.stats.recaptures), sg.stats.recaptures


class _ModelEMA:   # YOLOv5's utils/torch_utils.py ModelEMA, as written there
    def __init__(self, model, decay=0.9999, tau=20, updates=0):
        import copy
        import math
        self.ema = copy.deepcopy(model).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


def test_an_object_made_anew_whose_method_counts_in_the_step_keeps_counting():
    """``ema = ModelEMA(model, updates=1000)`` between calls (a new phase): the rebinding was
    noticed, but ``self.updates`` was a source of the first object only, so the new one's counter
    stayed at 1001 and its weights drifted from eager's, silently."""
    class Box:
        pass

    def run(compiled):
        torch.manual_seed(0)
        b = Box()
        b.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        b.opt = torch.optim.SGD(b.model.parameters(), lr=0.1, momentum=0.9)
        b.ema = _ModelEMA(b.model)

        def step(x, y):
            loss = F.cross_entropy(b.model(x), y)
            b.opt.zero_grad()
            loss.backward()
            b.opt.step()
            b.ema.update(b.model)
            return loss.detach()
        f = stepgraph.compile(step) if compiled else step
        out, g = [], torch.Generator().manual_seed(0)
        for k in range(8):
            if k == 4:
                b.ema = _ModelEMA(b.model, updates=1000)
            f(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            out.append((b.ema.updates, [v.clone() for v in b.ema.ema.state_dict().values()]))
        return out, f
    want, (got, f) = run(False)[0], run(True)
    for k, ((ue, we), (uc, wc)) in enumerate(zip(want, got)):
        assert ue == uc and all(torch.equal(a, c) for a, c in zip(we, wc)), (k, ue, uc)
    assert f.stats.replays >= 3
