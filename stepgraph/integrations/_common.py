"""What the framework integrations share: Python effects a replay must perform again, warnings
said once, and reading a user function's bytecode.

A framework's training step is mostly tensor work (captured) wrapped in Python bookkeeping
(progress counters, ``self.log``, scheduler wrappers) that a replay does not run. The
integrations keep that bookkeeping outside the captured function: what the step asks for while
its Python runs (at warm-up and capture) is recorded in an :class:`Effects` entry whose key (a
string) the captured function returns. A replay hands back the same string (a constant of that
graph) with this call's tensors, so the wrapper performs the same effects, with this call's
values, after every call.
"""
from __future__ import annotations

import dis
import itertools
import logging
import types
import warnings

import torch

from ..capture.pyvalues import _user_code

log = logging.getLogger("stepgraph")

_LOADS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST", "LOAD_DEREF",
          "LOAD_FAST_BORROW", "LOAD_FAST_BORROW_LOAD_FAST_BORROW", "LOAD_CLOSURE", "DELETE_FAST")


class Effects:
    """Python effects of the step, one entry per graph (and per eager call), keyed by a string
    the captured function returns."""

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._ids = itertools.count()
        self._entries: dict[str, dict] = {}
        self.current: dict | None = None

    def begin(self) -> dict:
        self.current = {"logs": [], "calls": []}
        return self.current

    def end(self) -> str:
        key = f"{self._prefix}#{next(self._ids)}"
        self._entries[key] = self.current
        self.current = None
        return key

    def get(self, key: str) -> dict:
        return self._entries[key]

    def forget(self, key: str) -> None:
        """Drop an eager call's entry (graphs keep theirs: every replay uses it)."""
        self._entries.pop(key, None)


class Once:
    """Warnings said once per integration object (and logged on the ``stepgraph`` logger)."""

    def __init__(self):
        self.said: list[str] = []

    def __call__(self, msg: str, stacklevel: int = 3) -> None:
        if msg in self.said:
            return
        self.said.append(msg)
        warnings.warn(msg, stacklevel=stacklevel)
        log.warning(msg)


def user_function(f) -> bool:
    """A plain function or method written by the user (not a library's)."""
    f = getattr(f, "__func__", f)
    return isinstance(f, types.FunctionType) and _user_code(f.__code__)


def overrides(obj, name: str, base) -> bool:
    """``type(obj)`` (or ``obj`` itself) defines ``name`` differently from ``base``."""
    if name in getattr(obj, "__dict__", {}):
        return True
    mine = getattr(type(obj), name, None)
    theirs = getattr(base, name, None)
    return mine is not None and getattr(mine, "__code__", mine) is not getattr(theirs, "__code__", theirs)


def reads_parameter(f, name: str) -> bool:
    """Whether the code of ``f`` (or a function nested in it) reads its parameter ``name``.
    A parameter absorbed by ``*args``/``**kwargs``, or code we cannot read, counts as read."""
    f = getattr(f, "__func__", f)
    code = getattr(f, "__code__", None)
    if code is None:
        return True
    n_pos = code.co_argcount + code.co_kwonlyargcount
    params = code.co_varnames[:n_pos]
    if name not in params:
        rest, i = [], n_pos
        if code.co_flags & 0x04:  # CO_VARARGS
            rest.append(code.co_varnames[i])
            i += 1
        if code.co_flags & 0x08:  # CO_VARKEYWORDS
            rest.append(code.co_varnames[i])
        return any(v in code.co_cellvars or _loads(code, v) for v in rest)
    return name in code.co_cellvars or _loads(code, name)


def _loads(code, name) -> bool:
    for ins in dis.get_instructions(code):
        if ins.opname in _LOADS:
            v = ins.argval
            if v == name or (isinstance(v, tuple) and name in v):
                return True
    return any(_loads(c, name) for c in code.co_consts if isinstance(c, types.CodeType))


def detached_copy(value):
    """What a logged value becomes at the moment it is logged (Lightning's ``self.log`` copies
    a tensor then): a copy inside the graph, so later in-place changes do not reach it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value
