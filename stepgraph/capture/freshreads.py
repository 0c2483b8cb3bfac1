"""Chains the step reads that build a new tensor at every access, so that reading one has no
identity to guard: a view of a tensor (``self.weight.T``, ``.data``, ``[0]``) and a weight
``torch.nn.utils.parametrize`` computes (pyvalues.find_sources skips both)."""
from __future__ import annotations

import torch
from torch import nn

from .valuekeys import item


def parametrized(s: "Source", args) -> bool:
    """A chain through ``m[0].weight`` where ``torch.nn.utils.parametrize`` registered ``weight``
    on ``m[0]`` (parametrizations.orthogonal / weight_norm / spectral_norm; ``m[0].weight.T``
    too): a property that computes a new tensor from its original parameter at every read.
    Read here it was a new tensor at each read, refused as a rebinding, and each read ran the
    parametrization: spectral_norm's power iteration updated its ``_u``/``_v`` buffers again,
    beyond eager's (from the warm-up call on). The graph computes it; the module is the source."""
    try:
        v = s._root_value(args)
        for kind, k in s.path:
            if kind == "attr" and isinstance(v, nn.Module) and nn.utils.parametrize.is_parametrized(v, k):
                return True
            v = getattr(v, k) if kind == "attr" else item(v, k)
    except Exception:  # noqa: BLE001 - a chain that does not resolve reads nothing
        return False
    return False


def view_of_parent(s: "Source", v, args) -> bool:
    """``self.weight.T`` / ``.mT`` / ``.data`` / ``[0]``: an attribute or item of a tensor that reads as a new
    tensor over the same memory at every access. Keyed by identity it would differ at each
    read (a refusal, or a random recapture when CPython reuses the address); it is the parent
    tensor, which the graph reads as state or an argument."""
    if not (isinstance(v, torch.Tensor) and s.path and s.path[-1][0] in ("attr", "item")):
        return False   # (``self.queue_ptr[0]``: indexing makes a new view at each read too)
    parent = type(s)(s.kind, s.root, s.name, s.path[:-1]).read_or(args)
    if not isinstance(parent, torch.Tensor) or parent.device.type == "meta" or v.device.type == "meta":
        return False
    again = s.read_or(args)
    try:
        return again is not v and v.untyped_storage().data_ptr() == parent.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, subclasses)
        return False
