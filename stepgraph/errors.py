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
    """``file:line`` of the innermost torch frame, when the op came from inside a library call."""
    stack = stack if stack is not None else traceback.extract_stack()
    for fr in reversed(stack):
        fn = os.path.abspath(fr.filename)
        if fn.startswith(_SKIP_PREFIXES[0]) and "/fx/" not in fn and "/utils/_python_dispatch" not in fn \
                and "/overrides.py" not in fn and "/_ops.py" not in fn:
            return f"{os.path.relpath(fn, _TORCH_DIR)}:{fr.lineno}"
    return ""
