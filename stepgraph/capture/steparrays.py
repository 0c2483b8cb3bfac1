"""``Tensor.numpy()`` of a value the step computed, returned from the step.

DLRM's loop body ends ``L = E.detach().cpu().numpy()`` and the loop uses ``L`` after the call.
A numpy array is a host copy of this call's values; traced as is, every replay would hand back
the capture's array. Instead ``.numpy()`` of a traced CPU tensor gives the step a
:class:`StepArray` (the real values, watched): returned untouched, the tensor is a graph output
and each replay hands back ``.numpy()`` of its own value (``("numpy", k)`` in the output kinds,
captured.py). Read in the step (printed, converted, used in numpy or torch) or kept anywhere
else (a list, an attribute), the array is this call's value: the capture is refused as before,
at the ``.numpy()`` line.
"""
from __future__ import annotations

import gc
import sys
import traceback
import weakref

import torch.utils._pytree as pytree

_CLASS: list = []


def _step_array_class():
    if _CLASS:
        return _CLASS[0]
    import numpy as np

    class StepArray(np.ndarray):
        sg_tensor = None   # the traced tensor it was made from
        sg_reads: list = []

        def _read(self, how):
            self.sg_reads.append(how)

        def __array_finalize__(self, obj):
            if isinstance(obj, StepArray):
                obj._read("a derived array")
                self.sg_reads, self.sg_tensor = obj.sg_reads, obj.sg_tensor

        def __array_ufunc__(self, ufunc, method, *inputs, **kw):
            self._read(f"numpy.{ufunc.__name__}")
            inputs = tuple(x.view(np.ndarray) if isinstance(x, StepArray) else x for x in inputs)
            return getattr(ufunc, method)(*inputs, **kw)

        def __array_function__(self, func, types, args, kwargs):
            self._read(f"numpy.{func.__name__}")
            return super().__array_function__(func, types, args, kwargs)

        def item(self, *a):
            # (pytorch-tabnet's ``loss.cpu().detach().numpy().item()``: the tensor's own ``.item()``,
            # a value read again at each replay, not a read of this array; it was refused)
            if not a and self.size == 1 and self.sg_tensor is not None:
                return self.sg_tensor.item()
            self._read("item()")
            return self.view(np.ndarray).item(*a)

    def reading(name):
        def method(self, *a, **k):
            self._read(name.strip("_") + "()")
            return getattr(self.view(np.ndarray), name)(*a, **k)
        method.__name__ = name
        return method
    for name in ("__getitem__", "__iter__", "tolist", "tobytes", "__float__", "__int__",
                 "__bool__", "__index__", "__repr__", "__str__", "__format__", "__array__",
                 "__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__"):
        if hasattr(np.ndarray, name):
            setattr(StepArray, name, reading(name))
    _CLASS.append(StepArray)
    return StepArray


def is_step_array(v) -> bool:
    return bool(_CLASS) and isinstance(v, _CLASS[0])


class StepArrays:
    """The arrays one trace handed out (weakly: one still alive after the step is kept somewhere)."""

    def __init__(self):
        self.made: list = []   # (weakref to the array, the user's frame of the .numpy() call, its reads)

    def note_torch_use(self, func, args, kwargs) -> None:
        """A torch function given one (``torch.from_numpy(L)``, ``t[L]``): reads its values."""
        if self.made:
            for v in pytree.tree_leaves((args, kwargs)):
                if is_step_array(v):
                    v._read(getattr(func, "__name__", "a torch function"))

    def make(self, t, values):
        """The watched array for ``t.numpy()`` (``values``: its real values)."""
        from ..errors import user_frame
        a = values.view(_step_array_class())
        a.sg_tensor, a.sg_reads = t, []
        # (its reads are kept: an array local to the step is gone when the step returns, and
        # minimalRL's GAE read one in a Python loop that way: the replays reused its values)
        self.made.append((weakref.ref(a), user_frame(traceback.extract_stack()), a.sg_reads))
        return a

    def problems(self, out) -> list:
        """(where, what) for each array the step read or kept other than in what it returns."""
        if not self.made:
            return []
        leaves = pytree.tree_leaves(out)
        mine = {id(c) for c in _containers(out)} | {id(leaves)}
        found = []
        for ref, where, reads in self.made:
            a = ref()
            if reads:
                found.append((where, f"its values are used in the step ({reads[0]})"))
            elif a is None:
                continue
            elif not any(v is a for v in leaves):
                found.append((where, "it is kept outside what the step returns"))
            elif any(id(r) not in mine and not _internal(r, out) for r in gc.get_referrers(a)):
                found.append((where, "it is also kept outside what the step returns"))
        return found


def _containers(out) -> list:
    """The tuples, lists and dicts of the step's result (which hold the arrays it returns)."""
    found, todo = [], [out]
    while todo:
        v = todo.pop()
        if isinstance(v, (tuple, list, dict)):
            found.append(v)
            todo.extend(v.values() if isinstance(v, dict) else v)
    return found


def _internal(r, out) -> bool:
    """A frame, or the trace's own cell holding the result (an array returned bare)."""
    if type(r).__name__ == "cell":
        return r.cell_contents is out
    return type(r).__name__ == "frame" or r is sys.modules[__name__].__dict__


def plain(v):
    """A returned StepArray as the plain array eager returns (the capturing call's result)."""
    import numpy as np
    return v.view(np.ndarray) if is_step_array(v) else v
