"""Slots the step reads a function or the environment from, keyed in the signature's
``callables`` section (found by pyvalues.find_sources).

A function the step calls from a global, a closure cell, an attribute, a dict entry or a library
module's attribute (``loss_fn = ce2``, ``obj.criterion = f``, ``F.cross_entropy`` patched) was
never keyed: replays kept calling the first one, silently. Now a function (or a
``functools.partial``) is keyed by identity, so a rebinding recaptures with a reason, and the new
function's own reads are found again (``Guards.signature`` rescans when these keys differ from
the scan's). The environment (``os.environ``, ``os.getenv``) is keyed by its values.
"""
from __future__ import annotations

import functools
import os
import types
from typing import NamedTuple

import torch

from .sigkey import Ident

FUNCS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)
SLOTS = FUNCS + (functools.partial,)   # what a slot is keyed for here


def is_env(v) -> bool:
    return v is os.environ or v is os.getenv


def slot_key(v):
    """The key of the value read from one slot: the environment, or a callable."""
    return env_key() if type(v) is type(os.environ) else callable_key(v)


def source_slot_key(s, args, missing):
    """The key of the slot a pyvalues Source reads: an argument's bound method by its function
    (the argument itself is keyed by guards.instance_key: a new loss object each epoch)."""
    v = s.read_or(args, missing)
    if s.kind == "arg" and len(s.path) == 1 and type(v) is types.MethodType and s.root < len(args) \
            and v.__self__ is args[s.root]:
        return ("method of the argument", v.__func__)
    return slot_key(v)


def env_key():
    # (the bytes os.environ keeps: decoding every variable at each call costs more)
    data = getattr(os.environ, "_data", None)
    return ("environ", frozenset((data if isinstance(data, dict) else os.environ).items()))


def callable_key(v):
    """By identity: a new function is a new graph (a new lambda each epoch too, as one passed as
    an argument is); the one found has its closure's cells and globals among the scan's sources,
    keyed or read live there. A bound method by its object and function (a new one at each read)."""
    t = type(v)
    if t is types.FunctionType:
        return v
    if t is types.MethodType:
        return ("method", Ident(v.__self__), v.__func__)
    if t is types.BuiltinFunctionType:
        s = v.__self__
        return v if s is None or type(s) is types.ModuleType else ("builtin method", Ident(s), v.__name__)
    return ("object", Ident(v))   # (a functools.partial: its keywords are sources of their own)


def library_slots(path, root):
    """For a chain from a library module (``F.cross_entropy``, ``os.environ.get``): ``("env",)``
    where it reaches the environment, the chain's attribute path where it ends at a function."""
    out, v, attrs = [], root, []
    for kind, k in path:
        if is_env(v):
            break
        if kind == "item":
            return out
        try:
            v = getattr(v, k)
        except Exception:  # noqa: BLE001 - not there now: nothing to key
            return out
        attrs.append(("attr", k))
    if is_env(v):
        out.append(("env",))
    if isinstance(v, SLOTS) and len(attrs) == len(path):
        out.append(tuple(attrs))
    return out


def instance_callable(v, name):
    """``obj.criterion(...)``: the function an object holds in its own ``__dict__`` (a class's
    methods are found on its type), or None."""
    d = getattr(v, "__dict__", None)
    w = d.get(name) if isinstance(d, dict) else None
    return w if isinstance(w, SLOTS) else None


def held_object(v, name) -> bool:
    """``obj.criterion(...)`` where ``obj`` (no module: its submodules are state) holds a module or a
    callable object in its own ``__dict__``: a value of its own to key, by identity."""
    d = getattr(v, "__dict__", None)
    return isinstance(d, dict) and not isinstance(v, torch.nn.Module) and name in d \
        and not isinstance(d[name], (type, types.ModuleType)) and callable(d[name])


def explain(a, b) -> str | None:
    """The first slot whose key differs between two ``callables`` sections."""
    (names_a, keys_a), (names_b, keys_b) = a, b
    old = dict(zip(names_a, keys_a))
    for (name, where), k in zip(names_b, keys_b):
        x = old.get((name, where))
        if x is None or x == k:
            continue
        at = f" (read at {where})" if where else ""
        if isinstance(k, tuple) and k[:1] == ("environ",) and isinstance(x, tuple):
            return _env_diff(x[1], k[1]) + at
        return f"{name} {show(x)} -> {show(k)}{at}"
    return None


def _env_diff(a, b) -> str:
    da, db = dict(a), dict(b)
    names = sorted((k for k in set(da) | set(db) if da.get(k) != db.get(k)), key=str)
    text = (lambda v: "unset" if v is None else repr(os.fsdecode(v) if isinstance(v, bytes) else v))
    n = names[0]
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"os.environ[{os.fsdecode(n) if isinstance(n, bytes) else n!r}] {text(da.get(n))} -> {text(db.get(n))}{more}"


def show(k) -> str:
    if isinstance(k, (types.FunctionType, types.BuiltinFunctionType)):
        return f"<function {getattr(k, '__qualname__', k.__name__)}>"
    if isinstance(k, tuple) and k[:1] == ("method",):
        return f"<method {k[2].__qualname__} of {type(k[1].obj).__name__} at {int(k[1]):#x}>"
    if isinstance(k, tuple) and k[:1] == ("builtin method",):
        return f"<method {k[2]} of {type(k[1].obj).__name__} at {int(k[1]):#x}>"
    if isinstance(k, tuple) and k[:1] == ("object",):
        return f"<{type(k[1].obj).__name__} at {int(k[1]):#x}>"
    return repr(k)[:48]


class Via(NamedTuple):
    """An argument a ``functools.partial`` binds by keyword: read from its ``keywords`` dict,
    which a loop may change in place (``loss.keywords['gamma'] = 0.5``), not kept as a value."""
    root: dict
    name: str
    path: tuple


def partial_binds(p: functools.partial, name: str) -> dict:
    """``{parameter: value or Via}`` of what a partial binds for its function's parameters."""
    import inspect
    kw = p.keywords
    try:
        got = inspect.signature(p.func).bind_partial(*p.args, **kw).arguments
    except (TypeError, ValueError):
        return {}
    return {k: Via(kw, name + ".keywords", (("item", k),)) if k in kw and v is kw[k] else v for k, v in got.items()}


class DefaultSlot:
    """A parameter's default, read where a call binds it (``fn.__defaults__`` or
    ``__kwdefaults__``), as a closure cell: the step's ``_state={"n": 0}`` is state the
    machinery for cells guards, replays or refuses (a Source of kind "cell" rooted here)."""
    __slots__ = ("fn", "name", "index")

    def __init__(self, fn, name, idx):
        code = fn.__code__
        self.fn, self.name = fn, name
        self.index = idx - (code.co_argcount - len(fn.__defaults__ or ())) if idx < code.co_argcount else None

    @property
    def cell_contents(self):
        return self.fn.__kwdefaults__[self.name] if self.index is None else self.fn.__defaults__[self.index]

    @cell_contents.setter
    def cell_contents(self, v):
        if self.index is None:
            self.fn.__kwdefaults__[self.name] = v
        else:
            d = list(self.fn.__defaults__)
            d[self.index] = v
            self.fn.__defaults__ = tuple(d)


def has_default(fn, name, idx) -> bool:
    code = fn.__code__
    if idx >= code.co_argcount:
        return name in (fn.__kwdefaults__ or {})
    return idx >= code.co_argcount - len(fn.__defaults__ or ())
