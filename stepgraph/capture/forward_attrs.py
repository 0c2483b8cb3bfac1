"""Scalar attributes a module's ``forward`` reads on ``self`` (``Dropout.p``, a temperature, and
containers of scalars keyed by value: an adjacency dict of neighbour sets):
Python values of the step like those pyvalues.py finds in its own code; one the forward assigns
(``self.calls += 1``) is the step's own change, tracked and replayed (trackplan.py)."""
from __future__ import annotations

import dis
import inspect
import types

import torch

from .chains import _all_code, _chains, unwrapped_function
from .pyvalues import _SCALARS, _SKIP, Source, guard_value

_FORWARD_ATTRS: dict = {}   # class -> attribute names forward reads on self


def _self_attrs(m) -> tuple:
    """(names forward reads on self, names it assigns: ``self.calls += 1``, public names the methods
    and properties it calls on ``self`` read: sentence-transformers' losses read ``self.scale`` in
    ``compute_loss_from_embeddings``; a value changed between calls was baked)."""
    cls = type(m)
    # (and a bound method the instance holds: pytorch-metric-learning's ``self.loss_method =
    # self.mat_based_loss``, whose ``_compute_loss`` reads NTXent's ``self.temperature``)
    bound = {k: v.__func__ for k, v in vars(m).items() if isinstance(v, types.MethodType) and v.__self__ is m}
    key = (cls, tuple((k, id(f)) for k, f in bound.items()))
    got = _FORWARD_ATTRS.get(key)
    if got is None:
        fwd = unwrapped_function(getattr(cls, "forward", None))
        # (not torch's own modules' helpers: DDP's ``_pre_forward`` / ``_post_forward`` keep its
        # ``require_forward_param_sync`` flag, its own business)
        own = cls.__module__.split(".")[0] == "torch"
        _FORWARD_ATTRS[key] = got = _attrs_of([fwd] + ([] if own else _public_methods(cls)), lambda a: None if own else (
            inspect.getattr_static(cls, a, None) or bound.get(a)))
    return got


def _public_methods(cls) -> list:
    """A library module's public methods besides forward, which the step may call itself: timm's
    ``ModelEmaV3.update`` reads ``self.decay`` (through ``get_decay``) that a loop ramps; not
    scanned, the decay was baked, silently (helper-93)."""
    own = {c for c in torch.nn.Module.__mro__}
    return [unwrapped_function(v) for c in reversed(cls.__mro__) if c not in own and c.__module__.split(".")[0] != "torch"
            for k, v in vars(c).items() if not k.startswith("_") and k != "forward" and isinstance(v, types.FunctionType)]


def _attrs_of(todo: list, member) -> tuple:
    """(names the first function reads on its first parameter, names assigned there, public
    names the functions and properties ``member(name)`` gives read: up to _MAX_METHODS of them)."""
    names, written, done, first, helpers = [], set(), set(), todo[0] if todo else None, []
    while todo and len(done) < _MAX_METHODS:
        f = todo.pop()
        if not isinstance(f, types.FunctionType) or f.__code__.co_argcount < 1 or id(f.__code__) in done:
            continue
        done.add(id(f.__code__))
        self_name = f.__code__.co_varnames[0]
        # (comprehensions and inner functions too: GraphSAGE's ``[self.adj_lists[int(v)] for v in
        # nodes]`` reads ``self`` as a free variable of the comprehension's own code on 3.11)
        for code in _all_code(f.__code__):
            for op, name, path, _ in _chains(code):
                if op not in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF") or name != self_name or not path \
                        or not isinstance(path[0][1], str):
                    continue
                m = member(path[0][1])
                if isinstance(m, (types.FunctionType, property)):   # (``self.helper(...)``, ``self.prop``)
                    todo.append(m.fget if isinstance(m, property) else m)
                elif path[0][0] == "attr" and path[0][1] != "training":
                    # (beyond the first function, public settings only: torchmetrics' ``_computed``
                    # cache and ``preds`` list are the library's own state)
                    (names if f is first else helpers).append(path[0][1])
        written |= {x.argval for c in _all_code(f.__code__) for x in dis.get_instructions(c) if x.opname == "STORE_ATTR"}
    return tuple(dict.fromkeys(names)), written, tuple(a for a in dict.fromkeys(helpers) if not a.startswith("_"))


_MAX_METHODS = 16
_HOOK_ATTRS: dict = {}   # id(hook code) -> attribute names it reads on the module it is given


def _hook_attrs(m) -> list:
    """Attributes the module's hooks read on the module they are given (transformers' NEFTune
    hook: ``module.neftune_noise_alpha``, a float a callback may change between calls; a full
    backward hook scaling the grads by an annealed ``mod.grad_scale``)."""
    out = []
    hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    for d in hooks if any(hooks) else ():
        for h in d.values():
            h = unwrapped_function(h)
            if isinstance(h, types.FunctionType):
                if id(h.__code__) not in _HOOK_ATTRS:
                    got = _attrs_of([h], lambda a: None)
                    _HOOK_ATTRS[id(h.__code__)] = tuple(a for a in got[0] if not a.startswith("_"))
                out += _HOOK_ATTRS[id(h.__code__)]
    return out


def module_sources(modules, names: dict | None = None) -> list:
    """Scalar attributes each module's ``forward`` reads on ``self`` (``Dropout.p``...); numbers
    its helpers and forward hooks read."""
    out = []
    for m in modules:
        d = m.__dict__
        read, written, helpers = _self_attrs(m)
        for a in dict.fromkeys(read + helpers + tuple(_hook_attrs(m))):
            v = d.get(a, _SKIP)
            if a not in read and (not isinstance(v, _SCALARS) or a in written):
                continue   # (a helper's number it also sets: the library's own state)
            # (and containers of scalars: GraphSAGE's ``self.adj_lists``, a dict of neighbour sets
            # the forward turns into index constants -- keyed by value up to valuekeys' budget)
            if (isinstance(v, _SCALARS) or isinstance(v, (list, tuple, dict, set, frozenset))
                    and guard_value(v)[:1] != ("object",)) and not a.startswith("__"):
                label = (names or {}).get(id(m)) or type(m).__name__
                # (a counter forward keeps, ``self.calls += 1``: the step's own change, replayed)
                out.append(Source("object", m, label, (("attr", a),), "", from_step=a in written))
    return out
