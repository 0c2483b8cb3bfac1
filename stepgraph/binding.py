"""What ``compile`` accepts as a step function, and ``@stepgraph.compile`` on a method in a class
body (a descriptor: each instance gets its own step function, made at its first access)."""
from __future__ import annotations

import functools
import inspect
import types

from .errors import StepGraphError


def check_step_function(fn) -> None:
    """A generator or async function's body runs only when iterated or awaited, after the call
    returns: its replays did nothing, silently."""
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise StepGraphError(
            f"stepgraph.compile got a generator or async function ({getattr(fn, '__qualname__', fn)}): "
            "its body runs only when it is iterated or awaited, after the call returns, so there is no "
            "step to capture; compile the function that does the step's work and returns its results")


def wrap_step(step, fn) -> None:
    """``functools.update_wrapper``; the name of a functools.partial's function or a callable
    object's type where ``fn`` has none (an AttributeError before)."""
    check_step_function(fn)
    functools.update_wrapper(step, fn, updated=())
    step.__name__ = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None) \
        or type(fn).__name__


class PerInstance:
    """StepFunction's part: ``@stepgraph.compile`` on a method in a class body binds ``self``."""

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        slot = f"_stepgraph_{self.__name__}_{id(self):x}"
        try:
            own = vars(obj)
        except TypeError:
            raise StepGraphError(f"@stepgraph.compile on {type(obj).__name__}.{self.__name__}: its instances "
                                 "have no __dict__ to keep their own step function in; compile the bound "
                                 f"method instead (self.step = stepgraph.compile(self.{self.__name__}))") from None
        if slot not in own:   # (its graphs hold that instance's state: never shared)
            own[slot] = type(self)(types.MethodType(self.fn, obj), **self._options)
        return own[slot]
