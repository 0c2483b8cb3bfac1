"""Values formatted into text on the user's line, and that text rebuilt at each replay.

``print(f"step {i} loss {loss.item():.4f}")``, ``log.info(f"epoch {epoch}")``,
``pbar.set_description(f"loss {loss.item():.3f}")``: the string is made before the call, from
the capturing call's values. A call redone after each replay (pycalls.py) gets the string
rebuilt: its literal parts as captured, each formatted value in its place with the replay's
value -- a read value from the graph's outputs (hostreads.py), a number of the call computed
again from its roots (tracked.py). Before, a number in the text kept the call from being redone
(it printed at capture only), and a logger's f-string guarded the number by value: a recapture
at every iteration, then eager (``log.info(f"it {i} loss {loss.item():.4f}")``).

The text is rebuilt only when its split into literal parts and values is the only one: the
earliest and the latest place each value's text can take agree. ``f"run1 step {i}"`` captured
at ``i == 1`` ("run1 step 1") could put the step's place in "run1": not rebuilt, the call then
runs at capture only (warned), never printing a wrong text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class Format:
    """A value formatted into text on a line of the step's code, in formatting order."""
    index: int | None   # its entry in ReadLog.printed (a read or live float); None: a number
    shown: str          # its text in the capturing call's string
    spec: str           # the format spec (``.4f``; "" for str())
    value: object       # the read value's graph node, or the number's expression (tracked.py)
    line: str           # ``file:line`` it was formatted on
    pending: list | None = None   # a number's UseLog.pending entry: a rebuilt text confirms it


@dataclass
class NumberHole:
    """A number of the call's in a rebuilt string: computed again at each replay."""
    expr: object
    spec: str
    pending: list | None = None   # (its UseLog.pending entry, confirmed once the call is redone)
    kind: ClassVar[str] = "number"


def note(log, node, text: str, spec: str) -> None:
    """A read or live float formatted into text (``ReadLog`` ``log``): its site is printed, and,
    unless the text is padded again after (callframes.reformatted), a call redone after each
    replay can rebuild the text around it."""
    from ..errors import user_frame
    from .callframes import reformatted
    site = user_frame()
    if text is not None and not reformatted():
        log.formats.append(Format(len(log.printed), text, spec, node, line_of(site)))
    log.printed.append(site)


def line_of(site: str) -> str:
    """``file:line`` of a ``file:line (code)`` site."""
    return site.split(" (")[0]


def template(text: str, formats: list):
    """``text`` as literal parts and the values formatted into it (those of ``formats`` found in
    it, in order), and the formats left for the next string; ``text`` itself and all of
    ``formats`` when the first is not in it or the split is not the only one."""
    starts, pos = [], 0
    for f in formats:
        i = text.find(f.shown, pos) if f.shown else -1
        if i < 0:
            break
        starts.append(i)
        pos = i + len(f.shown)
    if not starts:
        return text, formats
    end = len(text)
    for f, start in zip(reversed(formats[:len(starts)]), reversed(starts)):
        if text.rfind(f.shown, 0, end) != start:
            return text, formats   # (another split exists: the literal holds a value's text)
        end = start
    parts, pos = [], 0
    for f, start in zip(formats, starts):
        parts += [text[pos:start], f]
        pos = start + len(f.shown)
    return parts + [text[pos:]], formats[len(starts):]


def show(v, spec: str) -> str:
    """``v`` as the text shows it: a format spec, or a %-conversion (percent.py)."""
    return spec % (v,) if spec.startswith("%") else format(v, spec)


def render(parts: list, outs, number) -> str:
    """A rebuilt string with this replay's values (``number(expr)``: a number of the call's)."""
    return "".join(x if isinstance(x, str) else show(number(x.expr), x.spec) if isinstance(x, NumberHole)
                   else show(float(x.value(outs)), x.spec) for x in parts)


_DECIMAL = re.compile(r"(?<![\w.])-?\d+\.(\d+)")


def earlier_text(text: str, earlier: list, reads):
    """A text a redone call takes that was built before its lines (``s = f"loss {x:.3f}"; print(s)``,
    a helper's ``print("LOG: " + s)``): (parts, formats used) rebuilt from the read values formatted
    earlier whose texts it holds; (None, []) when it shows a read value's digits but cannot be
    rebuilt (``'%.3f' % x`` formats in C, unseen: a redo would print the capture's value); None
    when it holds none. Before, such a call was redone with the capture's text at every replay."""
    hits = [f for f in earlier if f.shown and f.shown in text]
    if hits:
        parts, left = template(text, hits)
        return (parts, hits) if isinstance(parts, list) and not left else (None, [])
    values = [float.__float__(r) for r in reads.reads]
    for m in _DECIMAL.finditer(text):   # (a decimal as some read value rounds: shown from it, maybe)
        d = len(m.group(1))
        if any(f"{v:.{d}f}" == m.group(0) for v in values):
            return None, []
    return None


def hole(f):
    """A formatted value's place in a string a call is redone with: a number of the call's, or a
    graph output with its spec (an lr a scheduler stepped in the step set: read from its group
    when redone, nextlr.py)."""
    if f.index is None:
        return NumberHole(f.value, f.spec, f.pending)
    return read_hole(f.value, f.spec)


def read_hole(node, spec: str):
    """A read or live float's place in a rebuilt string: the graph output ``node``, or its param
    group when a scheduler stepped in the step set it (nextlr.py)."""
    from . import nextlr
    from .pyeffects import SourceEffect
    slot = nextlr.slot_of(node)
    e = SourceEffect(None, "read", node=node) if slot is None else SourceEffect(None, "group", node=slot)
    e.spec = spec
    return e
