"""Hooks on submodules of a ``graph_module``: run at every call with real tensors, or not graphed.

The graphed module's forward is traced on fake tensors, so a hook that ran inside that trace
would hand FakeTensors to user code (a hook storing its output would keep placeholders) and
would run only once. Instead:

* forward pre-hooks and forward hooks (the submodules' and global ones) are *deferred*: while
  tracing, a stub stands in for each one and records the call and its tensors, which become
  extra (detached) outputs of the forward graph; after every replayed forward, each recorded
  hook is called in trace order with the real tensors of that call;
* tensor hooks the forward registers (``h.register_hook(fn)``) would be called by the traced
  backward with fake gradients: not registered while tracing, and the module stays eager for
  that signature (warned);
* a hook must only observe: the capturing call runs eagerly (the hooks run as usual) and a
  hook that returns a value there (replacing the input or output) keeps the module eager for
  that signature, as do backward hooks on submodules (they would see traced gradients); both
  are warned once. A deferred hook that returns a value at a replay raises: its value could
  no longer be used.
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules import module as _m
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

_FORWARD = ("_forward_pre_hooks", "_forward_hooks")
_BACKWARD = ("_backward_pre_hooks", "_backward_hooks")
_TENSOR_HOOKS = ("Tensor.register_hook", "Tensor.register_post_accumulate_grad_hook")


@dataclass
class HookCall:
    """One hook call seen while tracing: replayed with that call's real tensors."""
    owner: object      # the submodule's hook dict owner: a Module, or the nn.modules.module namespace
    attr: str          # "_forward_pre_hooks" / "_forward_hooks" (with "_global" for global ones)
    key: int           # the hook's handle id
    module: nn.Module  # the submodule it was called for
    spec: object       # pytree spec of the hook's arguments after ``module``
    consts: list       # per argument leaf: None for a tensor (a graph output), else the value
    where: str         # "fc1 forward hook", for messages


def _dicts(module: nn.Module, attrs):
    """(owner, attr, dict, name) of non-empty hook dicts inside ``module`` (not on it: its own
    hooks run every call, outside the graph), then the global ones."""
    for name, sub in module.named_modules():
        if sub is not module:
            for attr in attrs:
                d = getattr(sub, attr, None)
                if d:
                    yield sub, attr, d, f"{name} {attr.strip('_')[:-1].replace('_', ' ')}"
    for attr in attrs:
        d = getattr(_m, "_global" + attr, None)
        if d:
            yield _m, "_global" + attr, d, f"global module {attr.strip('_')[:-1].replace('_', ' ')}"


def hook_key(module: nn.Module) -> tuple:
    """Which hooks are registered inside ``module`` (part of the graph's signature, every call:
    no names built here)."""
    attrs = _FORWARD + _BACKWARD
    key = tuple((id(sub), a, tuple(d)) for sub in module.modules() if sub is not module
                for a in attrs for d in [getattr(sub, a, None)] if d)
    return key + tuple((a, tuple(d)) for a in attrs for d in [getattr(_m, "_global" + a, None)] if d)


def undeferrable(module: nn.Module) -> list[str]:
    """Hooks that cannot run outside the graph: backward hooks on submodules (and global ones)."""
    return [name for _, _, _, name in _dicts(module, _BACKWARD)]


@contextlib.contextmanager
def watch_returns(module: nn.Module, found: list):
    """Around an eager call: note (in ``found``) every forward hook that returns a value."""
    swapped = []
    for owner, attr, d, name in list(_dicts(module, _FORWARD)):
        for k, fn in list(d.items()):
            def watched(*a, _fn=fn, _name=name, **kw):
                out = _fn(*a, **kw)
                if out is not None:
                    found.append(_name)
                return out
            swapped.append((d, k, fn))
            d[k] = watched
    try:
        yield
    finally:
        for d, k, fn in swapped:
            d[k] = fn


class _TensorHooks(TorchFunctionMode):
    """While tracing: tensor hooks the forward registers are noted (``found``), not registered."""

    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(getattr(func, "__wrapped__", func), "__qualname__", "") in _TENSOR_HOOKS:
            from .errors import user_frame
            self.found.append(user_frame())
            return RemovableHandle(collections.OrderedDict())
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def deferred(module: nn.Module, calls: list, tensors: list, tensor_hooks: list):
    """While tracing: stubs record each forward hook call (``calls``) and its tensors, detached
    (``tensors``, to become graph outputs), and return None; the user's hooks do not run. Tensor
    hooks the forward registers are noted in ``tensor_hooks`` instead of registered."""
    swapped = []
    for owner, attr, d, name in list(_dicts(module, _FORWARD)):
        for k, fn in list(d.items()):
            def stub(mod, *a, _owner=owner, _attr=attr, _k=k, _name=name):
                leaves, spec = pytree.tree_flatten(a)
                consts = [None if isinstance(v, torch.Tensor) else v for v in leaves]
                tensors.extend(v.detach() for v in leaves if isinstance(v, torch.Tensor))
                calls.append(HookCall(_owner, _attr, _k, mod, spec, consts, _name))
            swapped.append((d, k, fn))
            d[k] = stub
    try:
        with _TensorHooks(tensor_hooks):
            yield
    finally:
        for d, k, fn in swapped:
            d[k] = fn


def run_deferred(calls: list[HookCall], tensors) -> None:
    """After a replayed forward: call each recorded hook with this call's real tensors."""
    it = iter(tensors)
    for c in calls:
        args = pytree.tree_unflatten([next(it) if v is None else v for v in c.consts], c.spec)
        fn = getattr(c.owner, c.attr)[c.key]
        if fn(c.module, *args) is not None:
            from .capture.hooks import describe
            from .errors import StepGraphError
            raise StepGraphError(
                f"stepgraph.graph_module: the {c.where} {describe(fn)} returned a value at a replay, which the graph "
                "cannot use (it returned None when the module was captured). Keep hooks inside a graphed "
                "module observe-only, register value-changing hooks on the graphed module itself, or "
                "graph a submodule without them")
