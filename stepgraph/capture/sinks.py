"""Where tracked numbers go while the step is traced (tracked.py): printed, or into the graph.

* Printing and logging are not uses. ``print(epoch)`` formats inside ``print`` (``in_sink``).
  ``print(f"Epoch {epoch:04d}")`` format *before* the call: the bytecode after the formatting
  is followed (:func:`format_target`) through string building only to the call taking the text;
  it is no use if that call is ``print`` or a logging method (``_sink`` records its caller's
  frame and instruction) or one redone with the text rebuilt (formats.py). Text used any other
  way (a dict key, ``getattr``) makes the number used.
* :class:`TrackMode` hands torch functions plain numbers. A number that becomes the scalar
  operand of an elementwise op (``meter.sum + val * n``) is used only if that op survives
  dead-code elimination; anything else a torch function takes is used.
"""
from __future__ import annotations

import builtins
import collections
import contextlib
import dis
import functools
import gc
import logging
import operator
import sys
import threading
import types

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.overrides import TorchFunctionMode

from .callframes import _caller, running
from .numchecks import roots_of
from .clock import CLOCKS, clock
from .patching import patched
from .tracked import _PROXIES, plain
from .dynslice import dynamic_slice
from .livefactory import _FACTORIES, _live_float, _live_scalar_tensor, moving_factory

_STATE = threading.local()   # .depth: inside print/logging on this thread; .log: the active UseLog


def in_sink() -> bool:
    return getattr(_STATE, "depth", 0) > 0


# ---- following a formatted string through the bytecode -----------------------------------
_CODE: dict = {}   # code -> (instructions, offsets)


def _instructions(code):
    got = _CODE.get(code)
    if got is None:
        ins = list(dis.get_instructions(code))
        got = _CODE[code] = (ins, [i.offset for i in ins])
    return got


def _at(code, lasti) -> int:
    """Index of the instruction running at ``lasti`` (a call into Python leaves f_lasti on the
    call's last inline cache, past its offset)."""
    import bisect
    _, offsets = _instructions(code)
    return max(0, bisect.bisect_right(offsets, lasti) - 1)


_LOADS = {"LOAD_CONST", "LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_NAME", "LOAD_CLASSDEREF",
          "LOAD_FAST_CHECK", "PUSH_NULL"}
_NOOPS = {"PRECALL", "KW_NAMES", "NOP", "EXTENDED_ARG", "CACHE", "RESUME"}


def _stack(i) -> tuple[int, int] | None:
    """(values popped, values pushed) of the instructions a string-building line uses."""
    op = i.opname
    if op in _LOADS:
        return 0, 1
    if op in _NOOPS:
        return 0, 0
    if op == "LOAD_GLOBAL":
        return 0, 1 + (i.arg & 1)
    if op == "LOAD_ATTR":  # (3.12+: the low bit of its arg marks a method load, as LOAD_METHOD)
        return 1, 1 + (bool(i.arg & 1) if _PY312 else 0)
    if op == "LOAD_METHOD":
        return 1, 2
    if op == "CALL":
        return i.arg + 2, 1
    if op == "CALL_KW":   # 3.13: the keyword names tuple on top
        return i.arg + 3, 1
    if op == "LOAD_FAST_LOAD_FAST":
        return 0, 2
    if op == "FORMAT_VALUE":
        return 1 + bool(i.arg & 4), 1
    if op in ("FORMAT_SIMPLE", "CONVERT_VALUE", "CALL_INTRINSIC_1"):
        return 1, 1
    if op == "FORMAT_WITH_SPEC":
        return 2, 1
    if op == "BINARY_SLICE":
        return 3, 1
    if op in ("BUILD_STRING", "BUILD_TUPLE", "BUILD_LIST"):
        return i.arg, 1
    if op in ("BINARY_OP", "COMPARE_OP", "BINARY_SUBSCR"):
        return 2, 1
    if op.startswith("UNARY_"):
        return 1, 1
    return None


_STRING_OPS = {"FORMAT_VALUE", "BUILD_STRING", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC", "CONVERT_VALUE"}
_PY312 = sys.version_info >= (3, 12)
_ADD = (0, 13)   # BINARY_OP +, +=


def format_target(code, lasti) -> int | None:
    """Offset of the call whose argument the string made at ``lasti`` becomes, through string
    building only; None when it goes anywhere else (or the bytecode is not understood)."""
    ins, _ = _instructions(code)
    i = _at(code, lasti)
    if ins[i].opname not in ("FORMAT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC", "CALL", "CALL_KW", "BINARY_OP"):
        return None
    k = 0   # the string's depth below the top of the stack
    for j in ins[i + 1:]:
        eff = _stack(j)
        if eff is None:
            return None
        pops, pushes = eff
        if k < pops:   # this instruction takes the string
            if j.opname in _STRING_OPS or (j.opname == "BINARY_OP" and j.arg in _ADD):
                k = 0
                continue
            if (j.opname == "CALL" and k < j.arg) or (j.opname == "CALL_KW" and 1 <= k <= j.arg):
                return j.offset
            return None
        k += pushes - pops
    return None


_PRINT = builtins.print


def _sink(orig):
    def sink(*args, **kwargs):
        log = getattr(_STATE, "log", None)
        if log is not None:
            f = _caller()   # (past pycalls' wrapper of a redone logger's method)
            log.confirm(f, running(f).offset)
            if getattr(orig, "__wrapped__", orig) is _PRINT and not in_sink() and log.active:
                # (named at capture unless a replay redoes it: outputs.read_side_effects)
                from ..errors import user_frame
                log.prints.append(user_frame())
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        try:
            return orig(*args, **kwargs)
        finally:
            _STATE.depth -= 1
    sink.__wrapped__ = orig
    return sink


_LOG_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")


class sinks:
    """While tracing: ``print`` and logging calls mark what they format as printing."""

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        import time
        self.saved = [(time, name, getattr(time, name)) for name in CLOCKS]
        for owner, name, orig in self.saved:
            setattr(owner, name, clock(orig, self.log, name))
        self.saved += [(builtins, "print", builtins.print)]
        self.saved += [(owner, name, getattr(owner, name)) for owner in (logging.Logger, logging)
                       for name in _LOG_METHODS if hasattr(owner, name)]
        for owner, name, orig in self.saved[len(CLOCKS):]:
            setattr(owner, name, _sink(orig))
        self.outer, _STATE.log = getattr(_STATE, "log", None), self.log
        return self

    def __exit__(self, *exc):
        for owner, name, orig in self.saved:
            setattr(owner, name, orig)
        _STATE.log = self.outer


# ---- torch functions ---------------------------------------------------------------------
_T = torch.Tensor
_ELEMENTWISE = {_T.__add__, _T.__radd__, _T.__iadd__, _T.__sub__, _T.__rsub__, _T.__isub__, _T.__mul__,
                _T.__rmul__, _T.__imul__, _T.__truediv__, _T.__rtruediv__, _T.__itruediv__, _T.add, _T.add_,
                _T.sub, _T.sub_, _T.mul, _T.mul_, _T.div, _T.div_, torch.add, torch.sub, torch.mul, torch.div,
                _T.fill_}   # (a device-held lr filled from the step's number: optimizers.absorb_floats)


class TrackMode(TorchFunctionMode):
    """Innermost while tracing: torch functions never see a proxy."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.log.moving_labels and (func is _T.__getitem__ or func in _FACTORIES):
            # (a slice's bounds, a factory's fill: no leaves; dynslice.py, livefactory.py)
            out = dynamic_slice(self.log, args, kwargs) if func is _T.__getitem__ else \
                moving_factory(self.log, func, args, kwargs)
            if out is not None:
                return out
        found = [x for x in pytree.tree_leaves((args, kwargs)) if type(x) in _PROXIES]
        if not found:
            return func(*args, **kwargs)
        mode = get_proxy_mode()
        live = {} if func in _ELEMENTWISE or mode is None or not self.log.active else \
            {id(p): f for p in found if (f := _live_float(p, self.log)) is not None}
        if live:   # (the op sees a live float: modes.py keeps its node, or checks the number)
            found = [p for p in found if id(p) not in live]
            args, kwargs = pytree.tree_map(lambda x: live.get(id(x), x), (args, kwargs))
        if func in _ELEMENTWISE and mode is not None and self.log.active and torch.is_grad_enabled():
            # ``coef * loss`` with coef annealed (an entropy or KL weight from the call's
            # arguments): autograd keeps the scalar for the backward, where a graph would bake it.
            # Once it moved, it enters as a 0-dim tensor computed from it at each replay.
            # (operands only: ``alpha=`` must stay a number; fp32/fp64, whose scalar forms round
            # the number to the tensor's dtype as the 0-dim tensor does)
            ref = next((t for t in args if isinstance(t, torch.Tensor)), None)
            if ref is not None and ref.dtype in (torch.float32, torch.float64) and any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in args):
                live = {id(p): t for p in found if any(a is p for a in args)
                        and (t := _live_scalar_tensor(p, self.log, ref)) is not None}
                if live:
                    found = [p for p in found if id(p) not in live]
                    args = tuple(live.get(id(x), x) for x in args)
                    if not found:
                        return func(*args, **kwargs)
        args, kwargs = pytree.tree_map(plain, (args, kwargs))
        if func in _ELEMENTWISE and mode is not None and self.log.active:
            # A scalar operand: the output's shape is the tensor's; the number only matters if
            # the op's result does (a meter's ``sum + x`` that nothing reads is dead).
            graph = mode.tracer.graph
            last = graph._root.prev
            out = func(*args, **kwargs)
            nodes, n = [], last.next
            while n is not graph._root:
                nodes.append(n)
                n = n.next
            # Autograd may save the number for the backward (``loss * scale``), which would
            # bake it there: lifted only where no gradient flows.
            grads = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                    for t in pytree.tree_leaves((args, kwargs)))
            if nodes and isinstance(out, torch.Tensor):
                for p in found:
                    if grads or not _lift_into(nodes, p, found, self.log):
                        self.log.node_use(p, nodes)
                return out
            for p in found:
                p._use(force=True)
            return out
        for p in found:
            p._use(force=True)
        return func(*args, **kwargs)


def mode_graph():
    return get_proxy_mode().tracer.graph


def _lift_into(nodes, p, found, log) -> bool:
    """Put the graph node reading ``p`` at each replay (UseLog.lift) where its value is the
    op's scalar (``meter.sum / meter.count``); False when that place is not unique."""
    v = p._v
    if not (log.lift_tensor_ops or log.moving(p)) or any(q is not p and plain(q) == v for q in found):
        return False
    same = lambda a: type(a) is type(v) and a == v   # noqa: E731
    places = [(n, k) for n in nodes for k in list(range(len(n.args))) + list(n.kwargs) if
              same(n.args[k] if isinstance(k, int) else n.kwargs[k])]
    if len(places) != 1:
        return False
    n, k = places[0]
    with mode_graph().inserting_before(nodes[0]):   # (the op is recorded already: read before it)
        node = log.lift(p)
    if node is None:
        return False
    node.meta.setdefault("host_value", v)   # (its type: passes/device_scalars.py keeps int ops integral)
    if isinstance(k, int):
        n.args = n.args[:k] + (node,) + n.args[k + 1:]
    else:
        n.kwargs = {**n.kwargs, k: node}
    return True


def unwrap_result(result, log):
    """Returned numbers, plain. One computed from the call's numbers alone (``lr`` from an ``it``
    argument) is computed again at each replay (``log.returned_exprs``: leaf index -> expression);
    one involving a value read from a tensor is checked (a replay hands back the capture's)."""
    leaves, spec = pytree.tree_flatten(result)
    if not any(type(x) in _PROXIES for x in leaves):
        return result
    out = []
    for i, x in enumerate(leaves):
        if type(x) in _PROXIES:
            if any(r.kind == "read" for r in roots_of(x._e)):
                # (``return loss.item(), pred.eq(y).sum().item()``: the count computed at each
                # replay from the graph's read, a graph output; it was a graph per count)
                node = log.lift(x, typed=False) if log.active else None
                if node is not None:
                    log.returned_nodes[i] = node
                else:
                    log.used(x._e, x._v, "returned from the step")
            else:
                log.returned_exprs[i] = x._e
            x = x._v
            log.returned.add(id(x))
        out.append(x)
    return pytree.tree_unflatten(out, spec)


def scrub(log) -> None:
    """Replace proxies the step stored in Python objects (a meter's ``val``, a list) by plain
    numbers: after the trace nothing outside stepgraph should hold one."""
    replace_escaped(log.proxies, lambda v: v._v)


def replace_escaped(made: list, plain, users=None) -> None:
    """Each value of ``made`` held elsewhere (a list, dict, deque, cell, tuple) replaced there by
    ``plain(value)``, ``made`` emptied; ``users``: which holders to change (None: all)."""
    # Held only by ``made`` (+ the loop variable and getrefcount's argument): not escaped.
    out = [p for p in made if sys.getrefcount(p) > 3]
    made.clear()
    if not out:
        return
    ids = {id(p) for p in out}
    holders = gc.get_referrers(*out)
    holders = users(holders) if users else holders
    _replace(holders, ids, plain, out)
    # A tuple holding one (an argument's ``(state, action)`` the step stored, ``memory.put(t)``)
    # cannot change: the tuple is replaced, with plain numbers, where it is held.
    tuples = [r for r in holders if type(r) is tuple and any(id(v) in ids for v in r)]
    del holders
    if tuples:
        new = {id(t): tuple(plain(v) if id(v) in ids else v for v in t) for t in tuples}
        refs = gc.get_referrers(*tuples)
        _replace(users(refs) if users else refs, set(new), lambda t: new[id(t)], tuples)


def _replace(holders, ids: set, plain, own) -> None:
    """In each dict, list, deque and cell among ``holders``: the values whose id is in ``ids``
    replaced by ``plain(value)``."""
    for r in holders:
        if isinstance(r, dict):
            for k, v in list(r.items()):
                if id(v) in ids:
                    r[k] = plain(v)
        elif isinstance(r, (list, collections.deque)) and r is not own:
            for i, v in enumerate(list(r)):
                if id(v) in ids:
                    r[i] = plain(v)
        elif isinstance(r, types.CellType):
            if id(r.cell_contents) in ids:
                r.cell_contents = plain(r.cell_contents)


# ---- sizes given one by one ---------------------------------------------------------------
# torch's argument parser takes ``torch.zeros(n, d)`` as a size list only when ``n`` is an int:
# with a proxy there it raises "zeros() takes 1 positional argument but 2 were given" before any
# torch function mode sees the call (``torch.empty(world * x.shape[0], d)`` in a step crashed
# the trace). While traced these callables get the proxies' values: a use, as shapes are.
_SIZED_TORCH = ("empty", "zeros", "ones", "rand", "randn")
_SIZED_METHODS = ("expand", "new_zeros", "new_ones", "new_empty", "resize_")


def _plain_sizes(f, first: int):
    def call(*args, **kwargs):
        if len(args) > first and type(args[first]) in _PROXIES:
            args = args[:first] + tuple(operator.index(a) if type(a) in _PROXIES else a for a in args[first:])
        return f(*args, **kwargs)
    return functools.update_wrapper(call, f)


@contextlib.contextmanager
def sized_calls():
    with patched(torch, {n: _plain_sizes(getattr(torch, n), 0) for n in _SIZED_TORCH}), \
            patched(torch.Tensor, {n: _plain_sizes(getattr(torch.Tensor, n), 1) for n in _SIZED_METHODS}):
        yield
