"""Where a value the step reads actually lives, so that stepgraph can put a stand-in there while
it traces (a live float: trace.py) and put back exactly what was there.

``Source.write`` is an assignment (``obj.k = v``), right for what a replay redoes of the step's
own assignments, wrong for a swap: ``h.mult`` where ``mult`` is a class attribute made an
instance attribute that shadowed the class for good (later eager code read the stale value), and
a frozen dataclass, a namedtuple, a read-only property or a slotted class refused the write (the
step then ran eagerly for good). A :class:`Binding` is the one dict slot, list slot, closure cell
or class attribute the read resolves to; where there is none that plain Python would read
through (a descriptor, a ``__setattr__`` or ``__getattribute__`` of the user's), there is no
binding and the value is keyed by value instead of being read live."""
from __future__ import annotations

import types
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

from torch import nn

_MISSING = object()
_DICTS = (dict, OrderedDict, defaultdict)
# (nn.Module.__setattr__ puts a plain float in the instance __dict__, as object's does;
# SimpleNamespace's C methods read and write its __dict__ too)
_SETATTRS = (object.__setattr__, nn.Module.__setattr__)


@dataclass(frozen=True)
class Binding:
    """One place a value lives: ``container[key]`` (a dict, an instance's ``__dict__``, a list),
    a closure cell (key None) or a class attribute (``on_class``: set with setattr on that class)."""
    container: object
    key: object = None
    on_class: bool = False

    def get(self, default=_MISSING):
        c, k = self.container, self.key
        if _cell(c):
            return c.cell_contents
        if self.on_class:
            return vars(c).get(k, default)
        if isinstance(c, list):
            return c[k] if -len(c) <= k < len(c) else default
        return c.get(k, default)

    def set(self, value) -> None:
        c, k = self.container, self.key
        if _cell(c):
            c.cell_contents = value
        elif self.on_class:
            setattr(c, k, value)
        else:
            c[k] = value


def _cell(c) -> bool:
    """A closure cell, or a cell-like slot (callslots.DefaultSlot: a parameter's default)."""
    return isinstance(c, types.CellType) or hasattr(type(c), "cell_contents")


def _class_slot(cls, k):
    """The class in ``cls``'s MRO whose ``__dict__`` holds ``k``, and that value."""
    for c in cls.__mro__:
        if k in vars(c):
            return c, vars(c)[k]
    return None, _MISSING


def _on_class(owner, v):
    """A plain class attribute (no descriptor) on a class that setattr writes plainly."""
    return owner is not None and not hasattr(type(v), "__get__") and type(owner).__setattr__ is type.__setattr__


def binding(src, args=()) -> Binding | None:
    """Where ``src`` (a pyvalues.Source) reads its value now; None when it is not a plain slot."""
    try:
        return _binding(src, args)
    except Exception:  # noqa: BLE001 - not readable now: nothing to swap
        return None


def _binding(src, args):
    if not src.path:
        if src.kind == "global":   # (a builtin read through globals lives in no globals slot)
            return Binding(src.root, src.name) if src.name in src.root else None
        return Binding(src.root) if src.kind == "cell" else None
    from .trackplan import _parent
    parent = _parent(src, args)
    kind, k = src.path[-1]
    if kind == "item":
        if type(parent) in _DICTS and k in parent:
            return Binding(parent, k)
        if type(parent) is list and type(k) is int and -len(parent) <= k < len(parent):
            return Binding(parent, k)
        return None   # (a tuple, a namedtuple, a mapping of the user's)
    if isinstance(parent, type):
        if type(parent).__getattribute__ is not type.__getattribute__:
            return None
        owner, v = _class_slot(parent, k)
        return Binding(owner, k, True) if _on_class(owner, v) else None
    t = type(parent)
    if t is not types.SimpleNamespace and (t.__getattribute__ is not object.__getattribute__
                                           or getattr(t.__setattr__, "__wrapped__", t.__setattr__) not in _SETATTRS):
        return None   # (a frozen dataclass's __setattr__ refuses; a proxy's reads are its own)
    owner, v = _class_slot(t, k)
    if owner is not None and hasattr(type(v), "__set__"):
        return None   # (a property, a slot, a namedtuple field: a data descriptor reads it)
    d = getattr(parent, "__dict__", None)
    if isinstance(d, dict) and k in d:
        return Binding(d, k)
    return Binding(owner, k, True) if _on_class(owner, v) else None
