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

Every other read bakes the array's values into the graph, and numpy has no version counter to
check: an array of up to ``arrays._BY_VALUE_BYTES`` is keyed by its bytes (``pyvalues.guard_value``:
class weights changed in place between calls are a new graph, they were silently the old ones);
a larger one read so (in Python, by a torch conversion or as an operand) is refused at the
user's line, as is a write into the array (a replay would not write it).
"""
from __future__ import annotations

import sys

from .arrays import read_as_index
from .numchecks import Op
from .tracked import TrackedInt, plain

_KINDS = "biuf"   # bool, int, uint, float elements (a bool element is handed out plain: a use)


def schedule_array(v) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and type(v) is np.ndarray and v.dtype.kind in _KINDS and v.ndim >= 1


def _refuse(view, how: str, write: bool = False):
    from .arrays import _BY_VALUE_BYTES
    from ..errors import CaptureError, user_frame
    if view.sg_uses is None or not view.sg_uses.active or (not write and view.nbytes <= _BY_VALUE_BYTES):
        return   # (a small array is keyed by its bytes: its reads need nothing)
    from .datacalls import in_data_call
    if not write and in_data_call():
        return   # (read by a data call: the whole call is made before the step from the next call on)
    label = view.sg_root.label
    if write:
        raise CaptureError(
            f"the step writes into the numpy array {label} ({how}): a replay would not write it",
            op=how, where=user_frame(),
            fix=f"change {label} outside the step, or keep the values in a tensor the step updates in place")
    from .dataorder import note_read
    from .effects import Problem
    what = (f"the step reads the numpy array {label} ({view.nbytes} bytes) by {how}: a graph would keep "
            f"the values it had at capture, and an array over {_BY_VALUE_BYTES} bytes is not compared "
            "at each call (numpy has no version counter)")
    fix = (f"pass {label} to the step as an argument (numpy arguments are fed at each call), or "
           "make it a tensor once outside the step (torch.from_numpy shares its memory)")
    if note_read(Problem(what, user_frame(), fix, plain=True)):
        return   # (a data call's read, nanoGPT's get_batch: refused unless the call is taken first)
    raise CaptureError(what, op=how, where=user_frame(), fix=fix)


def narrow_float(dtype) -> bool:
    """A float dtype narrower than float64 (float32, float16): numpy computes in it, a Python
    float would not (trace.py names such a hyper-parameter in its refusal)."""
    return dtype.kind == "f" and dtype.itemsize < 8


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
            read_as_index(k)   # (indices passed in: values read, arrays.py)
            arr = self.view(np.ndarray)
            uses = self.sg_uses
            # (a float32 schedule's element is a numpy float32 whose arithmetic eager does in float32
            # -- AdamW's lr / bias_correction: a Python float there was 1.5e-8 off -- so it stays a plain read)
            e = _index_expr(k) if uses is not None and uses.active and not narrow_float(arr.dtype) else None
            if e is not None:
                v = arr[tuple(plain(x) for x in k) if type(k) is tuple else plain(k)]
                if isinstance(v, np.generic):   # (a scalar element, not a row)
                    return uses.derive(v.item(), Op(item_at, (self.sg_root, e)))
            _refuse(self, "indexing")
            return arr[k]

        def __setitem__(self, k, v):
            read_as_index(k)
            _refuse(self, "item assignment", write=True)
            self.view(np.ndarray)[k] = v

        def __array_ufunc__(self, ufunc, method, *inputs, **kw):
            if any(isinstance(x, ScheduleView) for x in kw.get("out", ())):
                _refuse(self, f"numpy.{ufunc.__name__}(out=...)", write=True)
            _refuse(self, f"numpy.{ufunc.__name__}")
            inputs = tuple(x.view(np.ndarray) if isinstance(x, ScheduleView) else x for x in inputs)
            return getattr(ufunc, method)(*inputs, **kw)

        def __array_function__(self, func, types, args, kwargs):
            import torch.utils._pytree as pytree
            _refuse(self, f"numpy.{func.__name__}")
            args, kwargs = pytree.tree_map_only(ScheduleView, lambda x: x.view(np.ndarray), (args, kwargs))
            return func(*args, **kwargs)

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            # (a torch operand or index: ``t * weights``, ``t[mask]``)
            import torch.utils._pytree as pytree
            for x in pytree.tree_leaves((args, kwargs)):
                if isinstance(x, ScheduleView):
                    _refuse(x, f"torch {getattr(func, '__name__', func)}")
            args, kwargs = pytree.tree_map_only(ScheduleView, lambda x: x.view(np.ndarray), (args, kwargs or {}))
            return func(*args, **kwargs)

        def __iter__(self):
            _refuse(self, "iteration")
            return iter(self.view(np.ndarray))

        def item(self, *a):
            _refuse(self, "item()")
            return self.view(np.ndarray).item(*a)

        def tolist(self):
            _refuse(self, "tolist()")
            return self.view(np.ndarray).tolist()

    from .arrays import number_slots
    number_slots(ScheduleView, _refuse)

    _VIEW.append(ScheduleView)
    return ScheduleView


def _converting(f):
    def conv(data, *args, **kwargs):
        if isinstance(data, _view_class()):
            _refuse(data, f"torch.{f.__name__}")
            data = data.view(sys.modules["numpy"].ndarray)
        return f(data, *args, **kwargs)
    return conv


def array_conversions(track):
    """While traced (when ``track`` hands the step views): ``torch.from_numpy`` / ``tensor`` / ``as_tensor`` / ``asarray`` of a view
    (torch reads its memory in C, past every method of the view)."""
    import contextlib
    import torch
    from .patching import patched
    if track is None or not track.arrays:
        return contextlib.nullcontext()
    return patched(torch, {n: _converting(getattr(torch, n)) for n in ("from_numpy", "tensor", "as_tensor", "asarray")})


def view(array, root, uses):
    """The view the trace hands the step in place of ``array``."""
    v = array.view(_view_class())
    v.sg_root, v.sg_uses = root, uses
    uses.root_values[id(root)] = array   # (its type is checked where lifted: ndarray, not the view)
    return v
