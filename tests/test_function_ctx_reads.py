"""A custom ``torch.autograd.Function`` whose forward reads a value on the host and keeps it in
``ctx`` for its backward (``ctx.scale = x.abs().max().item()``; ``g * ctx.scale``).

The autograd engine calls the backward with none of the trace's torch-function modes active,
so that float reached ``g * ctx.scale`` as a plain number: baked into the backward graph at
capture, the capture's value at every replay, and the parameters drifted from eager's (only a
warning said "stores values read from tensors in Python objects"). Each test runs the step
compiled and eagerly on twin models from batches whose maximum differs call to call and
compares loss, parameters and grads bitwise.
"""
import copy
import os
import sysconfig
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph


def _function(forward_read, use_in_forward=False):
    class ScaledGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.scale = forward_read(x)
            return x * _total(ctx.scale) if use_in_forward else x * 2

        @staticmethod
        def backward(ctx, g):
            return g * _total(ctx.scale)
    return ScaledGrad


def _total(s):
    return s[0] + s[1] if isinstance(s, list) else s


def _batch(k):
    g = torch.Generator().manual_seed(500 + k)
    return torch.randn(8, 8, generator=g) * (1 + 0.5 * k), torch.randint(0, 4, (8,), generator=g)


def _run(fn, calls=6):
    """Compiled vs eager, bitwise after each call; returns the step (stats) and the warnings."""
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (m1, m2))

    def body(m, o, x, y):
        loss = F.cross_entropy(fn.apply(m(x)), y)
        loss.backward()
        o.step()
        grads = [p.grad.clone() for p in m.parameters()]
        o.zero_grad()
        return loss, grads
    step = stepgraph.compile(lambda x, y: body(m1, o1, x, y))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for k in range(calls):
            x, y = _batch(k)
            (l1, g1), (l2, g2) = step(x, y), body(m2, o2, x.clone(), y.clone())
            assert torch.equal(l1, l2), (k, l1, l2)
            assert all(torch.equal(a, b) for a, b in zip(g1, g2)), f"grads differ at call {k}"
            for a, b in zip(m1.parameters(), m2.parameters()):
                assert torch.equal(a, b), f"parameters differ from eager after call {k}"
    return step, [str(w.message) for w in seen]


@pytest.mark.parametrize("read", [
    lambda x: x.abs().max().item(),
    lambda x: x.abs().amax(0)[:2].tolist(),
], ids=["item", "tolist"])
@pytest.mark.parametrize("use_in_forward", [False, True])
def test_a_float_read_kept_in_ctx_is_read_live_in_the_backward(read, use_in_forward):
    step, warned = _run(_function(read, use_in_forward))
    assert step.stats.captures == 1 and step.stats.replays == 4
    assert not [w for w in warned if "stores values read from tensors" in w], warned


@pytest.mark.parametrize("read", [
    lambda x: float(x.abs().max()),
    lambda x: int(x.abs().max() * 10),
    lambda x: int((x > 0).sum().item()),
], ids=["float", "int", "int_item"])
def test_an_exact_value_kept_in_ctx_is_guarded(read):
    step, _ = _run(_function(read))
    assert step.stats.recaptures and "host read" in step.stats.recaptures[0], step.stats.recaptures


def test_an_int_item_kept_in_ctx_as_a_number():
    # (an int .item() is a tracked number, checked by value where the backward uses it)
    step, _ = _run(_function(lambda x: (x > 0).sum().item()))
    assert step.stats.recaptures, step.stats


class SavedScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.abs().max())
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (scale,) = ctx.saved_tensors
        return g * scale


def test_a_tensor_saved_for_backward_is_captured_once():
    step, _ = _run(SavedScale)
    assert step.stats.captures == 1 and step.stats.replays == 4


_LIBRARY = '''
import torch
class ScaledGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.scale = x.abs().max().item()
        return x * 2
    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale
'''


def test_a_library_function_keeping_a_read_in_ctx_is_live_too():
    # (code under site-packages is library code to stepgraph: its frames are never the user's)
    where = os.path.join(sysconfig.get_paths()["purelib"], "sg_fakelib", "functions.py")
    scope: dict = {}
    exec(compile(_LIBRARY, where, "exec"), scope)
    step, _ = _run(scope["ScaledGrad"])
    assert step.stats.captures == 1 and step.stats.replays == 4


class NormalizedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g / g.abs().max().item()


def test_a_read_inside_a_backward_is_a_host_read_like_any_other():
    # (it was refused: the read reached the aten level unseen, as a data-dependent op)
    step, _ = _run(NormalizedGrad)
    assert step.stats.captures == 1 and step.stats.replays == 4
