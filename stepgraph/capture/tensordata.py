"""Tensors the step builds from data with ``torch.tensor`` / ``torch.as_tensor``: of tensors it
computed (Lightning's ``grad_norm``), or of live floats (``torch.tensor(beta)``). Traced as is,
either would be a constant holding this call's values. Asked by modes._HostReadMode."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import _disable_current_modes

from .effects import _is_traced
from .hostreads import live_scalar_tensor
from .hostscalar import current

_TENSOR_FROM_DATA = {torch.tensor, torch.as_tensor}


def _tensor_of_step_tensors(func, args, kwargs):
    """``torch.tensor([t1, t2])`` of tensors the step computed (Lightning's ``grad_norm`` does
    this) reads their values on the host each call; traced as is, the result would be a
    constant holding this call's values. Built from the tensors instead: each element converted
    once to the dtype eager's result has (as the host round trip does), stacked, on its device."""
    with _disable_current_modes():
        ref = func(*args, **kwargs)  # eager's result: dtype, device, shape
    leaves = pytree.tree_leaves(args[0])
    if ref.requires_grad or not all(not isinstance(x, torch.Tensor) or x.dim() == 0 for x in leaves):
        return func(*args, **kwargs)  # (what eager does; the trace's usual checks apply)
    dev = next(x.device for x in leaves if _is_traced(x))
    parts = [x.detach().to(device=dev, dtype=ref.dtype) if isinstance(x, torch.Tensor)
             else torch.tensor(x, dtype=ref.dtype, device=dev) for x in leaves]
    return torch.stack(parts).reshape(ref.shape).to(ref.device)


def _tensor_of_live_floats(func, args, kwargs):
    """``torch.tensor(beta)`` / ``torch.tensor([beta, 1.0])`` of live floats (a global the loop
    anneals, a value read back): each made in the graph from the float's node, as in arithmetic
    (hostreads.live_scalar_tensor), stacked to eager's dtype, device and shape; else the value
    would be a constant guarded by value, a recapture per new value."""
    from .hostscalar import _plain
    tracer = get_proxy_mode().tracer
    leaves, spec = pytree.tree_flatten(args[0])
    if not any(current(x, tracer) for x in leaves) or \
            not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in leaves):
        return NotImplemented
    plain = (pytree.tree_unflatten([_plain(x) if current(x, tracer) else x for x in leaves], spec),) + tuple(args[1:])
    with _disable_current_modes():
        ref = func(*plain, **kwargs)   # eager's result: dtype, device, shape
    if not ref.is_floating_point() or ref.requires_grad:
        return NotImplemented
    parts = []
    for x in leaves:
        t = live_scalar_tensor(x, ref.dtype, ref.device) if current(x, tracer) else \
            torch.scalar_tensor(x, dtype=ref.dtype, device=ref.device)
        if t is None:
            return NotImplemented
        parts.append(t)
    return torch.stack(parts).reshape(ref.shape)
