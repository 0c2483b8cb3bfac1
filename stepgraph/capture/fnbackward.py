"""The backward a step runs, under the step's torch-function modes while traced.

A torch-function mode runs each function it handles with itself popped, so ``loss.backward()``
reaches the autograd engine with no mode active, and everything Python the engine calls --
a custom Function's ``backward``, tensor hooks, module full backward hooks, post-accumulate-grad
and multi-grad hooks -- ran unseen by ``_HostReadMode``. A value the step read on the host
(``s = h.max().item()``, a live ``hostreads.ReadFloat``) reached ``g * s`` there as a plain float:
baked into the backward graph at capture, the capture's value at every replay, silently; a read
inside a hook reached the aten level as an unexplained data-dependent op and was refused.

While the step is traced, the engine runs under the modes the step runs under
(``_engine_run_backward``, which ``Tensor.backward``, ``autograd.backward`` and ``autograd.grad``
all call), so such a value is read live or guarded there exactly as in the step's own code.
``BackwardCFunction.apply`` (what the engine calls for a Function) does the same for an engine
reached some other way, and notes the Function's ctx: a read kept there (``ctx.scale =
x.max().item()``) was used by its backward under the modes, no Python state a replay leaves stale.
"""
from __future__ import annotations

import contextlib

import torch.autograd
import torch.autograd.graph
from torch.autograd.function import BackwardCFunction
from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

from .patching import patched


@contextlib.contextmanager
def _under(modes):
    """``modes`` pushed as they are while inside, unless some are on already (then as is);
    pushed as is, not entered: a mode's own ``__enter__`` may set up state again."""
    if not modes or _get_current_function_mode_stack():
        yield
        return
    for m in modes:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in modes:
            _pop_mode()


@contextlib.contextmanager
def backward_under_modes(ctxs=None):
    """While inside, the engine and each Function backward it runs get the torch-function modes
    active at entry; ``ctxs`` (a WeakSet) collects those Functions' ctx objects."""
    modes = _get_current_function_mode_stack()
    run, engine = BackwardCFunction.apply, torch.autograd.graph._engine_run_backward

    def apply(self, *args):
        if modes and ctxs is not None:
            ctxs.add(self)
        with _under(modes):
            return run(self, *args)

    def run_backward(*args, **kwargs):
        with _under(modes):
            return engine(*args, **kwargs)

    # (torch.autograd imported the name from .graph: both bindings, as torch.compiler does)
    with patched(BackwardCFunction, {"apply": apply}), \
            patched(torch.autograd.graph, {"_engine_run_backward": run_backward}), \
            patched(torch.autograd, {"_engine_run_backward": run_backward}):
        yield
