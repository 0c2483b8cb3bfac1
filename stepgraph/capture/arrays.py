"""numpy arrays passed to the step (CleanRL's ``mb_inds`` minibatch indices, an RL batch handed
over as arrays): graph inputs, like tensors.

torch turns such an array into a tensor inside its own C++ (``t[mb_inds]``, ``torch.from_numpy``,
``torch.as_tensor``, ``torch.tensor``): the trace sees a constant over the array's memory, with
no graph input behind it. Keyed by identity, a new array at every call was a new graph at every
call (ppo_cleanrl: a capture per minibatch). Instead the array is a graph input: the signature
keys it by dtype, shape and strides, the trace's constants over its memory become that input
(:func:`rebind_array_constants`), and each call feeds ``torch.from_numpy(array)`` (no copy).

What a graph cannot follow is the array read in Python (``inds.sum()``, ``inds[0]``, ``for i in
inds``, ``inds.tolist()``): the trace hands the step a watching view (:func:`watching`) that
records such reads. An array the step read is keyed by its values (small) or its identity, as
before, so a replay never reuses what Python computed from another array's values.
"""
from __future__ import annotations

import contextlib
import dis
import sys
import warnings

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from .patching import patched
from .sigkey import Ident

_KINDS = "biufc"           # bool, int, uint, float, complex: dtypes torch.from_numpy takes
_BY_VALUE_BYTES = 4096     # an array read in Python is keyed by its bytes up to this size


def input_array(x) -> bool:
    """An exact numpy ndarray that ``torch.from_numpy`` takes without a copy."""
    np = sys.modules.get("numpy")
    if np is None or type(x) is not np.ndarray:
        return False
    d = x.dtype
    return (d.kind in _KINDS and d.isnative and x.ndim > 0
            and all(s >= 0 and s % d.itemsize == 0 for s in x.strides))


def as_input(x):
    """The graph input for one leaf: the array's memory as a tensor (tensors pass through)."""
    if isinstance(x, torch.Tensor):
        return x
    with warnings.catch_warnings():   # (a read-only array: the graph only reads it)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x)


def array_key(x, read: bool) -> tuple:
    """An input array's part of the signature; ``read``: the step read it in Python."""
    meta = ("ndarray", x.dtype.name, x.shape, x.strides)
    if not read:
        return meta
    if x.nbytes <= _BY_VALUE_BYTES:
        return meta + (x.tobytes(),)
    return meta + (("object", Ident(x)),)   # (held: no later array gets its id while keyed)


_WATCHED: list = []   # the view class, made once numpy is imported


def _watched_class():
    if _WATCHED:
        return _WATCHED[0]
    import numpy as np

    class WatchedArray(np.ndarray):
        """A view of an input array handed to the step while it is traced: reading its values in
        Python marks it (``reads``); torch's conversions read its memory, not through these."""
        sg_reads: list = []
        sg_pos: int = -1

        def _read(self, how):
            self.sg_reads.append((self.sg_pos, how))

        def __array_finalize__(self, obj):
            if isinstance(obj, WatchedArray):   # a view, copy, reshape or astype of it
                obj._read("a derived array")
                self.sg_reads, self.sg_pos = obj.sg_reads, obj.sg_pos

        def __array_ufunc__(self, ufunc, method, *inputs, **kw):
            self._read(f"numpy.{ufunc.__name__}")
            inputs = tuple(x.view(np.ndarray) if isinstance(x, WatchedArray) else x for x in inputs)
            return getattr(ufunc, method)(*inputs, **kw)

        def __array_function__(self, func, types, args, kwargs):
            self._read(f"numpy.{func.__name__}")
            return super().__array_function__(func, types, args, kwargs)

        def __getitem__(self, k):
            self._read("indexing")
            read_as_index(k)
            return self.view(np.ndarray)[k]

        def __setitem__(self, k, v):
            read_as_index(k)
            np.ndarray.__setitem__(self, k, v)

        def __len__(self):
            # torch's C indexing walks a non-tuple sequence index item by item (is it a list of
            # indices? does an item override torch functions?) but takes an exact ndarray by
            # its memory. Asked from there, this view says it is empty: nothing is walked, and the
            # index reaches _PlainIndexing (or torch's numpy conversion), which reads memory only.
            n = np.ndarray.__len__(self)
            return 0 if _torch_indexing(sys._getframe(1)) else n

        def __iter__(self):
            self._read("iteration")
            return iter(self.view(np.ndarray))

        def item(self, *a):
            self._read("item()")
            return self.view(np.ndarray).item(*a)

        def tolist(self):
            self._read("tolist()")
            return self.view(np.ndarray).tolist()

        def tobytes(self, *a, **k):
            self._read("tobytes()")
            return self.view(np.ndarray).tobytes(*a, **k)

    number_slots(WatchedArray, lambda a, how: a._read(how))

    _WATCHED.append(WatchedArray)
    return WatchedArray


def number_slots(cls, read) -> None:
    """``float(a)``, ``int(a)``, ``bool(a)``, ``range(a)`` of a watching ndarray view: numpy's C
    number slots, each reported as ``read(view, how)`` first (arrays here, schedules.py)."""
    import numpy as np

    def converting(name):
        def method(self):
            # (reported once it succeeded: numpy refuses an array of several items without
            # reading it, as ``torch.FloatTensor(noise)`` asks ``__index__`` first -- is it a size?)
            out = getattr(self.view(np.ndarray), name)()
            read(self, f"{name.strip('_')}()")
            return out
        method.__name__ = name
        return method
    for name in ("__float__", "__int__", "__bool__", "__index__", "__complex__"):
        setattr(cls, name, converting(name))


_SUBSCRIPT_OPS = frozenset(dis.opmap[n] for n in ("BINARY_SUBSCR", "STORE_SUBSCR") if n in dis.opmap)
# (Python 3.14: a read subscript is BINARY_OP with the NB_SUBSCR argument)
_NB_SUBSCR = next((i for i, (name, _) in enumerate(getattr(dis, "_nb_ops", ())) if name == "NB_SUBSCR"), None)


def _torch_indexing(frame) -> bool:
    """The length is asked while ``frame`` runs a subscript (``t[a]``, ``t[a] = v``): the asker is
    the container's C indexing (torch's sequence walk; numpy, list and dict never ask)."""
    code, i = frame.f_code.co_code, frame.f_lasti
    if not 0 <= i < len(code) - 1:
        return False
    return code[i] in _SUBSCRIPT_OPS or (
        _NB_SUBSCR is not None and code[i] == dis.opmap.get("BINARY_OP") and code[i + 1] == _NB_SUBSCR)


def read_as_index(k) -> None:
    """``k`` indexes a numpy array: numpy reads a watched array in it by its memory, in C, past
    every method of the view (TD3's ``self.state[ind]``), so the read is marked here."""
    if not _WATCHED:
        return
    for x in k if type(k) is tuple else (k,):
        if isinstance(x, _WATCHED[0]):
            x._read("an index into another array")


def watch(x, pos: int, reads: list):
    """The view of input array ``x`` the traced step gets."""
    v = x.view(_watched_class())
    v.sg_reads, v.sg_pos = reads, pos
    return v


def _plain(index):
    """An index with its watched arrays as plain ones: torch indexes by a plain array's memory,
    but walks a subclass element by element (a read of every value)."""
    import numpy as np
    W = _watched_class()
    return pytree.tree_map(lambda x: x.view(np.ndarray) if isinstance(x, W) else x, index,
                           is_leaf=lambda x: isinstance(x, W))


class _PlainIndexing(TorchFunctionMode):
    """Tensor indexing by a watched array indexes by its memory, as by a plain array (the view's
    ``__len__`` keeps torch from walking it first). A mode, not a patch of
    ``Tensor.__getitem__``: a Python ``__getitem__`` on the class makes every tensor a Python
    sequence (``torch.tensor([torch.tensor(1.)])`` then raises "len() of a 0-d tensor", in the
    step and, once left behind, in the user's eager code: the CI failure of stop 31)."""

    _FUNCS = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._FUNCS:
            args = (args[0],) + tuple(_plain(a) for a in args[1:])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watching(reads: list):
    """While the step is traced: tensor indexing by a watched array reads its memory (as for a
    plain array), and ``numpy.asarray``/``array`` of one (which would hand out an unwatched
    array) counts as a read."""
    import numpy as np
    W = _watched_class()

    def converting(f, name):
        def conv(a, *args, **kw):
            if isinstance(a, W):
                a._read(f"numpy.{name}")
            return f(a, *args, **kw)
        return conv

    names = ("asarray", "array", "ascontiguousarray", "asanyarray")
    with patched(np, {name: converting(getattr(np, name), name) for name in names}), _PlainIndexing():
        yield


_LIFT = (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default)
_INDEX_OPS = frozenset((torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor, torch.ops.aten.index_put.default,
                        torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default))


class ArrayUses:
    """While tracing: the tensors over the input arrays' memory, make_fx's copies of them
    (``lift_fresh_copy``) and their views and CPU results (capture/modes.py asks)."""

    def __init__(self, tensors):
        self.spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors]
        self.copies: dict = {}     # id -> make_fx's copy of an array's memory, or a view of one
        self.derived: dict = {}    # id -> a CPU result of array tensors only (CUDA steps)

    def over(self, t) -> bool:
        try:
            p = t.data_ptr()
        except (RuntimeError, AttributeError):
            return False
        return any(lo <= p < hi for lo, hi in self.spans)

    def _of(self, t, d: dict) -> bool:
        return d.get(id(t)) is t

    def check_write(self, func, args) -> None:
        """Refuse ``func`` writing in place into a copy of an array: eager writes the user's
        array (``torch.from_numpy(a).mul_(2)``), the trace would write the copy (the refusal
        undoes the trace; the call runs eagerly)."""
        if not self.spans or not isinstance(func, torch._ops.OpOverload) or func in _LIFT:
            return
        if any(isinstance(v, torch.Tensor) and a.alias_info is not None and a.alias_info.is_write
               and self._of(v, self.copies) for a, v in zip(func._schema.arguments, args)):
            from ..errors import CaptureError, user_frame
            raise CaptureError(
                f"the step writes in place ({func}) into a tensor over a numpy array argument "
                "(torch.from_numpy / as_tensor): a trace writes a copy of it, so the array would not "
                "change as in eager", op=str(func), where=user_frame(),
                fix="write into a tensor made with .clone() (or torch.tensor(...)), or change the array "
                    "with numpy outside the step")

    def note(self, func, args, out) -> None:
        if not self.spans or not isinstance(func, torch._ops.OpOverload):
            return
        if func in _LIFT:
            if self.over(args[0]):
                self.copies[id(out)] = out
        elif isinstance(out, torch.Tensor) and func._schema.returns and func._schema.returns[0].alias_info is not None \
                and args and isinstance(args[0], torch.Tensor) and self._of(args[0], self.copies):
            self.copies[id(out)] = out   # a view of one

    def device_index(self, func, args, kwargs, out) -> bool:
        """In a CUDA step: a CPU op on array tensors only (a copy, cast or view), or a device
        tensor indexed by them: not CPU work, the array moves to the device before the graph
        (passes/moved_arguments.py)."""
        if not self.spans:
            return False
        cpu = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
        if not cpu or not all(self.over(a) or self._of(a, self.derived) or self._of(a, self.copies) for a in cpu):
            return False
        if func in _INDEX_OPS or func is torch.ops.aten._to_copy.default:   # (t[inds] moves inds itself)
            return True
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if outs and all(o.device.type == "cpu" for o in outs):
            for o in outs:
                self.derived[id(o)] = o
            return True
        return False


def rebind_array_constants(gm: torch.fx.GraphModule, arrays: dict) -> set:
    """Each constant of ``gm`` over an input array's memory becomes that input (``arrays``:
    placeholder node -> the array's tensor); a view of it of another kind is made from the input
    by ``as_strided``. Returns the placeholders whose array a constant viewed as another dtype
    (read otherwise: keyed by value)."""
    spans = []
    for ph, t in arrays.items():
        start = t.data_ptr()
        spans.append((ph, t, start, start + t.untyped_storage().nbytes()))
    odd: set = set()
    for n in list(gm.graph.nodes):
        if n.op != "get_attr":
            continue
        c = getattr(gm, n.target, None)
        if not isinstance(c, torch.Tensor) or c.device.type != "cpu" or c.layout != torch.strided:
            continue
        try:
            p = c.data_ptr()
        except RuntimeError:
            continue
        for ph, t, lo, hi in spans:
            if not lo <= p < hi:
                continue
            if c.dtype != t.dtype:
                odd.add(ph)
                break
            with gm.graph.inserting_after(n):
                if (c.shape, c.stride(), p) == (t.shape, t.stride(), lo):
                    new = ph
                else:
                    new = gm.graph.call_function(torch.ops.aten.as_strided.default, (
                        ph, list(c.shape), list(c.stride()), (p - lo) // c.element_size()))
                    new.meta["val"] = c
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
            delattr(gm, n.target)
            break
    gm.recompile()
    return odd
