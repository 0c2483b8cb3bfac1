"""The step's arguments as a tree: a batch object is a container of its values, as a dict is.

Hugging Face's ``BatchEncoding`` (a ``UserDict``: every tokenizer's and data collator's output),
a dataclass batch, or a plain batch class (the Annotated Transformer's ``Batch``: ``src``,
``tgt``, masks) was one pytree leaf, keyed by identity: a new batch object at every call was a
new graph at every call, then eager past ``max_captures`` (accelerate's gradient-accumulation
example: 6 captures, 0 replays in 8 calls). Here such an object is opened into its values -- the
tensors become inputs as a dict's do, its keys part of the signature's structure -- through a
private pytree node (nothing is registered for the user's types). Every flatten of the step's
arguments goes through :func:`flatten` so positions agree.
"""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
import weakref

import torch
import torch.utils._pytree as pytree
from torch import nn

_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


class _Template:
    """The object a rebuilt one is copied from (its other attributes: BatchEncoding's
    encodings); equal to any other, so it is no part of the signature."""
    __slots__ = ("ref", "cls")

    def __init__(self, obj):
        self.cls = type(obj)
        try:
            self.ref = weakref.ref(obj)
        except TypeError:
            self.ref = lambda: None

    def __eq__(self, other):
        return isinstance(other, _Template)

    def __hash__(self):
        return 0

    def __repr__(self):
        return f"<{self.cls.__name__}>"


class _Opened:
    __slots__ = ("kind", "keys", "values", "template")

    def __init__(self, kind, keys, values, template):
        self.kind, self.keys, self.values, self.template = kind, keys, values, template


def _flatten(o: _Opened):
    return list(o.values), (o.template.cls, o.kind, o.keys, o.template)


def _unflatten(values, context):
    cls, kind, keys, template = context
    base = template.ref()
    new = copy.copy(base) if base is not None else cls.__new__(cls)
    if kind == "mapping":
        data = dict(zip(keys, values))
        if hasattr(new, "data") and isinstance(getattr(new, "data", None), dict):
            new.data = data          # (UserDict, BatchEncoding)
        else:
            for k, v in data.items():
                new[k] = v
    else:
        for k, v in zip(keys, values):
            object.__setattr__(new, k, v)
    return new


def _flatten_with_keys(o: _Opened):
    key = pytree.MappingKey if o.kind == "mapping" else pytree.GetAttrKey
    return [(key(k), v) for k, v in zip(o.keys, o.values)], _flatten(o)[1]


pytree.register_pytree_node(_Opened, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys)


def _open(x):
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(_open(v) for v in x)
    if type(x) is dict:
        return {k: _open(v) for k, v in x.items()}
    if isinstance(x, (nn.Module, torch.optim.Optimizer, torch.Tensor, type)) or isinstance(x, _PLAIN):
        return x
    if type(x) in pytree.SUPPORTED_NODES:   # (namedtuples, HF's ModelOutput: pytree opens them)
        return x
    if isinstance(x, collections.abc.Mapping) and not isinstance(x, dict):
        keys = tuple(x.keys())
        if keys and all(isinstance(k, str) for k in keys) and any(isinstance(x[k], torch.Tensor) for k in keys):
            return _Opened("mapping", keys, [_open(x[k]) for k in keys], _Template(x))
        return x
    if dataclasses.is_dataclass(x):
        keys = tuple(f.name for f in dataclasses.fields(x))
        vals = [getattr(x, k) for k in keys]
        if any(isinstance(v, torch.Tensor) for v in vals) and all(_simple(v) for v in vals):
            return _Opened("attrs", keys, [_open(v) for v in vals], _Template(x))
        return x
    d = getattr(x, "__dict__", None)
    if type(d) is dict and d and type(x).__module__ not in ("builtins",) and not callable(x) \
            and any(isinstance(v, torch.Tensor) for v in d.values()) and all(_simple(v) for v in d.values()):
        keys = tuple(d)
        return _Opened("attrs", keys, [_open(d[k]) for k in keys], _Template(x))   # (a plain batch class)
    return x


def _simple(v) -> bool:
    # (a dict field of plain values too: a dataclass batch with ``meta: dict`` was keyed by
    # identity, a graph per batch)
    return isinstance(v, _PLAIN) or (type(v) in (list, tuple) and all(isinstance(y, _PLAIN) for y in v)) \
        or (type(v) is dict and len(v) <= 64 and all(isinstance(k, str) and _simple(y) for k, y in v.items()))


def _tree(args, kwargs):
    return _open((tuple(args), dict(kwargs)))


def flatten(args, kwargs):
    """``pytree.tree_flatten((args, kwargs))`` with batch objects opened (module doc)."""
    return pytree.tree_flatten(_tree(args, kwargs))


def leaves(args, kwargs) -> list:
    return flatten(args, kwargs)[0]


def flatten_with_path(args, kwargs):
    return pytree.tree_flatten_with_path(_tree(args, kwargs))


def opened(x) -> bool:
    """Is ``x`` a batch object this module opens (its values keyed as inputs, not by a source)?"""
    return isinstance(_open(x), _Opened)
