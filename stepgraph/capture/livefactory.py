"""A tensor made from a moving Python number: ``torch.tensor(it)``, ``torch.full((B,), t)``,
``torch.full_like(x, step % 10)`` with ``it`` an argument or attribute that changes at every call
(a diffusion timestep, an iteration count fed to a schedule computed on the device).

A graph bakes a factory's fill value: each value was a new graph until ``max_captures``, then
eager. Once the number's value check has missed (``UseLog.moving``), the factory is traced as
``empty(...).fill_(scalar_tensor(n))`` with ``n`` computed from its roots at each replay (a host
number on the CPU, one of the live scalars on a device graph): the same values, dtype and device
as the factory's. Only a factory whose fill is that one number (no list data, no
``requires_grad``), and never a bool. A moving number an op takes as a scalar (a fused
optimizer's ``lr=``, ``coef * loss``) is a live float here too (:func:`_live_float`), and
``torch.manual_seed(1000 + it)`` in a CPU step reads its seed the same way (effects._moving_seeds)."""
from __future__ import annotations

import torch

from .hostscalar import HostFloat
from .tracked import _PROXIES, TrackedFloat, plain

_FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.full, torch.full_like})
_KEYS = frozenset({"dtype", "device", "layout", "requires_grad", "pin_memory", "memory_format"})


def moving_factory(log, func, args, kwargs):
    """The factory's tensor with its fill read live, or None (the caller runs the op as it is)."""
    if func not in _FACTORIES or not log.active or set(kwargs) - _KEYS or kwargs.get("requires_grad") \
            or kwargs.get("pin_memory") or kwargs.get("layout") not in (None, torch.strided):
        return None
    like = None
    if func is torch.full_like:
        if len(args) != 2 or not isinstance(args[0], torch.Tensor):
            return None
        like, p = args
    elif func is torch.full:
        if len(args) != 2 or any(type(s) in _PROXIES for s in _sizes(args[0])):
            return None
        size, p = args
    else:
        if len(args) != 1:
            return None
        p = args[0]
    v = plain(p)
    if type(p) not in _PROXIES or isinstance(v, bool) or not isinstance(v, (int, float)) or not log.moving(p):
        return None
    dtype = kwargs.get("dtype") or (like.dtype if like is not None else
                                    torch.int64 if isinstance(v, int) else torch.get_default_dtype())
    device = kwargs.get("device") or (like.device if like is not None else None)
    f = _live_number(p, log)
    if f is None:
        return None
    value = torch.scalar_tensor(f, dtype=dtype, device=device)
    if func is torch.full_like:
        fmt = kwargs.get("memory_format", torch.preserve_format)
        return torch.empty_like(like, dtype=dtype, device=device, memory_format=fmt).fill_(value)
    if func is torch.full:
        return torch.empty(tuple(_sizes(size)), dtype=dtype, device=device).fill_(value)
    return value


def _sizes(size):
    return size if isinstance(size, (tuple, list, torch.Size)) else (size,)


def _live_float(p, log):
    """A moving float (``lr`` computed from ``it``) fed to an op that takes it as a scalar
    (a fused optimizer's ``lr=``, a foreach ``alpha=``): a live float computing it from its roots
    at each replay (on CUDA, one fed as a device scalar), or None."""
    if type(p) is not TrackedFloat or not log.moving(p):
        return None
    return _live_number(p, log)


def _live_number(p, log):
    """The number ``p`` as a HostFloat whose graph node computes it from its roots at each
    replay, or None where it cannot be lifted."""
    node = log.lift(p, typed=False)
    if node is None:
        return None
    f = HostFloat(plain(p), node)
    f.numbers = (p,)
    return f


def _live_scalar_tensor(p, log, ref):
    """A moving float as a 0-dim tensor of ``ref``'s dtype and device, made at each replay from
    the number's roots (its value check otherwise missed at every call); None when it cannot be
    read live. (Same dtype as the tensor: the scalar form rounds the number to it too.)"""
    f = _live_float(p, log)
    if f is None:
        return None
    return torch.scalar_tensor(f, dtype=ref.dtype, device=ref.device)
