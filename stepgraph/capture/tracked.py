"""Python numbers the step reads, tracked while it is traced: a guard only for what is used.

Every int/float argument and every number the step's code loads (a global, a closure cell,
``state['num_updates']``, a meter's ``count``) used to be part of the guard key, so a step that
only *prints* its ``epoch`` argument recaptured at every call. While the step is traced these
numbers are replaced by proxies. A proxy is not an ``int``/``float`` subclass on purpose: C code
reads a subclass's value directly (list indexing, ``range``, slicing, ``math.cos``) without any
method the trace could see; a proxy must be converted through ``__index__``/``__float__``,
which record the use. ``isinstance(proxy, int)`` still holds (``__class__``). Each proxy
carries the expression it was computed by from its roots (``epoch % print_every``); what the
step does with it becomes a :class:`Check` of the captured graph:

* a **decision** (``bool()``, a comparison): ``expr == outcome`` -- ``epoch % 4 == 0`` is False
  for three epochs in four, and one graph serves them all;
* a **value use** (``__index__``, ``int()``, ``float()``, hashing, a torch function argument, a
  returned value, an unknown operand): ``expr == value``;
* arithmetic: a new proxy, nothing checked;
* formatting: nothing checked when the text provably goes only to ``print``/``logging``
  (sinks.py), else a value use.

A check is evaluated before its graph replays; a failing one captures a sibling graph.
After the trace, proxies are inert (plain arithmetic, no records).
"""
from __future__ import annotations

import math
import operator
import sys
from dataclasses import dataclass, field

from .hostscalar import HostFloat
from .numchecks import Check, Op, Root, describe, roots_of, substitute

_NUMBERS = (int, float, bool)


# ---- the proxies ------------------------------------------------------------------------
def plain(x):
    """The number a proxy stands for (anything else unchanged, no record)."""
    return x._v if type(x) in _PROXIES else x


_USER: dict = {}   # code -> is it the user's (pyvalues._user_code, cached: it reads paths)


def _where(depth=2) -> str:
    """``file:line`` of the innermost user frame (cheaper than errors.user_frame)."""
    from .pyvalues import _user_code
    f = sys._getframe(depth)
    while f is not None:
        user = _USER.get(f.f_code)
        if user is None:
            user = _USER[f.f_code] = _user_code(f.f_code)
        if user:
            return f"{f.f_code.co_filename}:{f.f_lineno}"
        f = f.f_back
    return ""


def _in_sink() -> bool:
    from .sinks import in_sink
    return in_sink()


class Tracked:
    __slots__ = ("_v", "_e", "_log")
    _sg_tracked = True   # read on the type by hostscalar (no instance attribute lookup)

    def __init__(self, v, e, log):
        self._v, self._e, self._log = v, e, log

    def _use(self, force: bool = False):
        """Used by value -- unless inside print/logging, which only format (``force``: a torch
        function took it, whoever called it)."""
        if self._log.active and (force or not _in_sink()):
            self._log.used(self._e, self._v, _where(3))

    def __format__(self, spec):
        if self._log.active:
            self._log.formatted(self, sys._getframe(1))
        return format(self._v, spec)

    def __str__(self):
        if self._log.active:
            self._log.formatted(self, sys._getframe(1))
        return str(self._v)

    def __repr__(self):
        if self._log.active:
            self._log.formatted(self, sys._getframe(1))
        return repr(self._v)

    def __hash__(self):
        self._use()
        return hash(self._v)

    def __bool__(self):
        r = bool(self._v)
        if self._log.active:
            self._log.decide(Op(operator.truth, (self._e,)), r, _where())
        return r

    def __int__(self):
        self._use()
        return int(self._v)

    def __float__(self):
        self._use()
        return float(self._v)

    def __complex__(self):
        self._use()
        return complex(self._v)

    def __reduce_ex__(self, protocol):   # copy/pickle hand out a plain number
        self._use()
        return (type(self._v), (self._v,))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch's argument parser takes a number only if it is one, or an object with this
        # method: while tracing, TrackMode (sinks.py) runs first and hands plain numbers on;
        # this is the path of a proxy left somewhere after its trace.
        import torch.utils._pytree as pytree
        for x in pytree.tree_leaves((args, kwargs)):
            if type(x) in _PROXIES:
                x._use()
        args, kwargs = pytree.tree_map(plain, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __getattr__(self, name):          # .real, .bit_length(), .is_integer(), ...
        if name.startswith("_"):
            raise AttributeError(name)
        self._use()
        return getattr(self._v, name)


def _class(self):
    """``isinstance(x, int)`` asks this: the answer depends on the number's type, checked."""
    t = type(self._v)
    if self._log.active and not _in_sink():
        self._log.decide(Op(type, (self._e,)), t, _where())
    return t


class TrackedInt(Tracked):
    __slots__ = ()
    __class__ = property(_class)

    def __index__(self):
        self._use()
        return self._v


class TrackedFloat(Tracked):
    __slots__ = ()
    __class__ = property(_class)


_PROXIES = (TrackedInt, TrackedFloat)


def _operand(self, other):
    """(expression, value) of the other operand, or None: NotImplemented for a tensor or a
    traced float (their reflected method takes over), a value use for anything unknown."""
    if type(other) in _PROXIES:
        return other._e, other._v
    if type(other) in _NUMBERS:
        return other, other
    return None


def _arith(op, swap=False):
    def method(self, other):
        log = self._log
        if not log.active:
            a, b = self._v, plain(other)
            return op(b, a) if swap else op(a, b)
        got = _operand(self, other)
        if got is None:
            if _defers(other):
                return NotImplemented
            self._use()
            return op(other, self._v) if swap else op(self._v, other)
        e, v = got
        a, b = ((v, self._v), (e, self._e)) if swap else ((self._v, v), (self._e, e))
        try:
            r = op(*a)
        except Exception:
            self._use()
            if type(other) in _PROXIES:
                other._use()
            raise
        return log.derive(r, Op(op, b))
    return method


def _defers(other) -> bool:
    import torch
    return isinstance(other, (torch.Tensor, HostFloat))


def _compare(op):
    def method(self, other):
        log = self._log
        if not log.active:
            return op(self._v, plain(other))
        got = _operand(self, other)
        if got is None:
            if isinstance(other, __import__("torch").Tensor):
                return NotImplemented
            self._use()     # a traced float, None, a string...: this number is used as is
            return op(self._v, other)
        e, v = got
        r = op(self._v, v)
        if isinstance(r, bool):
            log.decide(Op(op, (self._e, e)), r, _where())
        return r
    return method


def _unary(op):
    def method(self):
        r = op(self._v)
        return self._log.derive(r, Op(op, (self._e,))) if self._log.active else r
    return method


_BINARY = [("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
           ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
           ("pow", operator.pow)]
_INT_BINARY = [("lshift", operator.lshift), ("rshift", operator.rshift), ("and", operator.and_),
               ("or", operator.or_), ("xor", operator.xor)]
for _cls, _ops in ((Tracked, _BINARY), (TrackedInt, _INT_BINARY)):
    for _name, _op in _ops:
        setattr(_cls, f"__{_name}__", _arith(_op))
        setattr(_cls, f"__r{_name}__", _arith(_op, swap=True))
for _name, _op in [("lt", operator.lt), ("le", operator.le), ("gt", operator.gt), ("ge", operator.ge),
                   ("eq", operator.eq), ("ne", operator.ne)]:
    setattr(Tracked, f"__{_name}__", _compare(_op))
for _name, _op in [("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs), ("round", round),
                   ("trunc", math.trunc), ("floor", math.floor), ("ceil", math.ceil)]:
    setattr(Tracked, f"__{_name}__", _unary(_op))
TrackedInt.__invert__ = _unary(operator.invert)


def _round(self, ndigits=None):
    r = round(self._v, ndigits)
    return self._log.derive(r, Op(round, (self._e, ndigits))) if self._log.active else r


def _divmod(self, other):
    self._use()
    return divmod(self._v, plain(other))


def _rdivmod(self, other):
    self._use()
    return divmod(plain(other), self._v)


Tracked.__round__ = _round
Tracked.__divmod__, Tracked.__rdivmod__ = _divmod, _rdivmod


# ---- what one trace saw ------------------------------------------------------------------
def _reader(root: Root):
    """Graph node target: the root's value at the replay (the Python before the step's)."""
    def read_number():
        return root.read((), ())
    read_number.__name__ = "read_" + "".join(c if c.isalnum() else "_" for c in root.label)[:40]
    return read_number


def _reads_in(expr) -> list:
    return [r for r in roots_of(expr) if r.kind == "read"]


def _settle(expr):
    """A check runs before its graph replays, when the replay's own host reads (hostreads.ReadRef)
    are not known yet: the reads ``expr`` involves are guarded by value in the graph, where it
    is used, and the check keeps the rest (``correct + n > 5`` -> ``n`` guarded, ``correct + 3 > 5``)."""
    reads = _reads_in(expr)
    if not reads:
        return expr
    for r in reads:
        r.ref.guard()
    return substitute(expr, {id(r): r.ref.value for r in reads})


@dataclass(eq=False)
class UseLog:
    """Uses of the tracked numbers during one trace, turned into checks by :meth:`checks`."""
    active: bool = True
    found: dict = field(default_factory=dict)       # describe(expr) -> Check (first seen)
    node_uses: list = field(default_factory=list)   # (expr, value, graph nodes, where)
    pending: list = field(default_factory=list)     # formats waiting for a print: [frame, offset, expr, value, where, ok]
    proxies: list = field(default_factory=list)     # every proxy made (to clean out of user objects)
    returned: set = field(default_factory=set)      # ids of the plain numbers handed back as results
    # Numbers meeting host reads become graph nodes (a CUDA graph holding one goes to the replay
    # backend: pipeline.refuse_host_python); numbers fed to tensor ops only where this is set (the
    # CPU: CUDA feeds changing floats as device scalars).
    lift_tensor_ops: bool = False
    lifted: dict = field(default_factory=dict)      # id(Root) -> its reader node in this graph

    def wrap(self, value, root: Root):
        p = (TrackedFloat if isinstance(value, float) else TrackedInt)(plain(value), root, self)
        self.proxies.append(p)
        return p

    def derive(self, value, expr):
        if type(value) is int:
            p = TrackedInt(value, expr, self)
        elif type(value) is float:
            p = TrackedFloat(value, expr, self)
        else:   # a bool (``a & b`` of 0/1), a complex: handed out plain, so used as is
            self.used(expr, value, _where(3))
            return value
        self.proxies.append(p)
        return p

    def used(self, expr, value, where=""):
        expr = _settle(expr)
        self.found.setdefault(("=", describe(expr)), Check(expr, value, where))

    def decide(self, expr, outcome: bool, where=""):
        expr = _settle(expr)
        self.found.setdefault(("?", describe(expr)), Check(expr, outcome, where, decided=True))

    def lift(self, proxy, typed: bool = True):
        """The graph node computing ``proxy`` from its roots read at each replay, or None: where
        a number meets a value read from a tensor (``meter.sum += loss.item() * n``) the sum is
        then live, not baked and checked (each step would miss). Roots only the call's Python
        holds (arguments) are not lifted. ``typed``: their types are checked (a tensor op
        promotes an int and a float apart; Python arithmetic with a float does not)."""
        from .hostscalar import _tracer
        tracer = _tracer()

        def build(e):
            if isinstance(e, Op):
                return tracer.create_node("call_function", e.fn, tuple(build(a) for a in e.args), {})
            if not isinstance(e, Root):
                return e
            if e.kind == "read":
                return e.ref.node
            if e.kind == "leaf" or (e.ref if e.kind == "source" else e.ref[0]).kind == "arg":
                raise LookupError(e.label)
            if id(e) not in self.lifted:
                self.lifted[id(e)] = tracer.create_node("call_function", _reader(e), (), {})
            if typed:
                t = Op(type, (e,))
                self.found.setdefault(("?", describe(t)), Check(t, type(e.read((), ())), "", True))
            return self.lifted[id(e)]
        try:
            return build(proxy._e)
        except LookupError:
            return None

    def guard_stored_reads(self) -> None:
        """At the end of the step, still in its trace: a number made from an int host read that
        the step stored somewhere (``stats.last = n``; trackplan's write-backs are plain by now)
        is guarded: a replay would not store it again, so it must not differ."""
        for p in [p for p in self.proxies if _reads_in(p._e) and sys.getrefcount(p) > 3]:
            self.used(p._e, p._v, "stored in a Python object")

    def node_use(self, proxy, nodes):
        """The number became a constant of these graph nodes: used only if one survives."""
        if _reads_in(proxy._e):   # a host read: guarded now (after the trace no guard can be placed)
            self.used(proxy._e, proxy._v, _where(3))
            return
        self.node_uses.append((proxy._e, proxy._v, list(nodes), _where(3)))

    def formatted(self, proxy, frame):
        from .sinks import format_target, in_sink
        if in_sink():
            return  # formatted by print/logging themselves
        if _reads_in(proxy._e):
            self.used(proxy._e, proxy._v, _where(3))
            return
        offset = format_target(frame.f_code, frame.f_lasti)
        if offset is None:
            self.used(proxy._e, proxy._v, _where(3))
        else:
            self.pending.append([frame, offset, proxy._e, proxy._v, _where(3), False])

    def confirm(self, frame, offset):
        for p in self.pending:
            if p[0] is frame and p[1] == offset:
                p[5] = True

    def checks(self, gm) -> list[Check]:
        """Every check of this trace, once the graph is final (after dead-code elimination)."""
        self.active = False
        for frame, _, expr, value, where, ok in self.pending:
            if not ok:   # formatted into text that went elsewhere than print/logging
                self.used(expr, value, where)
        self.pending.clear()
        if self.node_uses:
            alive = set(gm.graph.nodes)
            replaced = gm.meta.get("replaced", {})
            for expr, value, nodes, where in self.node_uses:
                for n in nodes:
                    while n not in alive and n in replaced:
                        n = replaced[n]
                    if n in alive:
                        self.used(expr, value, where)
                        break
        return list(self.found.values())
