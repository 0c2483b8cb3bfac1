"""Host reads of values the step computes: live values and value guards (issue: segments).

``loss.item()``, ``float(t)``, ``bool(t)``, ``if torch.isfinite(loss):`` make the host wait
for a tensor's value. Eager pays that sync too; what a graph cannot do is *bake* the value
(one branch of an ``if``, one number in a log line). While tracing, such a read becomes:

* a ``ReadFloat`` for a float read (``.item()``/``float()``): the graph recomputes it at each
  replay (a ``_local_scalar_dense`` node) and everything Python does with it by arithmetic
  (``loss.item() * accum``) stays live; returned, it is this call's value, not the capture's;
* a **value guard** where Python decides something from it: a comparison, ``bool()``,
  ``int()``, an int/bool tensor read, a use autograd saves. The guard node records the value
  the trace saw; at replay it re-reads it, and on a different value restores what the graph
  wrote so far and raises :class:`GuardMiss`, so that call is captured again for the new value.

Uses the trace cannot follow are guarded by value (``float(x)`` of a ReadFloat, the values
``math.isnan``/``isfinite`` read) or reported (printing/formatting runs only at capture).
"""
from __future__ import annotations

import builtins
import gc
import json
import math
import operator
import types
import weakref
from dataclasses import dataclass, field

import torch

from ..errors import library_frame, user_frame
from ..markers import host_guard
from .formats import note
from .hostscalar import (HostFloat, _plain, _tracked, _tracer, current, live_op, node_arg,
                         record_item, substitute)


@dataclass
class ReadLog:
    """What the trace saw of host reads: guards (site, what, value) and reported uses."""
    guards: list = field(default_factory=list)
    printed: list = field(default_factory=list)   # sites that formatted a read value (logging)
    formats: list = field(default_factory=list)   # formats.Format: values formatted into text, in order
    guarded: list = field(default_factory=list)   # plain values handed out under a guard
    reads: list = field(default_factory=list)     # every ReadFloat made (to find where they went)
    uses: object = None                           # tracked.UseLog: int reads become tracked numbers
    int_reads: list = field(default_factory=list)  # numchecks.Root("read") of each one
    ctxs: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # Functions' ctx a backward used (fnbackward.py)

    def __post_init__(self):
        if self.uses is not None:   # (numbers formatted on a line go in the same order: formats.py)
            self.uses.formats = self.formats

    def sites(self) -> list[str]:
        """Where the step read values on the host (live reads and guards), in order."""
        return list(dict.fromkeys([r.site for r in self.reads] + [r.ref.site for r in self.int_reads]
                                  + [g[0] for g in self.guards]))

    def guard(self, node, value, what: str, site: str | None = None):
        tracer = _tracer()
        if tracer is None:
            return
        site = site or user_frame()
        tracer.create_node("call_function", host_guard, (node, value, site, what), {})
        self.guards.append((site, what, value))


class ReadFloat(HostFloat):
    """A float the step read from a tensor it computed: live through arithmetic, guarded where
    Python branches on it."""

    __slots__ = ("site", "log")
    derive_rank = 1  # ``lr * loss.item()`` is a read value (guarded where Python branches on it)
    number_use_by_node = True

    def __new__(cls, value, node, site, log):
        self = HostFloat.__new__(cls, value, node)
        self.site, self.log = site, log
        log.reads.append(self)
        return self

    def _derive(self, value, node):
        return ReadFloat(value, node, self.site, self.log)

    def __float__(self):
        # float(x) hands Python a plain copy the trace cannot follow: guard the exact value.
        value = _plain(self)
        if current(self, _tracer()):
            self.log.guard(self.node, value, "float() of a value read from a tensor", self.site)
            self.log.guarded.append(value)
        return value

    def _note_print(self, text=None, spec=""):
        if current(self, _tracer()):   # (a call redoing a string built from it rebuilds it: formats.py)
            note(self.log, self.node, text, spec)
        return text

    def __format__(self, fmt):
        return self._note_print(float.__format__(_plain(self), fmt), fmt)

    def __str__(self):
        # (not float.__format__(self, ""): an empty spec calls str(self) again)
        return self._note_print(float.__repr__(self), "")

    def __repr__(self):
        self._note_print()
        return float.__repr__(self)


def _guarded(op, label):
    def method(self, *others):
        plain = [_plain(o) if _tracked(o) or isinstance(o, HostFloat) else o for o in others]
        result = op(_plain(self), *plain)
        tracer = _tracer()
        if current(self, tracer):
            args = (self.node, *(node_arg(o, tracer) for o in others))
            self.log.guard(tracer.create_node("call_function", op, args, {}), result, label)
        return result
    return method


for _name, _op in [("lt", operator.lt), ("le", operator.le), ("gt", operator.gt), ("ge", operator.ge),
                   ("eq", operator.eq), ("ne", operator.ne), ("bool", operator.truth), ("int", int),
                   ("round", round), ("floor", math.floor), ("ceil", math.ceil), ("trunc", math.trunc)]:
    setattr(ReadFloat, f"__{_name}__", _guarded(_op, f"{_name}() of a value read from a tensor"))
ReadFloat.__hash__ = float.__hash__


@dataclass(eq=False)
class ReadRef:
    """An int ``.item()`` the step read, handed out as a tracked number (tracked.py): arithmetic
    on it stays an expression (``correct += n``, replayed from this graph output by
    trackplan.NumberEffect); any other use guards its value here, where it is used."""
    node: object
    value: int
    log: ReadLog
    site: str
    what: str
    guarded: bool = False

    def guard(self) -> None:
        if not self.guarded and _tracer() is not None:
            self.guarded = True
            self.log.guard(self.node, self.value, self.what, self.site)
            self.log.guarded.append(self.value)


def read_scalar(tracer, t: torch.Tensor, func, log: ReadLog, lazy: bool = True):
    """The value of a host read of the traced tensor ``t`` (``func`` is the Tensor method);
    ``lazy``: an int ``.item()`` may be a tracked number, guarded only where used."""
    site = user_frame()
    value, node = record_item(tracer, t)   # aten._local_scalar_dense(t)
    node.meta["stepgraph_site"] = site    # (named by the sync timing of backends/segments.py)
    node.meta["stepgraph_library"] = library_frame()   # (a draw read in library code: randomreads)
    if t.dtype.is_floating_point and func is torch.Tensor.item:
        return ReadFloat(value, node, site, log)
    if lazy and func is torch.Tensor.item and type(value) is int and log.uses is not None \
            and log.uses.active:
        from .numchecks import Root
        what = f"item() of a {str(t.dtype).replace('torch.', '')} tensor"
        root = Root("read", ReadRef(node, value, log, site, what), f"{what} at {site}")
        log.int_reads.append(root)
        return log.uses.wrap(value, root)
    # float(t) returns a plain float (Python converts a subclass): guarded like int/bool reads.
    # int/bool reads decide shapes, indices and branches: guard them by value. (.item() of an
    # int/bool tensor: ``value`` itself, exact -- an int64 above 2**53 is no float.)
    name = getattr(func, "__name__", "read")
    conv = {"__bool__": bool, "__int__": int, "__index__": int, "__float__": float}.get(name)
    result, target = value, node
    if conv is not None:
        result, target = conv(value), tracer.create_node("call_function", conv, (node,), {})
    what = f"{'bool(tensor)' if conv is bool else name.strip('_') + '()'} of a {str(t.dtype).replace('torch.', '')} tensor"
    log.guard(target, result, what, site)
    log.guarded.append(result)
    return result


def c_scalar_read(t: torch.Tensor, log: ReadLog):
    """An integer or bool step tensor read by torch's C argument parser, where a number is due
    (``torch.arange(n)``, ``x.new_zeros(b, n)`` with ``n = counts.max()``: Longformer's global
    attention indices): no ``Tensor.__index__`` for the torch-function mode to see, only
    ``aten._local_scalar_dense`` at dispatch. Guarded by value, as ``int(n)`` would be (it was
    refused as a host sync the user could not move). Floats stay refused there (a tensor lr)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.numel() != 1:
        return NotImplemented
    return read_scalar(_tracer(), t, torch.Tensor.__bool__ if t.dtype is torch.bool else torch.Tensor.__int__, log)


def guard_lost(floats, log: ReadLog) -> None:
    """ReadFloats an op consumed where the graph could not keep them live: guard their value."""
    for f in floats:
        if isinstance(f, ReadFloat) and current(f, _tracer()):
            log.guard(f.node, _plain(f), "a value read from a tensor, used where it cannot stay live", f.site)


def operands_as_tensors(args: tuple, floats: list) -> tuple:
    """``alpha * log_pi`` where ``alpha`` is a live float (read back with ``.item()``, as SAC's
    ``alpha = log_alpha.exp().item()``, or a float global read live) and ``log_pi`` needs grad:
    autograd saves the number for the backward, which the engine calls with a plain float, so
    the number would be baked there. It enters as a 0-dim tensor of the tensor's dtype made from
    it in the graph instead, and stays live (fp32/fp64 only: their scalar forms round the number
    to the tensor's dtype as the 0-dim tensor does; an operand only, never ``alpha=``).
    Returns the op's positional args and the floats still to guard."""
    ref = next((t for t in args if isinstance(t, torch.Tensor)), None)
    tracer = _tracer()
    if ref is None or ref.dtype not in (torch.float32, torch.float64) or tracer is None:
        return args, floats
    made: dict = {}
    for f in floats:
        if id(f) not in made and any(a is f for a in args):
            t = live_scalar_tensor(f, ref.dtype, ref.device)
            if t is not None:
                made[id(f)] = t
    return tuple(made.get(id(a), a) for a in args), [f for f in floats if id(f) not in made]


def cuda_division(func, before, args, kwargs):
    """``x / tau`` on CUDA with ``tau`` a live float made a 0-dim tensor (``before``: the op's args
    before operands_as_tensors): eager's CUDA kernel multiplies by the reciprocal of a Python
    divisor, taken in double and rounded to the tensor's dtype; a 0-dim tensor divisor divides,
    a last-bit apart (H200: 303 of 303 divisors matched ``x * float32(1.0 / tau)``, none a true
    division, 219 a float32 reciprocal). The same live reciprocal and product in the graph;
    (func, args) unchanged for anything else."""
    mul = _RECIPROCAL_DIVS.get(func)
    if mul is None or kwargs or len(args) != 2 or args[1] is before[1] or not isinstance(args[0], torch.Tensor) \
            or args[0].device.type != "cuda":
        return func, args
    inv = live_scalar_tensor(1.0 / before[1], args[0].dtype, args[0].device)
    return (func, args) if inv is None else (mul, (args[0], inv))


_T = torch.Tensor
_RECIPROCAL_DIVS = {_T.__truediv__: _T.__mul__, _T.__itruediv__: _T.__imul__, _T.div: _T.mul, _T.div_: _T.mul_,
                    torch.div: torch.mul, torch.true_divide: torch.mul}


def live_scalar_tensor(f, dtype, device):
    """A 0-dim tensor made in the graph from live float ``f`` (its node, not its value), or None."""
    tracer = _tracer()
    if tracer is None:
        return None
    graph = tracer.graph
    last = graph._root.prev
    t = torch.scalar_tensor(_plain(f), dtype=dtype, device=device)
    nodes, n = [], last.next
    while n is not graph._root:
        nodes.append(n)
        n = n.next
    return t if substitute(nodes, [f], ()) else None


# math's C functions read a float's bits directly, without any method the trace sees.
_MATH_PREDICATES = ("isnan", "isfinite", "isinf")


# math's float functions read a float subclass's bits directly too: ``math.sqrt(loss.item())``
# or ``math.cos(math.pi * t)`` (a live float) handed the graph a plain number, baked at capture.
_MATH_FLOATS = ("sqrt", "exp", "expm1", "log", "log2", "log10", "log1p", "cos", "sin", "tan", "acos",
                "asin", "atan", "atan2", "cosh", "sinh", "tanh", "acosh", "asinh", "atanh", "pow", "fabs",
                "copysign", "hypot", "erf", "erfc", "gamma", "lgamma", "degrees", "radians", "fmod",
                "remainder")


class math_patches:
    """While tracing: ``math.isnan(x)`` etc. on a ReadFloat become guarded predicates, and
    math's float functions of traced floats (and tracked numbers) are recorded, not baked."""

    def __enter__(self):
        from .hostrandom import _imported_draws
        self.saved = [(name, getattr(math, name)) for name in _MATH_PREDICATES + _MATH_FLOATS
                      if hasattr(math, name)]
        wrapped = {}
        for name, orig in self.saved:
            setattr(math, name, wrapped.setdefault(id(orig), (orig, _math_guarded(orig) if name in _MATH_PREDICATES
                                                              else _math_live(orig)))[1])
        # (``from math import cos, pi``, OLMo's scheduler: the name in the importer's module, where
        # the patch on math never reached -- the lr computed from a live step count was baked)
        self.imported = _imported_draws(wrapped)
        # json's C encoder takes no tracked number (``json.dumps({"step": i})``: "int is not JSON
        # serializable", an internal failure, eager for good): handed its value, used as Python uses it.
        self.json_default = json.JSONEncoder.default
        json.JSONEncoder.default = lambda enc, o: (o._use(), o._v)[1] if _tracked(o) else self.json_default(enc, o)
        self.picks = [(name, getattr(builtins, name)) for name in ("min", "max")]
        for name, orig in self.picks:
            setattr(builtins, name, _pick_live(orig))
        return self

    def __exit__(self, *exc):
        for mod, name, orig in reversed(self.imported):
            setattr(mod, name, orig)
        for name, orig in self.saved:
            setattr(math, name, orig)
        for name, orig in self.picks:
            setattr(builtins, name, orig)
        json.JSONEncoder.default = self.json_default


def _math_guarded(orig):
    def pred(x):
        result = orig(_plain(x) if isinstance(x, HostFloat) else x)
        if isinstance(x, ReadFloat):
            tracer = _tracer()
            if current(x, tracer):
                node = tracer.create_node("call_function", orig, (x.node,), {})
                x.log.guard(node, result, f"math.{orig.__name__}() of a value read from a tensor")
        return result
    pred.__name__ = orig.__name__
    return pred


def _pick_live(orig):
    """``max(1.0, update.norm().item() / d)`` (torch.optim.Adafactor's update clipping, DAdapt's
    ``max(d, d_hat)``) on floats, a traced one among them: a value the graph computes at each
    replay, not a branch guarded on the comparison inside (it flipped as the norm crossed 1.0:
    a capture per call)."""
    def fn(*args, **kw):
        tracer = _tracer()
        if kw or len(args) < 2 or tracer is None or not all(type(x) is float or isinstance(x, HostFloat) for x in args):
            return orig(*args, **kw)
        live = [x for x in args if current(x, tracer)]
        if not live:
            return orig(*args, **kw)
        return live_op(orig, args, live, orig(*(_plain(x) for x in args)), tracer)
    fn.__name__ = orig.__name__
    fn.__wrapped__ = orig
    return fn


def _math_live(orig):
    def fn(*args):
        from .numchecks import Op
        from .tracked import _PROXIES, plain
        tracer = _tracer()
        live = [x for x in args if current(x, tracer)]
        value = orig(*(_plain(plain(x)) if _tracked(x) else _plain(x) if live and isinstance(x, HostFloat)
                       else x for x in args))
        proxies = [x for x in args if type(x) in _PROXIES]
        if not live:
            if proxies and all(x._log.active for x in proxies):   # a tracked number: still tracked
                return proxies[0]._log.derive(value, Op(orig, tuple(x._e if type(x) in _PROXIES else x
                                                                    for x in args)))
            return value
        # (a moving number -- an optimizer's Python step count in ``math.pow(beta, step)``,
        # pytorch_optimizer's debias -- is read live, not checked by value: live_op)
        return live_op(orig, args, live, value, tracer)
    fn.__name__ = orig.__name__
    fn.__wrapped__ = orig
    return fn


def stored_reads(log: ReadLog, allowed: list) -> list[str]:
    """Sites of ReadFloats the step stored in Python objects (a meter, a list, a global): a
    replay runs no Python, so those objects keep this call's value. ``allowed``: containers
    stepgraph itself holds (the returned structure)."""
    from . import hostscalar
    skip = {id(log.reads), id(allowed), id(hostscalar.MADE)} | {id(x) for x in allowed}   # (MADE: floatleaks.py)
    sites = [f.site for f in log.reads if _held(f, skip)]
    return list(dict.fromkeys(sites))


def _held(f, skip: set) -> bool:
    refs = gc.get_referrers(f)
    # (a frame's own locals snapshot, made by percent.py reading a name of the step's: no store)
    frames = {id(r.f_locals) for r in refs if isinstance(r, types.FrameType)}
    return any(id(r) not in skip and id(r) not in frames and not isinstance(r, types.FrameType) for r in refs)


def tensor_shape(t) -> tuple:
    """Graph node: a tensor's shape, read on the host (what a data-dependent shape guard checks)."""
    return tuple(t.shape)


def tensor_values(t) -> tuple:
    """Graph node: a CPU tensor's values, read on the host (a packed sequence's batch sizes)."""
    return tuple(t.tolist())


_TOLIST_MAX = 256   # elements: each is one host read (a graph node) at every replay


def tolist(t: torch.Tensor, reads: ReadLog):
    """``t.tolist()`` of a tensor the step computed: each element read as ``.item()`` is (floats
    live, ints and bools guarded by value), nested as ``tolist`` nests them. NotImplemented for
    a large tensor (refused: one host read per element)."""
    if t.numel() > _TOLIST_MAX:
        return NotImplemented
    tracer = _tracer()
    flat = t.reshape(-1)
    items = [read_scalar(tracer, flat[i], torch.Tensor.item, reads, lazy=False) for i in range(t.numel())]
    if t.dim() == 0:
        return items[0]
    for d in reversed(t.shape[1:]):   # (no closure: a list left in a cycle reads as "stored")
        items = [items[i:i + d] for i in range(0, len(items), d)]
    return items
