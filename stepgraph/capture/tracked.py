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

from ..optimizers import NUMBER_PROXIES
from .hostscalar import HostFloat, HyperFloat
from .numchecks import Op, _kind

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
        text = format(self._v, spec)
        if self._log.active:
            self._log.formatted(self, sys._getframe(1), text, spec)
        return text

    def __str__(self):
        text = str(self._v)
        if self._log.active:
            self._log.formatted(self, sys._getframe(1), text)
        return text

    def __repr__(self):
        text = repr(self._v)
        if self._log.active:
            self._log.formatted(self, sys._getframe(1), text)   # (a number's repr is its str)
        return text

    def __hash__(self):
        self._use()
        return hash(self._v)

    def __bool__(self):
        r = bool(self._v)
        if self._log.active:
            self._log.decide(Op(operator.truth, (self._e,)), r, _where())
        return r

    def _convert(self):
        """``int()``/``float()``/``__index__``: a use -- unless C converts it for ``'%d' % i``
        whose text goes to a call (percent.py rebuilds it there; else it is used after all)."""
        if self._log.active:
            from .percent import converted_for_text
            if converted_for_text(self._log, self, sys._getframe(2)):
                return
        self._use()

    def __int__(self):
        self._convert()
        return int(self._v)

    def __float__(self):
        self._convert()
        return float(self._v)

    def __complex__(self):
        self._use()
        return complex(self._v)

    # numpy: a proxy is no int or float to it, so ``np.array([i, j])`` made an object array and
    # ``np.interp(ni, ...)`` raised (YOLOv5's warm-up); ``float32_array ** beta`` promoted to
    # float64 (PER's importance weights). Handed over as the plain number, used by value.
    def __array__(self, dtype=None, copy=None):
        import numpy as np
        self._use()
        return np.asarray(self._v, dtype=dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        from .hostufuncs import scalar_ufunc   # (``np.exp(-10 * p)``: an expression, as math.exp's)
        out = scalar_ufunc(ufunc, method, inputs, kwargs, _PROXIES)
        if out is not NotImplemented:
            return out
        return getattr(ufunc, method)(*_plain_used(inputs), **dict(zip(kwargs, _plain_used(kwargs.values()))))

    def __array_function__(self, func, types, args, kwargs):
        import torch.utils._pytree as pytree
        args, kwargs = pytree.tree_map(_plain_use, (args, kwargs))
        return func(*args, **kwargs)

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


def _plain_use(x):
    if type(x) in _PROXIES:
        x._use(force=True)
        return x._v
    return x


def _plain_used(xs) -> list:
    return [_plain_use(x) for x in xs]


def _class(self):
    """``isinstance(x, int)`` asks this: the answer depends on the number's type, checked."""
    t = _kind(self._v)   # (a live hyper-parameter stepgraph put in the group is the user's float)
    if self._log.active and not _in_sink():
        self._log.decide(Op(type, (self._e,)), t, _where())
    return t


class TrackedInt(Tracked):
    __slots__ = ()
    __class__ = property(_class)

    def __index__(self):
        self._convert()
        return self._v


class TrackedFloat(Tracked):
    __slots__ = ()
    __class__ = property(_class)


_PROXIES = (TrackedInt, TrackedFloat)
NUMBER_PROXIES.update(_PROXIES)   # (optimizers.absorb_floats takes them as numbers)


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
        if got is None and isinstance(other, HyperFloat):
            # (``random.random() < teacher_forcing_ratio``, that ratio a global float read live:
            # its value is guarded -- float() bakes it -- and the answer is the decision)
            got = (float(other), float(other))
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


def __getattr__(name):
    # UseLog (what one trace did with the numbers) lives in uselog.py, which imports the proxies
    # from here: resolved on first use, so ``from .tracked import UseLog`` still works.
    if name == "UseLog":
        from .uselog import UseLog
        return UseLog
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

