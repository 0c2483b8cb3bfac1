"""Where a call the step makes comes from, and what its text holds (pycalls.py's questions
about the frame that calls a recorded method: the user's code or a library's, a print that
formatted a tracked number, a string %-formatted from a read value)."""
from __future__ import annotations

import ast
import linecache
import os
import sys

from ..errors import library_file

_STEPGRAPH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller():
    """The innermost frame outside stepgraph (the print/logging patches wrap the recording)."""
    f = sys._getframe(2)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_STEPGRAPH):
        f = f.f_back
    return f


def from_user_code() -> bool:
    """Is the recorded call made by the user's code (not a library's own print)?"""
    f = _caller()
    return f is not None and not library_file(f.f_code.co_filename)


def running(frame):
    """The instruction ``frame`` is running (a call into Python leaves f_lasti past its offset)."""
    from . import sinks
    return sinks._instructions(frame.f_code)[0][sinks._at(frame.f_code, frame.f_lasti)]


def call_lines() -> frozenset:
    """``file:line`` of each line the call being made spans (a call black split over lines,
    ``print(\n    f"step {i}",\n    f"loss {x:.4f}",\n)``, formats its text on lines after its own)."""
    f = _caller()
    if f is None:
        return frozenset()
    pos = running(f).positions
    first = pos.lineno if pos is not None and pos.lineno is not None else f.f_lineno
    last = pos.end_lineno if pos is not None and pos.end_lineno is not None else first
    return frozenset(f"{f.f_code.co_filename}:{n}" for n in range(first, max(first, last) + 1))


def formats_numbers() -> bool:
    """Did the call being made get a tracked number formatted into its text before it
    (``print(f"step {i} loss {loss.item():.4f}")``: the bytecode took the string there, sinks.py)?
    Its text holds this call's number: redone only with the text rebuilt (formats.py)."""
    from . import sinks
    log = getattr(sinks._STATE, "log", None)
    if log is None or not log.pending:
        return False
    f = _caller()
    if f is None:
        return False
    off = running(f).offset
    # (its own sink may not have run yet: the recording wraps a logger's method outside it)
    return any(p[0] is f and p[1] == off for p in log.pending)


def percent_formatted(text: str, where: str) -> bool:
    """Was ``text`` (not a literal of the line) made by ``'...' % value`` on the call's line?
    ``'%6f' % x`` reads a float subclass's value in C, past the hooks an f-string goes through,
    so a redone call would show the capture's number at every replay (tqdm's
    ``set_postfix({"Loss": "%6f" % loss})`` in pytorch/examples' ViT): not redone, warned."""
    path, _, rest = where.partition(":")
    lineno = rest.split(" ", 1)[0]
    code = linecache.getline(path, int(lineno)).strip() if lineno.isdigit() else ""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return "%" in code and text not in code
    mods = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)
            and isinstance(n.left, ast.Constant) and isinstance(n.left.value, str)]
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    return bool(mods) and text not in literals


def reformatted(frame=None) -> bool:
    """Does the text being made (in ``frame``, by default the innermost frame outside stepgraph)
    go into another format with a spec before anything else takes it (``f"{str(i):>4}"``,
    ``f"[{f'{x:.2f}':>8}]"``)? Its padding then depends on the value's width: a text rebuilt
    around it would keep the capture's padding (formats.py), so it is not rebuilt."""
    from . import sinks
    f = frame or _caller()
    if f is None:
        return False
    ins, _ = sinks._instructions(f.f_code)
    k = 0   # the text's depth below the top of the stack
    for j in ins[sinks._at(f.f_code, f.f_lasti) + 1:]:
        eff = sinks._stack(j)
        if eff is None:
            return False
        pops, pushes = eff
        if k < pops:   # (this instruction takes the text: as the value under a spec, padded)
            if k == 1 and (j.opname == "FORMAT_WITH_SPEC" or (j.opname == "FORMAT_VALUE" and bool(j.arg & 4))):
                return True
            if j.opname in sinks._STRING_OPS or (j.opname == "BINARY_OP" and j.arg in sinks._ADD):
                k = 0   # (built into a longer text, which may be padded in turn)
                continue
            return False
        k += pushes - pops
    return False
