"""Text made by ``'...' % values`` for a call redone after each replay: rebuilt from its format.

``print('[%d/%d][%d/%d] Loss_D: %.4f' % (epoch, niter, i, n, errD.item()))`` (pytorch/examples'
DCGAN) formats in C, past the hooks an f-string goes through (formats.py): a number of the call
was converted with ``int()`` -- guarded by value, a graph per iteration, then eager -- and a value
read from a tensor, a float subclass, was read by C unseen, so the call ran at capture only.

Now the call's source (its ``%`` expression) is read: the format string splits the text into
literal parts and one field per conversion (the split must be the only one), and each value is
found again from the frame -- a name, an attribute, a constant subscript, arithmetic on those,
``x.item()`` (the value read on the call's lines, in order). A number of the call becomes a
number computed at each replay, a value read from a tensor a graph output; anything else is
shown as captured. Each field's text is checked against its value's. Anything not understood
leaves the call as before: run at capture only, warned.
"""
from __future__ import annotations

import ast
import builtins
import linecache
import operator
import re
import textwrap

import torch

from .formats import NumberHole, line_of, read_hole

_CONV = re.compile(r"%(?P<flags>[-+ #0]*)(?P<width>\d+)?(?:\.(?P<prec>\d+))?[hlL]?(?P<conv>[diouxXeEfFgGcrsa%])")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNKNOWN = object()
_MOD = (6, 19)   # BINARY_OP's argument for ``%`` and ``%=``


def converted_for_text(log, proxy, frame) -> bool:
    """A number converted by C for ``'%d' % i`` (``frame`` running that ``%``) whose text goes,
    through string building only, to a call: pending in the UseLog as a format, not a use (the
    call's text is rebuilt, or it is used after all: UseLog.checks)."""
    from .callframes import running
    from .sinks import format_target, in_sink
    from .uselog import _reads_in
    from .tracked import _where
    i = running(frame)
    if in_sink() or i.opname != "BINARY_OP" or i.arg not in _MOD or _reads_in(proxy._e):
        return False
    offset = format_target(frame.f_code, frame.f_lasti)
    if offset is not None:
        log.pending.append([frame, offset, proxy._e, proxy._v, _where(3), False])
    return offset is not None


def _fields(fmt: str):
    """(literal parts, conversion specs) of a %-format; None for ``%(key)s``, ``*`` widths."""
    if "%(" in fmt or "*" in fmt:
        return None
    lits, specs, pos = [], [], 0
    for m in _CONV.finditer(fmt):
        if m.group("conv") == "%":
            continue
        lits.append(fmt[pos:m.start()].replace("%%", "%"))
        specs.append(m.group(0))
        pos = m.end()
    if "%" in fmt[pos:].replace("%%", ""):
        return None
    return lits + [fmt[pos:].replace("%%", "%")], specs


def _split(text: str, lits: list, n: int):
    """Each field's text, when the literal parts split ``text`` one way only."""
    def match(group):
        pattern = group.join(re.escape(x) for x in lits)
        return re.fullmatch(pattern, text, re.S)
    lazy, greedy = match("(.*?)"), match("(.*)")
    if lazy is None or greedy is None or [lazy.span(k) for k in range(1, n + 1)] != \
            [greedy.span(k) for k in range(1, n + 1)]:
        return None
    return [lazy.group(k) for k in range(1, n + 1)]


def _call_tree(frame):
    """The expression of the call ``frame`` is making, parsed from its source (its instruction's
    positions); None when not found or not parsed."""
    from .callframes import running
    pos = running(frame).positions
    if pos is None or None in (pos.lineno, pos.end_lineno, pos.col_offset, pos.end_col_offset):
        return None
    lines = [linecache.getline(frame.f_code.co_filename, n) for n in range(pos.lineno, pos.end_lineno + 1)]
    if not all(lines):
        return None
    # (positions count UTF-8 bytes)
    enc = [x.encode() for x in lines]
    enc[-1] = enc[-1][:pos.end_col_offset]
    enc[0] = enc[0][pos.col_offset:]
    try:
        return ast.parse(textwrap.dedent(b"".join(enc).decode(errors="replace")), mode="eval")
    except SyntaxError:
        return None


def _resolve(e, frame, item_reads: list):
    """The value an expression of the ``%``'s tuple had, found again without running a call."""
    if isinstance(e, ast.Constant):
        return e.value
    if isinstance(e, ast.Name):
        for scope in (frame.f_locals, frame.f_globals, vars(builtins)):
            if e.id in scope:
                return scope[e.id]
        return _UNKNOWN
    if isinstance(e, ast.Attribute):
        base = _resolve(e.value, frame, item_reads)
        return _UNKNOWN if base is _UNKNOWN else getattr(base, e.attr, _UNKNOWN)
    if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Constant):
        base = _resolve(e.value, frame, item_reads)
        try:
            return _UNKNOWN if base is _UNKNOWN else base[e.slice.value]
        except Exception:  # noqa: BLE001 - not found again: not rebuilt
            return _UNKNOWN
    if isinstance(e, ast.BinOp) and type(e.op) in _BINOPS:
        a, b = _resolve(e.left, frame, item_reads), _resolve(e.right, frame, item_reads)
        return _UNKNOWN if a is _UNKNOWN or b is _UNKNOWN else _BINOPS[type(e.op)](a, b)
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        a = _resolve(e.operand, frame, item_reads)
        return _UNKNOWN if a is _UNKNOWN else -a
    if id(e) in item_reads:
        return item_reads[id(e)]
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id in _PURE and len(e.args) == 1 \
            and not e.keywords and _resolve(e.func, frame, item_reads) is _PURE[e.func.id]:
        a = _resolve(e.args[0], frame, item_reads)   # (``len(dataloader)``: a shape, a constant of the graph)
        return _UNKNOWN if a is _UNKNOWN else _PURE[e.func.id](a)
    return _UNKNOWN


_PURE = {"len": len, "abs": abs}


def _item_reads(tree, reads, lines) -> dict:
    """``x.item()`` in the call: the values read on its lines, in the order the source reads them
    (by node id; none when the counts differ)."""
    item = torch.ops.aten._local_scalar_dense.default   # (not arithmetic on one: it keeps its site)
    line_reads = [r for r in reads.reads if r.node.target is item and line_of(r.site) in lines]
    items = sorted((x for x in ast.walk(tree) if isinstance(x, ast.Call) and not x.args and not x.keywords
                    and isinstance(x.func, ast.Attribute) and x.func.attr == "item"),
                   key=lambda x: (x.lineno, x.col_offset))
    return {id(x): r for x, r in zip(items, line_reads)} if len(items) == len(line_reads) else {}


def rebuild(text: str, tree, frame, pool, tracer):
    """``text`` as literal parts and holes (NumberHole, or a read value's SourceEffect, each with
    its %-spec), or None when it cannot be rebuilt (``pool``: _item_reads)."""
    from .hostscalar import HostFloat, current
    from .tracked import _PROXIES
    for node in ast.walk(tree):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant)
                and isinstance(node.left.value, str)):
            continue
        got = _fields(node.left.value)
        elts = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
        if got is None or len(got[1]) != len(elts):
            continue
        lits, specs = got
        shown = _split(text, lits, len(specs))
        if shown is None:
            continue
        values = [_resolve(e, frame, pool) for e in elts]
        if any(v is _UNKNOWN for v in values):   # (``is``: ``==`` on a read value is a guard)
            return None
        parts = [lits[0]]
        for v, spec, t, lit in zip(values, specs, shown, lits[1:]):
            if not (type(v) in _PROXIES or isinstance(v, HostFloat) or type(v) in (int, float, str, bool)):
                return None   # (a tensor, an object: its text is not rebuilt -- '%.3f' % loss reads it)
            plain = v._v if type(v) in _PROXIES else float.__float__(v) if isinstance(v, HostFloat) else v
            try:
                if spec % (plain,) != t:
                    return None   # (not the value it showed: not found again)
            except (TypeError, ValueError):
                return None
            if type(v) in _PROXIES:
                parts.append(NumberHole(v._e, spec))
            elif isinstance(v, HostFloat) and current(v, tracer):
                parts.append(read_hole(v.node, spec))
            elif isinstance(v, HostFloat):
                return None
            else:
                parts.append(t)   # (a constant of this graph: shown as captured)
            parts.append(lit)
        return parts
    return None


def texts(leaves, reads, tracer, args, lines) -> dict:
    """What the record of a call needs of its strings (pycalls._Record): those made by ``'...' %
    values`` that a replay can rebuild (``percent``), the pending conversions of numbers they hold
    (``marks``, confirmed if the call is redone), which arguments its source does not format
    (``literal``, ``plain``) and the call itself (``target``: frame, offset)."""
    from .callframes import _caller, running
    got = {}
    f = _caller() if reads is not None and any(type(v) is str and v for v in leaves) else None
    tree = _call_tree(f) if f is not None else None   # (parsed once for all its strings)
    pool = _item_reads(tree, reads, lines) if tree is not None else {}
    for k, v in enumerate(leaves) if tree is not None else ():
        if type(v) is str and (parts := rebuild(v, tree, f, pool, tracer)) is not None:
            got[k] = parts
    off = running(f).offset if f is not None else None
    literal, plain = _unformatted(tree.body, args) if tree is not None else (frozenset(), frozenset())
    marks = [p for p in reads.uses.pending if p[0] is f and p[1] == off] if got and reads.uses is not None else []
    return dict(percent=got, marks=marks, literal=literal, plain=plain, target=(f, off))


_FORMATTING = (ast.JoinedStr, ast.BinOp, ast.Call)   # (an f-string, ``%`` or ``+``, ``.format()``/``str()``)


def _unformatted(call, args) -> tuple:
    """Leaf indices of the call's arguments that its source does not format: (string literals,
    and those plus names, attributes, subscripts). A value formatted on the call's line is never
    looked for in them: the step's "1" was found in ``print("resnet18", f"step {i}")``'s first
    argument, and replays printed "resnet28 step 1"."""
    if not isinstance(call, ast.Call) or any(isinstance(a, ast.Starred) for a in call.args) \
            or any(k.arg is None for k in call.keywords):
        return frozenset(), frozenset()
    import torch.utils._pytree as pytree
    a, kw = args
    values = list(a) + [kw.get(k.arg) for k in call.keywords]
    if len(values) != len(call.args) + len(call.keywords) or len(kw) != len(call.keywords):
        return frozenset(), frozenset()
    literal, plain, k = set(), set(), 0
    for e, v in zip(list(call.args) + [k.value for k in call.keywords], values):
        if type(v) is str:
            if isinstance(e, ast.Constant):
                literal.add(k)
            if not any(isinstance(x, _FORMATTING) for x in ast.walk(e)):
                plain.add(k)
        k += len(pytree.tree_leaves(v))
    return frozenset(literal), frozenset(plain)
