"""``t.data = new`` in the step: SpectralNorm's power iteration (``u.data = l2normalize(...)``),
hand-written SGD (``p.data = p.data - lr * p.grad``).

Rebinding a tensor's data goes past the dispatcher: ``make_fx`` records nothing, the graph reads
the tensor as the capture left it, and every replay drops the update (the SNGAN client's u and
v froze; its generator loss was 39x off eager after 8 steps). While traced, the setter writes
the new values into the tensor's own memory instead, through ``.data`` (recorded as ``detach``
+ ``copy_``, no version bump, as eager's rebind makes none): the values eager has, at the same
address (a CUDA graph's state keeps its pointers). What a copy cannot reproduce is refused at
the user's line: another shape, dtype, device or layout, a tensor subclass, or the data of a
tensor of the step's state (eager would make the two share memory).
"""
from __future__ import annotations

import contextlib

import torch

from .patching import patched

_BASE = torch._C.TensorBase.data   # the C getset: what ``t.data`` is outside a trace


def _plain(t) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _why_not(t, new, named) -> str | None:
    if not (_plain(t) and _plain(new)):
        return "a tensor subclass"
    if (t.shape, t.dtype, t.device, t.layout) != (new.shape, new.dtype, new.device, new.layout) \
            or t.layout != torch.strided:
        return (f"its {str(t.dtype).replace('torch.', '')}{list(t.shape)} on {t.device} becomes "
                f"{str(new.dtype).replace('torch.', '')}{list(new.shape)} on {new.device}")
    if named(new) is not None and new is not t:
        return f"it would share memory with {named(new)}"
    return None


@contextlib.contextmanager
def data_assignments(named):
    """While traced: ``t.data = new`` copies ``new`` into ``t`` (module doc). ``named``: the
    registry's ``name_of`` (a tensor of the step's state, or None)."""
    def get(self):
        return _BASE.__get__(self)

    def set_(self, new):
        why = _why_not(self, new, named) if isinstance(new, torch.Tensor) else "not a tensor"
        if why is not None:
            from ..errors import CaptureError, user_frame
            who = named(self) or "a tensor"
            raise CaptureError(
                f"the step assigns {who}.data ({why}): a captured graph cannot rebind a tensor's "
                "data", op="Tensor.data", where=user_frame(),
                fix="write the values in place instead (with torch.no_grad(): t.copy_(new)), or "
                    "do this outside the step")
        src = new.clone() if new.untyped_storage().data_ptr() == self.untyped_storage().data_ptr() else new
        with torch.no_grad():
            _BASE.__get__(self).copy_(src)

    with patched(torch.Tensor, {"data": property(get, set_, doc=_BASE.__doc__)}):
        yield
