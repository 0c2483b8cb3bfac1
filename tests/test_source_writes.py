"""What stepgraph writes into the user's objects while it captures: a float the step reads is
read live by putting a stand-in where the step reads it, then the value back. It must be put
back exactly where it lived: a class attribute read through an instance (``h.mult``) was
swapped with ``setattr`` on the instance, which left an instance attribute shadowing the class
attribute for good (replays and later eager code read the stale value); a frozen dataclass, a
namedtuple, a read-only property refused the write and the step ran eagerly for good. Each
idiom runs beside an eager twin, its value changed between calls, and the user's objects are
compared after every call and after ``step.reset()``."""
from __future__ import annotations

import collections
import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


def batch(k):
    g = torch.Generator().manual_seed(900 + k)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def world():
    """A model and its optimizer, the same in both twins."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


def twins(make, change, calls=6, expect_captures=None):
    """Run ``make()``'s step eagerly and compiled, ``change(k, env)`` before call k on both
    worlds; compare loss, parameters and ``env['objects']()`` after every call and after
    ``reset()`` (two more calls each, eager on both)."""
    eager, comp = make(), make()
    sg = stepgraph.compile(comp["step"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (a capture that fails warns: none may)
        for k in range(calls):
            for env, fn in ((eager, eager["step"]), (comp, sg)):
                change(k, env)
                env["loss"] = fn(*batch(k))
            assert torch.equal(eager["loss"], comp["loss"]), (k, sg.stats.last_branch)
            for p, q in zip(eager["model"].parameters(), comp["model"].parameters()):
                assert torch.equal(p, q), k
            assert eager["objects"]() == comp["objects"](), k
    assert sg.stats.replays >= 1 and sg.stats.failed_captures == 0 and sg.stats.eager_calls == 1, sg.stats   # (the warm-up)
    if expect_captures is not None:
        assert sg.stats.captures == expect_captures, sg.stats.recaptures
    stats = copy.deepcopy(sg.stats)
    sg.reset()
    for k in range(calls, calls + 2):
        for env, fn in ((eager, eager["step"]), (comp, comp["step"])):
            change(k, env)
            env["loss"] = fn(*batch(k))
        assert torch.equal(eager["loss"], comp["loss"]), k
        assert eager["objects"]() == comp["objects"](), k
    return stats


def scaled_step(model, opt, read):
    def step(x, y):
        loss = F.cross_entropy(model(x), y) * read()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


# ---- a class attribute read through an instance -----------------------------------------
class Holder:
    mult = 1.0


class Base:
    mult = 1.0


class Derived(Base):
    pass


def test_a_class_attribute_read_through_an_instance_stays_on_the_class():
    def make():
        model, opt = world()
        h = Holder()

        def step(x, y):
            loss = F.cross_entropy(model(x), y) * h.mult
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return {"model": model, "step": step, "objects": lambda: (dict(vars(h)), vars(Holder)["mult"])}

    def change(k, env):
        Holder.mult = 1.0 + (k // 3) * 2.0   # (both twins share the class: same value)
    try:
        twins(make, change)
    finally:
        Holder.mult = 1.0


def test_an_inherited_class_attribute_stays_on_the_base_class():
    def make():
        model, opt = world()
        d = Derived()

        def step(x, y):
            loss = F.cross_entropy(model(x), y) * d.mult
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return {"model": model, "step": step,
                "objects": lambda: (dict(vars(d)), "mult" in vars(Derived), Base.mult)}

    def change(k, env):
        Base.mult = 1.0 + (k // 3) * 2.0
    try:
        twins(make, change)
    finally:
        Base.mult = 1.0
    assert "mult" not in vars(Derived)


class Slotted:
    __slots__ = ("w",)
    mult = 1.0

    def __init__(self):
        self.w = 1.0


def test_a_class_attribute_of_a_slotted_class_and_its_slot():
    def make():
        model, opt = world()
        s = Slotted()
        return {"model": model, "step": scaled_step(model, opt, lambda: s.mult * s.w), "s": s,
                "objects": lambda: (s.w, Slotted.mult, hasattr(s, "__dict__"))}

    def change(k, env):
        Slotted.mult = 1.0 + (k // 3) * 2.0
        env["s"].w = 1.0 + (k // 2) * 0.5
    try:
        twins(make, change)
    finally:
        Slotted.mult = 1.0


# ---- read-only configs read directly by the step ------------------------------------------
@dataclasses.dataclass(frozen=True)
class Frozen:
    scale: float = 1.5


NT = collections.namedtuple("NT", "scale")


class Prop:
    def __init__(self):
        self._s = 1.5

    @property
    def scale(self):
        return self._s


def _direct(cfg0):
    """A step that reads ``cfg.scale`` itself, ``cfg`` a variable of its closure."""
    def make():
        model, opt = world()
        cfg = cfg0()

        def step(x, y):
            loss = F.cross_entropy(model(x), y) * cfg.scale
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        def rebind(new):
            nonlocal cfg
            cfg = new
        return {"model": model, "step": step, "rebind": rebind, "cfg": lambda: cfg,
                "objects": lambda: (type(cfg), dict(vars(cfg)) if hasattr(cfg, "__dict__") else cfg)}
    return make


def test_a_frozen_dataclass_swapped_for_a_new_one():
    def change(k, env):
        if k == 3:
            env["rebind"](Frozen(3.0))
    stats = twins(_direct(Frozen), change)
    assert stats.recaptures and "cfg 1.5" not in stats.recaptures[0], stats.recaptures


def test_a_namedtuple_swapped_for_a_new_one():
    def change(k, env):
        if k == 3:
            env["rebind"](NT(3.0))
    twins(_direct(lambda: NT(1.5)), change)


def test_a_read_only_property_backed_by_a_changing_field():
    def change(k, env):
        env["cfg"]()._s = 1.5 + (k // 3) * 1.5
    twins(_direct(Prop), change)


def test_a_frozen_dataclass_field_read_through_a_plain_holder():
    """``self.cfg.scale``: the holder is plain, the frozen config's field is what changes."""
    class Trainer:
        def __init__(self):
            self.cfg = Frozen()

    def make():
        model, opt = world()
        t = Trainer()
        return {"model": model, "t": t, "step": scaled_step(model, opt, lambda: t.cfg.scale),
                "objects": lambda: (t.cfg, sorted(vars(t)))}

    def change(k, env):
        if k == 3:
            env["t"].cfg = Frozen(2.5)
    twins(make, change)


# ---- a capture that stops midway -----------------------------------------------------------
def test_a_step_that_raises_while_captured_leaves_the_class_attribute_alone():
    """The put-back runs when the step raises: nothing stays on the instance or the class."""
    model, opt = world()
    h = Holder()
    boom = [False]

    def step(x, y):
        loss = F.cross_entropy(model(x), y) * h.mult
        if boom[0]:
            raise ValueError("user error")
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    sg = stepgraph.compile(step)
    sg(*batch(0))
    boom[0] = True
    with pytest.raises(ValueError):
        sg(*batch(1))
    assert vars(h) == {} and vars(Holder)["mult"] == 1.0 and type(Holder.mult) is float
    boom[0] = False
    sg(*batch(2)), sg(*batch(3))
    assert vars(h) == {} and type(Holder.mult) is float and sg.stats.replays == 1


class Table:
    weight = torch.tensor(2.0)   # a class attribute tensor the step reads through an instance


def test_a_trace_undone_midway_puts_back_no_instance_attribute(monkeypatch):
    """A trace that stops midway is undone (the variables the graph reads put back: pyeffects.
    snapshot) and the call runs eagerly: that put-back assigned ``t.weight`` on the instance."""
    from stepgraph.capture import trace
    from stepgraph.errors import CaptureError
    model, opt = world()
    t = Table()

    def step(x, y):
        loss = F.cross_entropy(model(x), y) * t.weight
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    def fails(reg):   # (stepgraph's own failure at the trace's end)
        raise CaptureError("stops the trace midway")
    sg = stepgraph.compile(step, on_capture_error="eager")
    sg(*batch(0))
    monkeypatch.setattr(trace, "absorb_floats", fails)
    sg(*batch(1))   # (logged: the capture failed, eager from now on)
    assert sg.stats.failed_captures == 1
    assert vars(t) == {} and vars(Table)["weight"] is Table.weight
