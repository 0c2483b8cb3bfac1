"""A custom autograd Function's backward, run under the step's torch-function modes while traced.

The autograd engine calls a Function's Python ``backward`` with no torch-function mode active
(the modes are not part of the state it carries into the backward), so a value the forward
read on the host and kept in ``ctx`` (``ctx.scale = x.abs().max().item()``, a live
``hostreads.ReadFloat``) reached ``g * ctx.scale`` as a plain float: baked into the backward
graph at capture, the capture's value at every replay, silently. While the step is traced,
``BackwardCFunction.apply`` (what the engine calls) runs the backward under the modes the step
runs under, so such a value is read live or guarded there exactly as in the step's own code --
for the user's Functions and a library's alike.
"""
from __future__ import annotations

import contextlib

from torch.autograd.function import BackwardCFunction
from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

from .patching import patched


@contextlib.contextmanager
def backward_under_modes(ctxs=None):
    """While inside, each Function backward the engine runs gets the torch-function modes
    active at entry; ``ctxs`` (a WeakSet) collects those Functions' ctx objects: a read kept
    there was used by the backward under the modes, no Python state a replay leaves stale."""
    modes = _get_current_function_mode_stack()
    run = BackwardCFunction.apply

    def apply(self, *args):
        if not modes or _get_current_function_mode_stack():   # (modes already there: as is)
            return run(self, *args)
        if ctxs is not None:
            ctxs.add(self)
        for m in modes:   # (pushed as is: a mode's own __enter__ may set up state again)
            _push_mode(m)
        try:
            return run(self, *args)
        finally:
            for _ in modes:
                _pop_mode()

    with patched(BackwardCFunction, {"apply": apply}):
        yield
