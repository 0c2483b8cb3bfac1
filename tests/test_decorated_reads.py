"""Values read inside a function under a ``functools.wraps`` decorator (``@torch.no_grad()``,
``@torch.autocast(...)``, a user's timing decorator): the scans read the wrapper's code, which
reads nothing of the user's, so the body's reads were baked -- a decorated EMA helper's global
decay, a decorated forward's ``self.strength`` -- and replays kept the capture's values, silently
(capture/chains.unwrapped_function)."""
import copy
import functools
import random

import pytest
import torch

import stepgraph

DECAY = 0.9


def timed(f):   # a user's decorator
    @functools.wraps(f)
    def wrapper(*a, **k):
        return f(*a, **k)
    return wrapper


DECORATORS = {"no_grad": torch.no_grad(), "user": timed}


def _scale_cls(deco):
    class DecoratedScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.strength = 1.0

        @deco
        def forward(self, x):
            return x * self.strength
    return DecoratedScale


def _run(compiled, case, deco_name):
    global DECAY
    deco = DECORATORS[deco_name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(_scale_cls(deco)(), torch.nn.Linear(4, 1))
    ema = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @deco
    def ema_update():
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.mul_(DECAY).add_(p.detach(), alpha=1 - DECAY)

    def step(x):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if case == "ema_global":
            ema_update()
        return loss.detach()
    f = stepgraph.compile(step) if compiled else step
    out = []
    try:
        for i in range(6):
            model[0].strength = 1.0 + 0.5 * i   # the loop changes a module attribute
            DECAY = 0.9 + 0.01 * i              # and anneals the EMA decay
            out.append(f(torch.ones(3, 4)))
            out += [p.detach().clone() for p in list(model.parameters()) + list(ema.parameters())]
    finally:
        DECAY = 0.9
    return out, f


@pytest.mark.parametrize("deco_name", sorted(DECORATORS))
@pytest.mark.parametrize("case", ["forward_attr", "ema_global"])
def test_values_read_in_a_decorated_function_are_guarded_or_live(case, deco_name):
    want = _run(False, case, deco_name)[0]
    got, f = _run(True, case, deco_name)
    for k, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), k
    assert f.stats.replays >= 3, f.stats


def test_a_random_instance_drawn_in_a_decorated_forward_is_not_baked():
    """NeMo's SpecAugment draws from its own ``random.Random`` in a ``@torch.no_grad()`` forward:
    refused clearly (or drawn as eager), never the capture's draw replayed."""
    class Augment(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._rng = random.Random(0)

        @torch.no_grad()
        def forward(self, x):
            k = self._rng.randint(0, 3)
            return x.roll(k, dims=1)
    torch.manual_seed(0)
    aug, lin = Augment(), torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def step(x):
        loss = lin(aug(x)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    f = stepgraph.compile(step)
    twin_aug, twin = copy.deepcopy(aug), copy.deepcopy(lin)
    topt = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.arange(12.0).view(3, 4)
    try:
        for _ in range(5):
            got = f(x)
            loss = twin(twin_aug(x)).pow(2).mean()
            topt.zero_grad()
            loss.backward()
            topt.step()
            assert torch.equal(got, loss.detach())
    except stepgraph.CaptureError as e:
        assert "random" in str(e).lower()


class _Helper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.strength = 1.0

    def forward(self, x):
        return self._scaled(x)

    def _scaled(self, x):   # (a helper method forward calls: its reads are the instance's)
        return x * self.strength


def test_a_helper_methods_attribute_is_read_from_each_instance_not_the_first_scanned():
    """An EMA copy of the model reachable from the step: the class's forward was scanned once,
    bound to the first instance found (the copy's), so the live model's ``self.strength`` read in
    a helper method was never a source: replays kept the capture's value, silently."""
    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(_Helper(), torch.nn.Linear(4, 1))
        ema = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters()):
                    pe.mul_(0.9).add_(p.detach(), alpha=0.1)
            return loss.detach()
        f = stepgraph.compile(step) if compiled else step
        out = []
        for i in range(6):
            model[0].strength = 1.0 + 0.5 * i
            out.append(f(torch.ones(3, 4)))
        return out + list(model.parameters()) + list(ema.parameters()), f
    want, (got, f) = run(False)[0], run(True)
    for k, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), k
    assert f.stats.replays >= 3
