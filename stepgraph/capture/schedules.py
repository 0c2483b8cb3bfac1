"""numpy arrays the step indexes by a tracked number: DINO's ``g['lr'] = lr_schedule[it]``.

A schedule precomputed as a numpy array (``utils.cosine_scheduler`` in DINO, iBOT, MAE-style
code) and indexed by the iteration made the index a value use of ``it``: one graph per
iteration, a recapture at every call, then eager. While traced, such an array of the step's
closure or globals is replaced by a view whose ``[i]`` with a tracked index hands out a tracked
number computed *from the array and the index*: ``item_at(lr_schedule, 10 * epoch + it)``. Its
checks and lifted nodes read the array where the step reads it, at each replay, so a changed
schedule (``lr_schedule[:] = ...``, a rebound array keyed anew) is what the graph uses, as in
eager. Any other read of the array (a slice, ``lr_schedule.max()``, a constant index) is a plain
read of the array the graph is keyed by, as before.

The element comes back as a Python float (int for integer arrays) where eager gives a numpy
scalar of the same value: arithmetic, optimizers and torch take them alike.
"""
from __future__ import annotations

import sys

from .numchecks import Op
from .tracked import TrackedInt, plain

_KINDS = "iuf"   # int, uint, float elements: numbers a proxy can stand for


def schedule_array(v) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and type(v) is np.ndarray and v.dtype.kind in _KINDS and v.ndim >= 1


def item_at(array, index):
    """The expression's op: ``array[index]`` as a Python number (graph node target, check)."""
    return array[index].item()


def pack(*xs):
    """A tuple index of tracked numbers (``schedule[epoch, it]``)."""
    return xs


def _index_expr(k):
    """The expression of a tracked index, or None for an index with no tracked number."""
    if type(k) is TrackedInt:
        return k._e
    if type(k) is tuple and any(type(x) is TrackedInt for x in k) \
            and all(type(x) in (int, TrackedInt) for x in k):
        return Op(pack, tuple(x._e if type(x) is TrackedInt else x for x in k))
    return None


_VIEW: list = []


def _view_class():
    if _VIEW:
        return _VIEW[0]
    import numpy as np

    class ScheduleView(np.ndarray):
        """The array as the traced step sees it (module doc); numpy results are plain arrays."""
        sg_root = None    # numchecks.Root of the array's source (only on the view handed out)
        sg_uses = None    # the trace's UseLog

        def __getitem__(self, k):
            arr = self.view(np.ndarray)
            uses = self.sg_uses
            e = _index_expr(k) if uses is not None and uses.active else None
            if e is not None:
                v = arr[tuple(plain(x) for x in k) if type(k) is tuple else plain(k)]
                if isinstance(v, np.generic):   # (a scalar element, not a row)
                    return uses.derive(v.item(), Op(item_at, (self.sg_root, e)))
            return arr[k]

        def __array_ufunc__(self, ufunc, method, *inputs, **kw):
            inputs = tuple(x.view(np.ndarray) if isinstance(x, ScheduleView) else x for x in inputs)
            return getattr(ufunc, method)(*inputs, **kw)

        def __array_function__(self, func, types, args, kwargs):
            import torch.utils._pytree as pytree
            args, kwargs = pytree.tree_map_only(ScheduleView, lambda x: x.view(np.ndarray), (args, kwargs))
            return func(*args, **kwargs)

    _VIEW.append(ScheduleView)
    return ScheduleView


def view(array, root, uses):
    """The view the trace hands the step in place of ``array``."""
    v = array.view(_view_class())
    v.sg_root, v.sg_uses = root, uses
    uses.root_values[id(root)] = array   # (its type is checked where lifted: ndarray, not the view)
    return v
