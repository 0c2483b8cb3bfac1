"""Python state a library's module keeps and the step's calls into that library write.

torchmetrics' ``Metric.update`` (called in the step: ``acc.update(preds, y)``) sets
``self._computed = None`` (so the next ``compute()`` outside the step computes again),
counts ``self._update_count += 1`` and appends to list states (``self.preds.append(preds)``:
AUROC, AveragePrecision). No Source names them (stepgraph reads the step's own code, not the
library's), so a replay did none of it: ``compute()`` kept returning the value cached at the
capture, the lists stopped growing -- silently wrong. Here:

- **counters**: a number attribute of a library module that the warm-up call changed is a
  tracked number during the trace (state.StateRegistry.number_slots), so its arithmetic is
  redone after each replay, as an optimizer's ``self.num_steps += 1`` is;
- **assignments** (``nn.Module.__setattr__`` logged while tracing, library classes only): the
  last value the step set, when it is a constant (None, a bool, a string, a number not tracked)
  or a fresh empty container, is set again after each replay (a new empty one each time);
- **appends**: a list a library module held before the step that grew by tensors the step
  computed gets them appended again after each replay (graph outputs, cloned like results).

Anything else such an assignment leaves (an object holding tensors the step computed) is
refused with a fix. A user's own classes are left to pyvalues/pyeffects, which read their code.
"""
from __future__ import annotations

import contextlib
import enum
import weakref

import torch
from torch import nn

_CONSTANTS = (type(None), bool, str, bytes, int, float, enum.Enum)
_LOG: list | None = None   # (module, name, value) set while tracing
_LISTS: dict = {}          # id(list) -> (module, name, list, length) before the trace


_LIBRARY = weakref.WeakKeyDictionary()   # type -> a library's module class (weakly: fx makes a class per graph)


def library_module(o) -> bool:
    t = type(o)
    got = _LIBRARY.get(t)
    if got is None:
        from .attrstores import _owner_kind, _users_class
        got = _LIBRARY[t] = isinstance(o, nn.Module) and _owner_kind(o) and not _users_class(t)
    return got


def note(o, d: dict) -> None:
    """At the trace's start (attrstores.snapshot): the lists a library module holds."""
    for k, v in d.items():
        if type(v) is list:
            _LISTS[id(v)] = (o, k, v, len(v))


@contextlib.contextmanager
def logging_sets():
    """While tracing: every attribute a library module's code sets (``nn.Module.__setattr__``)."""
    global _LOG
    orig = nn.Module.__setattr__

    def setattr_(self, name, value):
        # (types only: isinstance of a tracked number records a use, kept by the step's guards)
        if _LOG is not None and library_module(self) and issubclass(type(value), _CONSTANTS + (list, dict, set)):
            _LOG.append((weakref.ref(self), name, value))   # (weakly: a model dropped later is freed)
        orig(self, name, value)
    setattr_.__wrapped__ = orig   # (bindings.py: still nn.Module's)
    _LOG, nn.Module.__setattr__ = [], setattr_
    try:
        yield
    finally:
        nn.Module.__setattr__ = orig
        _LOG = None
        _LISTS.clear()


def counters_before(modules) -> dict:
    """Before the warm-up call: the number attributes of the library modules (a count, a decayed
    temperature)."""
    return {(id(m), k): (m, v) for m in modules if library_module(m)
            for k, v in list(vars(m).items()) if type(v) in (int, float)}


def counters_after(before: dict) -> list:
    """After it: ``(weakref to module, name)`` of those it changed (counted by the step)."""
    return [(weakref.ref(m), k) for (_, k), (m, v) in before.items() if vars(m).get(k, v) != v]


class _Attr:
    """``module.name``: an append effect's source (a list), or a set effect's target."""
    kind, path, from_step, identity_only, where = "attr", (), True, False, ""

    def __init__(self, owner, name: str):
        self.ref, self.name = weakref.ref(owner), name

    def read_or(self, args=(), default=None):
        o = self.ref()
        return default if o is None else vars(o).get(self.name, default)

    read = read_or

    def describe(self) -> str:
        return f"{type(self.ref()).__name__}.{self.name}"


class SetEffect:
    """``module.name = value`` after each replay (a fresh empty container each time)."""

    def __init__(self, owner, name: str, value):
        self.target, self.value = _Attr(owner, name), value

    def write(self) -> None:
        o = self.target.ref()
        if o is not None:
            v = self.value
            vars(o)[self.target.name] = type(v)() if isinstance(v, (list, dict, set)) else v


def collect(graph_outs: list, tracer, problems: list, where: str, counted: set) -> tuple[list, list]:
    """Inside the trace, after the step ran: (append effects, set effects); ``counted``:
    (id of the slot's owner -- a module counter's is the module's __dict__ --, name) of the tracked
    counters, written by their number effects (matched against the module itself, torchmetrics'
    ``_update_count`` after a reset was also a constant set, written over the count at every replay)."""
    from .effects import _is_traced
    from .effects import Problem
    from .pyeffects import _effect
    from .tracked import _PROXIES
    appends, sets, last = [], [], {}
    for ref, name, v in _LOG or ():
        o = ref()
        if o is not None:
            last[(id(o), name)] = (o, name, v)
    for o, name, v in last.values():
        if (id(vars(o)), name) in counted or type(v) in _PROXIES or issubclass(type(v), (torch.Tensor, nn.Module)) \
                or name in o._buffers or name in o._parameters or vars(o).get(name, v) is not v:
            continue   # (tensors: attrstores.py; a value the step rebound by another way since)
        if issubclass(type(v), _CONSTANTS) or (type(v) in (list, dict, set) and not v):
            sets.append(SetEffect(o, name, v))
        elif any(_is_traced(t) for t in torch.utils._pytree.tree_leaves(v) if isinstance(t, torch.Tensor)):
            problems.append(Problem(
                f"{type(o).__name__}.{name} (a library's module) is set by the step to a {type(v).__name__} "
                "holding tensors it computes: a replay could not redo that", where,
                f"call what sets {type(o).__name__}.{name} outside the step, on the tensors the step returns"))
    for o, name, lst, n0 in list(_LISTS.values()):
        if vars(o).get(name) is not lst or len(lst) <= n0:
            continue
        new = lst[n0:]
        if all(isinstance(t, torch.Tensor) and _is_traced(t) for t in new):
            appends += [_effect(_Attr(o, name), t, "tensor", graph_outs) for t in new]
        else:
            problems.append(Problem(
                f"the step appends to {type(o).__name__}.{name} (a list a library's module keeps) "
                "values a replay could not append again", where,
                f"call what appends to {type(o).__name__}.{name} outside the step"))
    return appends, sets
