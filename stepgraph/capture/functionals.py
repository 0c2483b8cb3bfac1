"""Python-written functionals opened while tracing, so the ops inside see a live float.

``F.gumbel_softmax(logits, tau=self.temperature)`` reaches the trace's torch-function mode as
one call. A live float among its arguments, with ``logits`` needing grad, had to be baked
there: autograd would save the number for the backward. Inside, the function only computes
``(logits + gumbels) / tau`` -- an elementwise op, where the mode makes the number a 0-dim
tensor of the graph and keeps it live. wav2vec2 pretraining and Gumbel-softmax VAEs anneal
``tau`` every step: baked, each call captured a new graph until ``max_captures``, then ran
eagerly.

:func:`opened` is the function's own body with its ``has_torch_function*`` checks answering
False (a copy of the function over a copy of its module's globals), run with the mode pushed
again: its ops then dispatch through the mode, each one handled as the user's own would be.
"""
from __future__ import annotations

import types

# (torch.nn.functional's Python bodies: each begins with this check and hands itself to the
# mode when it answers True; the mode has taken the call and now runs the body)
_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_MODULES = ("torch.nn.functional", "torch.functional")
_OPENED: dict = {}


def _no(*args) -> bool:
    return False


def opened(func):
    """``func``'s body without its torch-function check, or None when it is not a Python
    functional of torch's (a C op, a method: nothing inside to open)."""
    if not isinstance(func, types.FunctionType) or func.__module__ not in _MODULES:
        return None
    body = _OPENED.get(func)
    if body is None:
        if not any(name in func.__code__.co_names for name in _CHECKS):
            return None
        scope = dict(func.__globals__)
        scope.update({name: _no for name in _CHECKS})
        body = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
        body.__kwdefaults__ = func.__kwdefaults__
        _OPENED[func] = body
    return body
