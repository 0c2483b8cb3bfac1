"""``torch.compile``d code inside a captured step: traced through as eager code, parity with eager.

Users compile their model (``model = torch.compile(model)``) or a helper (``@torch.compile``)
and then wrap the step with stepgraph. Capture used to fail with FX's "symbolically trace a
dynamo-optimized function" error in the middle of the step (the update was lost). Dynamo's
``backend="eager"`` keeps the compiled code's kernels those of eager PyTorch, so the eager twin
(the same user program without stepgraph) is compared bitwise; the default Inductor backend is
covered with a tolerance.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 4))


def _batch(k):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _drive(step, eager, models, opts, passed=None, steps=6, rtol=0.0):
    """Call both on the same fresh batches (same RNG seed per call); compare after every call.
    ``passed=(a, b)``: the step takes ``a`` (the eager twin ``b``) as its first argument."""
    (m, m2), (o, o2) = models, opts
    close = dict(rtol=rtol, atol=0.0 if rtol == 0 else 1e-6)
    for k in range(steps):
        x, y = _batch(k)
        torch.manual_seed(k)
        got = step(passed[0], x, y) if passed else step(x, y)
        rng = torch.get_rng_state()
        torch.manual_seed(k)
        want = eager(passed[1], x, y) if passed else eager(x, y)
        assert torch.equal(rng, torch.get_rng_state()), f"call {k + 1}: RNG state differs from eager's"
        torch.testing.assert_close(got, want, **close)
        for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
            torch.testing.assert_close(a, b, **close, msg=lambda s: f"call {k + 1}: {n}: {s}")
        for p, q in zip(m.parameters(), m2.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **close)
            for key, v in o.state[p].items():
                torch.testing.assert_close(v, o2.state[q][key], **close)


def _closure_step(net, opt):
    def step(x, y):
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


@pytest.mark.parametrize("dynamo_backend", ["eager", "aot_eager"])
def test_compiled_module_in_the_closure(dynamo_backend):
    m = _model()
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)
    cm, cm2 = torch.compile(m, backend=dynamo_backend), torch.compile(m2, backend=dynamo_backend)
    step = stepgraph.compile(_closure_step(cm, o))
    _drive(step, _closure_step(cm2, o2), (m, m2), (o, o2))
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays, s.failed_captures) == (1, 1, 4, 0), step.explain()
    assert "net._orig_mod.0.weight" in step.explain()
    assert "torch.compile'd net traced as eager code" in step.explain(), step.explain()


def test_compiled_module_passed_as_argument():
    m = _model()
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)

    def mk(opt):
        def step(net, x, y):
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    cm, cm2 = torch.compile(m, backend="eager"), torch.compile(m2, backend="eager")
    step = stepgraph.compile(mk(o))
    _drive(step, mk(o2), (m, m2), (o, o2), passed=(cm, cm2))
    assert (step.stats.captures, step.stats.replays, step.stats.failed_captures) == (1, 4, 0), step.explain()


def test_compiled_function_called_by_the_step():
    m = _model()
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.Adam(m.parameters(), lr=1e-2), torch.optim.Adam(m2.parameters(), lr=1e-2)

    @torch.compile(backend="eager")
    def smooth_loss(logits, y):
        return F.cross_entropy(logits, y, label_smoothing=0.1) + 1e-3 * logits.pow(2).mean()

    def mk(net, opt):
        def step(x, y):
            loss = smooth_loss(net(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss
        return step
    step = stepgraph.compile(mk(m, o))
    _drive(step, mk(m2, o2), (m, m2), (o, o2))
    assert (step.stats.captures, step.stats.replays, step.stats.failed_captures) == (1, 4, 0), step.explain()


def test_compiled_optimizer_step():
    """PyTorch's recipe for a compiled optimizer: ``torch.compile(opt.step)`` called in the step.
    SGD: under Dynamo, Adam takes its compile path (tensor step counters, no ``.item()``), whose
    rounding differs from the plain path the trace runs; SGD's arithmetic is the same (bitwise)."""
    m = _model()
    m2 = copy.deepcopy(m)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)

    def mk(net, opt):
        opt_step = torch.compile(opt.step, backend="eager")

        def step(x, y):
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt_step()
            opt.zero_grad()
            return loss
        return step
    step = stepgraph.compile(mk(m, o))
    _drive(step, mk(m2, o2), (m, m2), (o, o2))
    assert (step.stats.captures, step.stats.replays, step.stats.failed_captures) == (1, 4, 0), step.explain()


def test_graph_module_with_a_compiled_submodule():
    """Partial capture traces the module's forward with make_fx too: same inlining."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    m2 = copy.deepcopy(m)
    m[0], m2[0] = torch.compile(m[0], backend="eager"), torch.compile(m2[0], backend="eager")
    g = stepgraph.graph_module(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    for k in range(5):
        x, _ = _batch(k)
        for net, opt in ((g, o), (m2, o2)):
            net(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert (g.stats.captures, g.stats.replays, g.stats.failed_captures) == (1, 3, 0), g.explain()
