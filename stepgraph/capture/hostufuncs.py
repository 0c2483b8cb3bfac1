"""numpy given a HostFloat (a live float or a value read on the host, hostscalar.py):
``HostFloat.__array_ufunc__``. (It was None, so that a numpy scalar on the left deferred to the
reflected operator; numpy then raised a TypeError at anything else: an array on the other side,
``np.exp`` of it.)"""
from __future__ import annotations

import operator

from .hostscalar import HostFloat


_UFUNC_OPS = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul, "true_divide": operator.truediv,
              "divide": operator.truediv, "power": operator.pow, "floor_divide": operator.floordiv,
              "remainder": operator.mod, "less": operator.lt, "less_equal": operator.le, "greater": operator.gt,
              "greater_equal": operator.ge, "equal": operator.eq, "not_equal": operator.ne}
# (numpy's own functions, not math's: numpy's exp, tanh, log10 differ from libm's in the last bit
# for some inputs -- exp 4%, tanh 47% of a probe's -- and give a numpy.float64, as eager's code got)
_UFUNC_MATH = frozenset({"exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "cos", "sin", "tan", "tanh", "cosh",
                         "sinh", "arccos", "arcsin", "arctan", "fabs", "maximum", "minimum", "fmax", "fmin"})
_NUMPY_FNS: dict = {}


def _numpy_fn(ufunc):
    """``ufunc`` as a plain function of Python numbers (a graph node's target, an expression's op)."""
    fn = _NUMPY_FNS.get(ufunc.__name__)
    if fn is None:
        def fn(*xs):
            return ufunc(*xs)
        fn.__name__ = fn.__qualname__ = f"numpy_{ufunc.__name__}"
        _NUMPY_FNS[ufunc.__name__] = fn
    return fn


def array_ufunc(self, ufunc, method, *inputs, **kwargs):
    """numpy given this float. With Python floats and numpy.float64 (a float) only, numpy's
    arithmetic and scalar maths run as Python's (``lr / bias_correction1`` with ``lr =
    lr_schedule[it]``; DANN's ``2 / (1 + np.exp(-10 * p)) - 1``): the value stays live. With
    anything else (an array: CutMix's ``np.random.rand(1) < args.cutmix_prob``) numpy computes
    on this float's value, guarded as ``float()`` guards it -- numpy gave up on it before (a
    TypeError the user never wrote, and the capturing call's update lost)."""
    out = scalar_ufunc(ufunc, method, inputs, kwargs)
    if out is not NotImplemented:
        return out
    return getattr(ufunc, method)(*(float(x) if issubclass(type(x), HostFloat) else x for x in inputs), **kwargs)


def scalar_ufunc(ufunc, method, inputs, kwargs, proxies=()):
    """numpy's arithmetic and scalar maths on Python numbers, live floats and tracked numbers
    (``proxies``: tracked.py's types) run as Python's, so a number that changes at every call
    stays an expression (DANN's ``np.exp(-10 * p)`` with ``p`` from the iteration: a graph per
    call before); NotImplemented for anything else."""
    scalar = all(issubclass(type(x), HostFloat) or type(x) in (float, int) or type(x) in proxies or _np_float64(x)
                 for x in inputs)
    if method == "__call__" and not kwargs and scalar:
        if len(inputs) == 2 and ufunc.__name__ in _UFUNC_OPS:
            return _UFUNC_OPS[ufunc.__name__](*(float(x) if _np_float64(x) else x for x in inputs))
        if ufunc.__name__ in ("isnan", "isinf", "isfinite") and len(inputs) == 1:
            import math   # (Mean Teacher's ``assert not np.isnan(loss.item())``: math's, a guarded predicate)
            return getattr(math, ufunc.__name__)(inputs[0])
        if ufunc.__name__ in _UFUNC_MATH and len(inputs) == ufunc.nin:
            from .hostreads import _math_live   # (recorded as math's functions are: live, or tracked)
            return _math_live(_numpy_fn(ufunc))(*(float(x) if _np_float64(x) else x for x in inputs))
    return NotImplemented


def _np_float64(x) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ == "float64"
