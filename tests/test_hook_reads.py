"""Backward hooks that use a value the step read on the host (``s = h.abs().max().item()``;
``h.register_hook(lambda g: g * s)``), or that read one themselves.

The autograd engine calls tensor, module and multi-grad hooks with none of the trace's
torch-function modes active, so such a float reached ``g * s`` as a plain number: baked into
the backward graph at capture, the capture's value at every replay, and the parameters drifted
from eager's with only a "stores values read" warning. Each test runs the step compiled and
eagerly on twin models from batches whose values differ call to call and compares loss,
parameters and grads bitwise after every call.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

CALLS = 6   # 1 warm-up + 1 capture + 4 replays


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)


def _batch(k):
    g = torch.Generator().manual_seed(700 + k)
    return torch.randn(8, 8, generator=g) * (1 + 0.5 * k), torch.randint(0, 4, (8,), generator=g)


def _net():
    torch.manual_seed(0)   # (built anew, not deepcopied: deepcopy drops a parameter's hooks)
    return Net()


def _run(build, setup=None, calls=CALLS):
    """``build(model, opt, box)`` makes the step; ``setup(model, box)`` registers hooks before it.
    Compiled vs eager, bitwise after each call; returns the step and the warnings."""
    twins = []
    for _ in range(2):
        m, box = _net(), {"s": 1.0}
        setup and setup(m, box)
        o = torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)
        twins.append((m, build(m, o, box), box))
    (m1, s1, b1), (m2, s2, b2) = twins
    step = stepgraph.compile(s1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for k in range(calls):
            x, y = _batch(k)
            (l1, g1), (l2, g2) = step(x, y), s2(x.clone(), y.clone())
            assert torch.equal(l1, l2), (k, l1, l2)
            assert all(torch.equal(a, b) for a, b in zip(g1, g2)), f"grads differ at call {k}"
            for a, b in zip(m1.parameters(), m2.parameters()):
                assert torch.equal(a, b), f"parameters differ from eager after call {k}"
            assert b1 == b2, (k, b1, b2)   # (a read the step stores there: written back at replay)
    return step, [str(w.message) for w in seen]


def _finish(m, o, loss):
    loss.backward()
    o.step()
    grads = [p.grad.clone() for p in m.parameters()]
    o.zero_grad()
    return loss, grads


READS = {"item": lambda t: t.abs().max().item(), "tolist": lambda t: t.abs().amax().tolist()}


@pytest.mark.parametrize("read", list(READS))
def test_activation_hook_closing_over_a_read(read):
    def build(m, o, box):
        def step(x, y):
            h = m.body(x)
            s = READS[read](h)
            h.register_hook(lambda g: g * s)
            return _finish(m, o, F.cross_entropy(m.head(h), y))
        return step
    step, warned = _run(build)
    assert step.stats.captures == 1 and step.stats.replays == CALLS - 2, step.stats
    assert not [w for w in warned if "stores values read from tensors" in w], warned


def test_activation_hook_closing_over_an_exact_read_is_guarded():
    def build(m, o, box):
        def step(x, y):
            h = m.body(x)
            s = float(h.abs().max())
            h.register_hook(lambda g: g * s)
            return _finish(m, o, F.cross_entropy(m.head(h), y))
        return step
    step, _ = _run(build)
    assert step.stats.recaptures and "host read" in step.stats.recaptures[0], step.stats.recaptures


def test_parameter_hook_registered_in_the_step_closing_over_a_read():
    def build(m, o, box):
        def step(x, y):
            h = m.body(x)
            s = h.abs().max().item()
            handle = m.head.weight.register_hook(lambda g: g * s)
            try:
                return _finish(m, o, F.cross_entropy(m.head(h), y))
            finally:
                handle.remove()
        return step
    step, _ = _run(build)
    assert step.stats.captures == 1 and step.stats.replays == CALLS - 2, step.stats


def test_post_accumulate_grad_hook_closing_over_a_read():
    def build(m, o, box):
        def step(x, y):
            h = m.body(x)
            s = h.abs().max().item()

            def hook(p):
                p.grad.mul_(s)
            handle = m.head.weight.register_post_accumulate_grad_hook(hook)
            try:
                return _finish(m, o, F.cross_entropy(m.head(h), y))
            finally:
                handle.remove()
        return step
    step, _ = _run(build)
    assert step.stats.captures == 1 and step.stats.replays == CALLS - 2, step.stats


def test_module_full_backward_hook_reads_a_value_the_step_updates():
    # (registered once, before the step; the step updates what its closure reads)
    def setup(m, box):
        m.head.register_full_backward_hook(lambda mod, gi, go: (gi[0] * box["s"],))

    def build(m, o, box):
        def step(x, y):
            h = m.body(x)
            box["s"] = h.abs().max().item()
            return _finish(m, o, F.cross_entropy(m.head(h), y))
        return step
    step, _ = _run(build, setup)
    assert step.stats.captures == 1 and step.stats.replays == CALLS - 2, step.stats


def test_module_full_backward_hook_reads_a_nonlocal_the_step_rebinds():
    def build(m, o, box):
        s = 1.0

        def hook(mod, gi, go):
            return (gi[0] * s,)
        m.head.register_full_backward_hook(hook)

        def step(x, y):
            nonlocal s
            h = m.body(x)
            s = h.abs().max().item()
            return _finish(m, o, F.cross_entropy(m.head(h), y))
        return step
    step, _ = _run(build)
    assert step.stats.captures == 1 and step.stats.replays == CALLS - 2, step.stats


def test_multi_grad_hook_closing_over_a_read():
    def build(m, o, box):
        def step(x, y):
            h = m.body(x)
            a, b = h[:, :8], h[:, 8:]
            s = h.abs().max().item()

            def hook(grads):
                for g in grads:
                    g.mul_(s)   # (a multi-grad hook's return is ignored: in place is its only effect)
            handle = torch.autograd.graph.register_multi_grad_hook((a, b), hook)
            try:
                return _finish(m, o, F.cross_entropy(m.head(torch.cat([a, b], 1)), y))
            finally:
                handle.remove()
        return step
    step, _ = _run(build)
    assert step.stats.captures == 1 and step.stats.replays == CALLS - 2, step.stats


@pytest.mark.parametrize("read", list(READS))
def test_a_read_inside_a_hook_is_a_host_read_like_any_other(read):
    # (it was refused: the read reached the aten level unseen, as a data-dependent op)
    def setup(m, box):
        m.body.weight.register_hook(lambda g: g / READS[read](g))

    def build(m, o, box):
        def step(x, y):
            return _finish(m, o, F.cross_entropy(m.head(m.body(x)), y))
        return step
    step, _ = _run(build, setup)
    assert step.stats.captures == 1 and step.stats.replays == CALLS - 2, step.stats


LAM = 0.0


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate", "forward", "full_backward"])
@pytest.mark.parametrize("when", ["before", "between"])
def test_a_hook_registered_outside_the_step_reading_an_annealed_global(kind, when):
    """DANN's gradient scale ``2 / (1 + exp(-10 p)) - 1``, read by a hook the loop registered (not
    the step): the hooks' code was never scanned, so the capture's value was baked into every
    replay, silently. Now the hooks of the step's modules and parameters are scanned as its code
    is (the float read live), and one registered between calls is scanned at its recapture."""
    import math
    global LAM

    def run(compiled):
        global LAM
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def register():
            w = model[0].weight
            if kind == "tensor":
                w.register_hook(lambda g: g * LAM)
            elif kind == "post_accumulate":
                def scale(p):
                    p.grad.mul_(LAM)
                w.register_post_accumulate_grad_hook(scale)
            elif kind == "forward":
                model[0].register_forward_hook(lambda m, i, o: o * LAM)
            else:
                model[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * LAM,))

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        f = stepgraph.compile(step) if compiled else step
        out = []
        if when == "before":
            register()
        for k in range(7):
            if when == "between" and k == 2:
                register()
            LAM = 2.0 / (1.0 + math.exp(-10 * k / 7)) - 1
            out.append(f(*_batch(k)))
            out += [p.detach().clone() for p in model.parameters()]
        return out, f
    try:
        want = run(False)[0]
        got, f = run(True)
    finally:
        LAM = 0.0
    for k, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), k
    assert f.stats.replays >= 4, f.stats
