"""Guards that cost O(1) per call: a registration epoch bumped when a watched module gets a
parameter, buffer or submodule assigned, and a fingerprint of the hooks on watched modules and
parameters (torch's hook-registration methods wrapped once, process-wide)."""
from __future__ import annotations

import weakref

import torch
from torch import nn

# Bumped by torch's global registration hooks whenever any module gets a parameter, buffer or
# submodule assigned: an O(1) guard that notices ``model.fc.weight = nn.Parameter(...)``.
_EPOCH = [0]


_PAUSED = [0]
# Only modules some step function uses count: building an unrelated module (a loss object,
# an eval model) must not invalidate every captured step.
_WATCHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


# id -> weakref: a WeakSet would compare tensors with == (elementwise) on lookup.
_WATCHED_PARAMS: dict = {}
_HOOK_EPOCH = [0]


def watch(modules, params=()) -> None:
    _WATCHED.update(modules)
    for p in params:
        if id(p) not in _WATCHED_PARAMS:
            _WATCHED_PARAMS[id(p)] = weakref.ref(p, lambda _r, k=id(p): _WATCHED_PARAMS.pop(k, None))


def _counting(register):
    """Wrap a Tensor hook-registration method so the hooks on parameters some step uses keep a
    net fingerprint (sum of live handle ids): an O(1) per-call guard instead of reading every
    parameter's hook dicts. A hook added and removed within one step leaves it unchanged; a
    hook left behind, removed or replaced changes it."""
    def wrapper(self, hook, *a, **k):
        handle = register(self, hook, *a, **k)
        if isinstance(self, nn.Module):
            watched = self in _WATCHED
        else:
            ref = _WATCHED_PARAMS.get(id(self))
            watched = ref is not None and ref() is self
        if watched:
            _HOOK_EPOCH[0] += handle.id
            remove = handle.remove
            live = [True]

            def counted_remove(*ra, **rk):
                if live[0]:
                    live[0] = False
                    _HOOK_EPOCH[0] -= handle.id
                return remove(*ra, **rk)
            handle.remove = counted_remove
        return handle
    wrapper.__wrapped__ = register
    wrapper.__doc__ = register.__doc__
    return wrapper


def _bump(module, name=None, value=None, *_a):
    # While stepgraph traces, make_fx's scratch root module registers every constant it
    # meets: that is not user state, and would otherwise invalidate the graph just made.
    # (``self.step += 1`` on a buffer -- ema_pytorch's EMA.update -- adds in place and
    # assigns the same tensor back: no new registration, no new graph at every call)
    if not _PAUSED[0] and module in _WATCHED and not (
            value is not None and any(d.get(name) is value for d in (module._buffers, module._parameters, module._modules))):
        _EPOCH[0] += 1


class paused_registration_epoch:
    def __enter__(self):
        _PAUSED[0] += 1

    def __exit__(self, *exc):
        _PAUSED[0] -= 1


_HOOKS_INSTALLED = []
# The hook dicts a module carries, and torch's global (every-module) ones: read by the hook
# guards here and by the side-effect scan in hooks.py.
MODULE_HOOK_ATTRS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOK_ATTRS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks")
_MODULE_HOOK_METHODS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                        "register_full_backward_pre_hook", "register_backward_hook")


def install_registration_hooks() -> None:
    if _HOOKS_INSTALLED:
        return
    from torch.nn.modules import module as _m
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        setattr(torch.Tensor, name, _counting(getattr(torch.Tensor, name)))
    for name in _MODULE_HOOK_METHODS:
        setattr(nn.Module, name, _counting(getattr(nn.Module, name)))
    _m.register_module_parameter_registration_hook(_bump)
    _m.register_module_buffer_registration_hook(_bump)
    _m.register_module_module_registration_hook(_bump)
    _HOOKS_INSTALLED.append(True)


def registration_epoch() -> int:
    return _EPOCH[0]
