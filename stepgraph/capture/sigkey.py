"""The named shapes of a guard signature: ``SignatureKey`` (the graph cache's key) and
``TensorMeta`` (one tensor's part of it). NamedTuples, so they hash and compare as the plain
tuples they replaced, and every reader names the section it means instead of an index."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple


class Ident(int):
    """An object keyed by identity: its id, hashed as its id, equal to another key of the same
    live object only (a freed object's id is soon reused: a new array matched the old one's key
    and replayed its baked value). An object that takes weak references is held weakly: a key
    must not keep a model alive (a global ``model`` rebound at each k-fold fold kept every
    earlier fold's model, its optimizer and its graphs); others are held."""

    def __new__(cls, obj):
        self = super().__new__(cls, id(obj))
        try:
            self._ref = weakref.ref(obj)
        except TypeError:
            self._ref = Strong(obj)
        return self

    @property
    def obj(self):
        return self._ref()

    def __eq__(self, other):
        if type(other) is not Ident:
            return int.__eq__(self, other)
        if not int.__eq__(self, other):
            return False
        a = self._ref()
        return a is not None and a is other._ref()

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = int.__hash__

    def __reduce__(self):
        return int, (int(self),)


class Strong:
    """Holds an object as a weak reference would (``h()``), but strongly."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __call__(self):
        return self.obj


class TensorMeta(NamedTuple):
    """What a graph assumed about one tensor input (or a persistent ``.grad``)."""
    type: type
    dtype: object
    device: object
    shape: tuple
    stride: tuple
    requires_grad: bool     # requires_grad and is_leaf: the graph binds its .grad
    grad: str               # grad state of a leaf (capture/guards.py:_grad_state)


class SignatureKey(NamedTuple):
    """One call's guard key, section by section (built by ``Guards.signature``)."""
    spec: object            # pytree structure of (args, kwargs)
    inputs: tuple           # per leaf: TensorMeta, or how a non-tensor leaf is keyed
    alias: tuple            # positions of tensors passed twice; () when none is
    grad_mode: bool
    autocast: tuple
    training: tuple         # train/eval of every module
    hypers: tuple           # per optimizer, per group: ((key, value or live marker), ...)
    opt_state: tuple        # per optimizer: (id(state), len(state), ids of its per-parameter dicts)
    registration: int       # parameter/buffer/submodule registration epoch (watch.py)
    requires_grad: tuple    # per parameter: requires_grad (a layer frozen or unfrozen between calls)
    grads: tuple            # per parameter: None or TensorMeta of its .grad
    hooks: tuple
    py_values: tuple        # Python values the step's code reads (pyvalues.py)
    callables: tuple = ((), ())   # (names, keys): slots holding a function, the environment (callslots.py)


class ValueMeta(NamedTuple):
    """A non-tensor argument of a ``graph_module`` call, keyed by value (partial_key.py)."""
    type: str               # its type's name
    value: object           # the value; repr of a float (NaN-safe), repr of an unhashable


class PartialKey(NamedTuple):
    """A ``graph_module`` call's guard key (built by ``partial_key.signature``), read by section
    name like ``SignatureKey``: a module's forward and backward depend on fewer sections."""
    spec: str               # argument structure
    inputs: tuple           # per leaf: TensorMeta (requires_grad as is: inputs get grads too) or ValueMeta
    grad_mode: bool
    autocast: tuple         # (cpu, cuda) enabled
    training: tuple         # .training of every submodule, the module's own first
    state: tuple            # (id, requires_grad, dtype, shape) per parameter/buffer
    hooks: object           # partial_hooks.hook_key of the module


# The order a miss is explained in: most fundamental first (a replaced optimizer state also
# changes its hyper-parameters).
DIFF_ORDER = ("spec", "inputs", "alias", "registration", "requires_grad", "opt_state", "hypers", "grad_mode",
              "autocast", "training", "grads", "hooks", "callables", "py_values")
SECTION_NAMES = dict(spec="argument structure", inputs="inputs", alias="input aliasing", grad_mode="grad mode",
                     autocast="autocast", training="train/eval", hypers="optimizer hyper-parameters",
                     opt_state="optimizer state", registration="module structure",
                     requires_grad="requires_grad", grads="grads", hooks="hooks",
                     py_values="Python values", callables="functions the step calls")


@dataclass
class Signature:
    """The guard key of one call; ``key`` is hashed, the rest explains a miss."""
    key: SignatureKey
    leaves: list
    tensor_pos: list


class GradsKey:
    """The parameters' ``.grad`` objects in a quick key: equal when each is the same object (or
    None both times), else when their metadata (``meta``, guards.tensor_meta) is, as the full
    signature keys them. A step that sets grads to None and computes them again makes new ones
    at every call, whose ``==`` raised (a tensor's truth) and sent every other replay down the
    full signature (README's MLP on the CPU: 416 us a call against eager's 321)."""
    __slots__ = ("grads", "meta")

    def __init__(self, grads: tuple, meta):
        self.grads, self.meta = grads, meta

    def __eq__(self, other) -> bool:
        if type(other) is not GradsKey or len(other.grads) != len(self.grads):
            return False
        meta = self.meta
        for a, b in zip(self.grads, other.grads):
            if a is not b and (a is None or b is None or meta(a) != meta(b)):
                return False
        return True

    __hash__ = None   # (compared, never hashed)
