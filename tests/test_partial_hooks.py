"""Hooks on submodules of a ``graph_module``: user code never receives a FakeTensor.

The graphed forward is traced on fake tensors. Hooks inside it used to run only in that trace,
handing FakeTensors to user code (a hook storing its output kept placeholders) and never running
again. Now forward (pre-)hooks that only observe run after every replayed forward with that
call's real tensors; hooks that return values, and backward hooks, keep the module eager for
that signature (warned). Each case is compared with the same module run eagerly.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import stepgraph


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Linear(12, 3)

    def forward(self, x, scale=1.0):
        return self.fc2(F.dropout(torch.relu(self.bn(self.fc1(x))), 0.1, self.training)) * scale


def _pair():
    torch.manual_seed(0)
    m = Net()
    return m, copy.deepcopy(m)


def _no_fakes(seen):
    for v in seen:
        for t in (v if isinstance(v, (tuple, list)) else [v]):
            assert not isinstance(t, FakeTensor), "a hook received a FakeTensor"


def _drive(mods, steps=6, kwargs=None):
    """Train both (graphed, eager) on the same batches and dropout masks; compare every call."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in mods]
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        outs = []
        for m, o in zip(mods, opts):
            torch.manual_seed(50 + k)
            out = m(x, **(kwargs or {}))
            F.cross_entropy(out, y).backward()
            o.step()
            o.zero_grad()
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"call {k + 1}: output differs from eager"
    for (n, a), b in zip(mods[0].state_dict().items(), mods[1].state_dict().values()):
        assert torch.equal(a, b), n


def test_observing_forward_hook_runs_every_call_with_real_tensors():
    m, twin = _pair()
    logs = ([], [])
    for mod, log in zip((m, twin), logs):
        mod.fc1.register_forward_hook(lambda mod_, args, out, log=log: log.append(out.detach()))
    g = stepgraph.graph_module(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing to warn about: the hook runs at every call
        _drive((g, twin))
    assert (g.stats.eager_calls, g.stats.captures, g.stats.replays) == (1, 1, 4), g.explain()
    assert "hooks called after each replayed forward, with its tensors: fc1 forward hook" in g.explain()
    assert len(logs[0]) == len(logs[1]) == 6
    _no_fakes(logs[0])
    for a, b in zip(*logs):
        assert type(a) is torch.Tensor and torch.equal(a, b)


def test_pre_hooks_kwargs_hooks_and_global_hooks_see_real_values_in_eager_order():
    m, twin = _pair()
    logs = ([], [])
    for mod, log in zip((m, twin), logs):
        mod.bn.register_forward_pre_hook(lambda mod_, args, log=log: log.append(("pre", args[0].sum())))
        mod.fc2.register_forward_hook(lambda mod_, args, kwargs, out, log=log: log.append(("kw", out.mean())),
                                      with_kwargs=True)
    g = stepgraph.graph_module(m)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod_, args, out: seen.append((type(mod_).__name__, out)) if mod_ is m.fc1 else None)
    try:
        _drive((g, twin), kwargs=dict(scale=2.0))
    finally:
        handle.remove()
    assert g.stats.replays == 4, g.explain()
    assert [k for k, _ in logs[0]] == [k for k, _ in logs[1]] == ["pre", "kw"] * 6
    for (_, a), (_, b) in zip(*logs):
        assert type(a) is torch.Tensor and torch.equal(a, b)
    assert len(seen) == 6 and all(n == "Linear" for n, _ in seen)  # warm-up, capture, 4 replays
    _no_fakes([t for _, t in seen])


def test_hook_that_returns_a_value_keeps_the_module_eager_warned():
    m, twin = _pair()
    got = []
    for mod in (m, twin):
        mod.fc1.register_forward_hook(lambda mod_, args, out: (got.append(out), out * 0.5)[1])
    g = stepgraph.graph_module(m)
    with pytest.warns(UserWarning, match=r"runs eagerly for this signature: hooks inside it return new values \(fc1"):
        _drive((g, twin))
    _no_fakes(got)
    assert g.stats.replays == 0 and g.stats.eager_calls == 5, g.explain()


def test_backward_hook_on_a_submodule_keeps_the_module_eager_warned():
    m, twin = _pair()
    grads = ([], [])
    for mod, gl in zip((m, twin), grads):
        mod.fc2.register_full_backward_hook(lambda mod_, gin, gout, gl=gl: gl.append(gout[0].clone()))
    g = stepgraph.graph_module(m)
    with pytest.warns(UserWarning, match="backward hooks inside it .*fc2"):
        _drive((g, twin))
    _no_fakes(grads[0])
    assert len(grads[0]) == 6 and all(torch.equal(a, b) for a, b in zip(*grads))


def test_hook_registered_after_capture_recaptures_and_runs():
    m, twin = _pair()
    g = stepgraph.graph_module(m)
    _drive((g, twin), steps=3)
    logs = ([], [])
    for mod, log in zip((m, twin), logs):
        mod.fc1.register_forward_hook(lambda mod_, args, out, log=log: log.append(out.detach()))
    _drive((g, twin), steps=4)
    assert "hooks registered or removed inside the module" in g.stats.recaptures, g.stats.recaptures
    assert len(logs[0]) == 4 and all(torch.equal(a, b) for a, b in zip(*logs))
    _no_fakes(logs[0])


def test_tensor_hook_registered_in_forward_keeps_the_module_eager_warned():
    """Grad-CAM style: the forward registers a hook on an activation to keep its gradient."""
    class Cam(Net):
        def forward(self, x, scale=1.0):
            h = self.fc1(x)
            if h.requires_grad:
                h.register_hook(lambda g: self.grads.append(g))
            return self.fc2(torch.relu(self.bn(h))) * scale
    torch.manual_seed(0)
    m = Cam()
    twin = copy.deepcopy(m)
    m.grads, twin.grads = [], []
    g = stepgraph.graph_module(m)
    with pytest.warns(UserWarning, match="its forward registers tensor hooks"):
        _drive((g, twin))
    _no_fakes(m.grads)
    assert len(m.grads) == 6 and all(torch.equal(a, b) for a, b in zip(m.grads, twin.grads))


def test_a_forward_that_stores_a_tensor_on_its_module_runs_eagerly_warned():
    """Neural style's ContentLoss keeps ``self.loss = F.mse_loss(...)`` in forward; traced on fake
    tensors, the graphed module left a FakeTensor there (``cl.loss.item()`` gave ``zuf0``)."""
    import warnings

    class ContentLoss(torch.nn.Module):
        def __init__(self, target):
            super().__init__()
            self.target = target.detach()

        def forward(self, x):
            self.loss = torch.nn.functional.mse_loss(x, self.target)
            return x
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), ContentLoss(torch.randn(2, 4)))
    g = stepgraph.graph_module(body)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = []
        for _ in range(3):
            g(x).sum().backward()
            losses.append(body[1].loss)
    assert all(type(t) is torch.Tensor and t.item() == losses[0].item() for t in losses), losses
    assert any("stores tensors on module attributes (1.loss)" in str(w.message) for w in caught)
