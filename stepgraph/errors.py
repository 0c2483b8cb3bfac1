"""Exceptions and the helper that points errors at the user's own source line."""
from __future__ import annotations

import os
import traceback

_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__)))
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames from these trees are never "the user's line": torch internals, stepgraph itself,
# and the standard library's context managers that wrap user code.
_SKIP_PREFIXES = (
    os.path.join(_TORCH_DIR, "torch") + os.sep,
    _PKG_DIR + os.sep,
    os.path.dirname(os.__file__) + os.sep,
)


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


def user_frame(stack: list[traceback.FrameSummary] | None = None) -> str:
    """``file:line (code)`` of the innermost frame outside torch, stepgraph and the stdlib."""
    stack = stack if stack is not None else traceback.extract_stack()
    for fr in reversed(stack):
        fn = os.path.abspath(fr.filename)
        if fn.startswith(_SKIP_PREFIXES) or fr.filename.startswith("<"):
            continue
        code = f" ({fr.line.strip()})" if fr.line else ""
        return f"{fr.filename}:{fr.lineno}{code}"
    return "<unknown>"


def library_frame(stack: list[traceback.FrameSummary] | None = None) -> str:
    """``file:line`` of the torch frame the user's line called into, if the op came from a library.

    Only frames *inside* the user's innermost frame count: the tracing machinery around the
    user's function is torch code too, but it is not where the op came from.
    """
    stack = stack if stack is not None else traceback.extract_stack()
    user = None
    for i in range(len(stack) - 1, -1, -1):
        fn = os.path.abspath(stack[i].filename)
        if not fn.startswith(_SKIP_PREFIXES) and not stack[i].filename.startswith("<"):
            user = i
            break
    if user is None:
        return ""
    for fr in stack[user + 1:]:
        fn = os.path.abspath(fr.filename)
        if fn.startswith(_SKIP_PREFIXES[0]) and not any(x in fn for x in (
                "/fx/", "/utils/_python_dispatch", "/overrides.py", "/_ops.py", "/_tensor.py",
                "/autograd/__init__.py", "/autograd/graph.py", "/_dynamo/", "/utils/_contextlib.py")):
            return f"{os.path.relpath(fn, _TORCH_DIR)}:{fr.lineno}"
    return ""
