"""Temporary replacement of attributes on classes and modules while a step is traced.

Put back exactly what was there: an attribute a class only inherits is deleted again, never
assigned. ``torch.Tensor.__getitem__ = saved`` copies TensorBase's slot into Tensor's own
``__dict__``, and CPython then treats every tensor as a Python sequence: the user's later
``torch.tensor([torch.tensor(1.)])`` raises "len() of a 0-d tensor" (the CI failure of stop 31).
"""
from __future__ import annotations

import contextlib

_ABSENT = object()


@contextlib.contextmanager
def patched(owner, replacements: dict):
    """``owner.<name> = value`` for each item while inside; restored on exit, whatever raised."""
    own = vars(owner)
    saved = [(name, own.get(name, _ABSENT)) for name in replacements]
    try:
        for name, value in replacements.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, old in reversed(saved):
            if old is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, old)
