"""Exceptions and the helper that points errors at the user's own source line."""
from __future__ import annotations

import os
import sys
import traceback
import types

_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__)))
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames from these trees are never "the user's line": torch internals, stepgraph itself,
# and the standard library's context managers that wrap user code.
import sysconfig

_LIB_DIRS = tuple(dict.fromkeys(os.path.abspath(p) + os.sep for p in (
    _TORCH_DIR, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])))
_SKIP_PREFIXES = (
    os.path.join(_TORCH_DIR, "torch") + os.sep,
    _PKG_DIR + os.sep,
    os.path.dirname(os.__file__) + os.sep,
) + _LIB_DIRS
# Frames of the tracing machinery itself: torch code, but never where an op came from.
_MACHINERY = ("/fx/", "/utils/_python_dispatch", "/overrides.py", "/_ops.py", "/_tensor.py",
              "/autograd/__init__.py", "/autograd/graph.py", "/_dynamo/", "/utils/_contextlib.py",
              "/nn/modules/module.py", "/optim/lr_scheduler.py", "/optim/optimizer.py", "/_compile.py")


class StepGraphError(RuntimeError):
    """Base class of every error stepgraph raises on its own account."""


class CaptureError(StepGraphError):
    """The step cannot be captured as one graph (a host sync, a data-dependent shape, ...).

    ``where`` is the user's ``file:line`` that triggered it, ``op`` the operation,
    ``fix`` what to change.
    """

    def __init__(self, message: str, *, op: str = "", where: str = "", fix: str = ""):
        self.op, self.where, self.fix = op, where, fix
        parts = [message]
        if where:
            parts.append(f"  at {where}")
        if fix:
            parts.append(f"  fix: {fix}")
        super().__init__("\n".join(parts))


class RunsEagerly(StepGraphError):
    """A step stepgraph knows it would not capture equal to eager (measured on a real program,
    the cause not yet found): the call's result is eager's, and the step runs eagerly from then
    on, with one warning that says why."""


class NeedsReplay(CaptureError):
    """A backend cannot run this graph (it needs host work every call); only ``replay`` can.
    Any backend may raise it from ``compile``; ``backend="auto"`` then uses ``replay``, warned."""


class NeedsHostScalars(NeedsReplay):
    """The graph recomputes host scalars each call (an optimizer without a capturable form)."""


class GuardMiss(Exception):
    """A replayed host read saw another value than the capture: the graph restored what it
    wrote and this call must be captured for the new value. Raised from inside a replay on
    every backend (the graph's ``host_guard`` node, capture/hostreads.py)."""

    PREFIX = "host read at "   # (a capture's reason that starts so came from a miss: distributed.agree)

    def __init__(self, site: str, what: str, expected, actual):
        super().__init__(f"{self.PREFIX}{site}: {what} was {expected!r} at capture, now {actual!r}")
        self.site, self.what, self.expected, self.actual = site, what, expected, actual


def library_file(filename: str) -> bool:
    """torch's, stepgraph's, the stdlib's or an installed package's file: not the user's code.
    (Whether ``<string>``-like names are user code is each caller's call: a notebook's cell is.)"""
    return os.path.abspath(filename).startswith(_SKIP_PREFIXES)


def library_class(obj) -> bool:
    """``obj``'s class is a library's (by where its ``__init__`` is written)."""
    code = getattr(getattr(type(obj), "__init__", None), "__code__", None)
    return code is not None and library_file(code.co_filename)


def core_file(filename: str) -> bool:
    """torch's, stepgraph's or the stdlib's file (an installed package's is not, though
    site-packages lies inside the stdlib's directory)."""
    f = os.path.abspath(filename)
    return f.startswith(_SKIP_PREFIXES[:2]) or f.startswith(_SKIP_PREFIXES[2]) and not f.startswith(_LIB_DIRS)


def user_code_frame(f):
    """The innermost live frame from ``f`` outward in the user's own file, or None: the one walk
    the live-frame checks share (``'%.3f' % loss``, a clock the step calls)."""
    while f is not None and (library_file(f.f_code.co_filename) or f.f_code.co_filename.startswith("<")):
        f = f.f_back
    return f


def user_frame(stack: list[traceback.FrameSummary] | None = None) -> str:
    """``file:line (code)`` of the innermost frame outside torch, stepgraph and the stdlib."""
    stack = stack if stack is not None else traceback.extract_stack()
    for fr in reversed(stack):
        if library_file(fr.filename) or fr.filename.startswith("<"):
            continue
        code = f" ({fr.line.strip()})" if fr.line else ""
        return f"{fr.filename}:{fr.lineno}{code}"
    return "<unknown>"


def library_frame(stack: list[traceback.FrameSummary] | None = None) -> str:
    """``file:line`` of the innermost library frame (torch or any installed package) that the
    user's line called into, i.e. where the op really came from; ``""`` if the user's own
    line did it. Wrappers (nn.Module.__call__, optimizer hooks, tracing) are skipped."""
    stack = stack if stack is not None else traceback.extract_stack()
    user = None
    for i in range(len(stack) - 1, -1, -1):
        if not library_file(stack[i].filename) and not stack[i].filename.startswith("<"):
            user = i
            break
    if user is None:
        return ""
    found = ""
    for fr in stack[user + 1:]:
        fn = os.path.abspath(fr.filename)
        if fn.startswith(os.path.join(_PKG_DIR, "capture") + os.sep):
            break  # stepgraph's own modes: everything from here on is the interception
        lib = next((d for d in _LIB_DIRS if fn.startswith(d)), None)
        if lib is not None and not any(m in fn for m in _MACHINERY):
            found = f"{os.path.relpath(fn, lib)}:{fr.lineno}"
    return found


def user_class(t: type) -> bool:
    """A class defined in the user's code (a script, a notebook cell), not a library's."""
    if t.__module__ == "__main__":
        return True
    f = getattr(sys.modules.get(t.__module__), "__file__", None)
    if f is None:   # (a module loaded from its path under another name: its methods' file)
        f = next((v.__code__.co_filename for v in vars(t).values() if isinstance(v, types.FunctionType)), None)
    return f is not None and not library_file(f) and not f.startswith("<frozen")


def library_module(v) -> bool:
    """A module of Python's, torch's or an installed package (not the user's ``config``)."""
    if not isinstance(v, types.ModuleType):
        return False
    f = getattr(v, "__file__", None)
    return f is None or library_file(f)
