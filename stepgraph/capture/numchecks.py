"""Checks a captured graph keeps on the Python numbers it used (tracked.py): an expression of
the numbers' roots (``epoch % every == 0``) and the value it had at capture, evaluated before
each replay."""
from __future__ import annotations

import operator
import threading
from dataclasses import dataclass

# The call being replayed, for graph nodes that read a number of its arguments live (an ``it``
# the step computes its lr from): set by CapturedStep.replay, in the thread that runs the graph.
_CALL = threading.local()


def set_call(leaves, args) -> None:
    _CALL.now = None if leaves is None else (leaves, args)


def call_values() -> tuple:
    now = getattr(_CALL, "now", None)
    if now is None:
        raise LookupError("a number of the step's arguments is read outside a replay")
    return now


@dataclass(eq=False)
class Root:
    """Where a tracked number comes from: a leaf of the call's arguments, a Source (pyvalues),
    an attribute of the object a Source reads (a meter's ``count``) or the clock (``time.time()``
    called by the step: read again wherever a replay evaluates it)."""
    kind: str          # "leaf" | "source" | "attr" | "read" | "clock" | "slot"
    ref: object        # leaf index | Source | (Source, attribute name) | hostreads.ReadRef | the clock
    #                    | (state.Slot, its key)
    label: str

    def read(self, leaves, args):
        from .tracked import plain
        if self.kind == "read":   # a replay's own host read: only its outputs know it
            raise LookupError(f"{self.label} is known only after a replay")
        if self.kind == "leaf":
            return plain(leaves[self.ref])
        if self.kind == "clock":
            return self.ref()
        if self.kind == "slot":   # (an optimizer's per-parameter ``state['step']`` held as a Python int)
            return plain(self.ref[0].get())
        if self.kind == "source":
            return plain(self.ref.read(args))
        src, name = self.ref
        return plain(vars(src.read(args))[name])


class Op:
    """``fn(*args)`` where args are Roots, Ops or constants."""
    __slots__ = ("fn", "args")

    def __init__(self, fn, args):
        self.fn, self.args = fn, args


_SYMBOLS = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
            operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.lshift: "<<",
            operator.rshift: ">>", operator.and_: "&", operator.or_: "|", operator.xor: "^",
            operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=",
            operator.eq: "==", operator.ne: "!="}


def describe(e) -> str:
    if isinstance(e, Root):
        return e.label
    if isinstance(e, Op):
        sym = _SYMBOLS.get(e.fn)
        if sym is not None:   # (an operand that is itself ``a op b`` in parentheses: ``(it - 2) / 8``)
            a, b = (f"({describe(x)})" if isinstance(x, Op) and x.fn in _SYMBOLS else describe(x) for x in e.args)
            return f"{a} {sym} {b}"
        name = {operator.truth: "bool", operator.neg: "-", id: "id", type: "type"}.get(e.fn, getattr(e.fn, "__name__", "f"))
        return f"{name}({', '.join(describe(x) for x in e.args)})"
    return repr(e)


def evaluate(e, leaves, args, memo: dict):
    if isinstance(e, Root):
        if id(e) not in memo:
            memo[id(e)] = e.read(leaves, args)
        return memo[id(e)]
    if isinstance(e, Op):
        return e.fn(*(evaluate(a, leaves, args, memo) for a in e.args))
    return e


def _kind(x) -> type:
    from .hostscalar import HostFloat   # (a live value stepgraph put in: the user's float)
    return float if isinstance(x, HostFloat) else type(x)


def _same(a, b) -> bool:
    return _kind(a) is _kind(b) and (a == b or (a != a and b != b))


@dataclass(eq=False)
class Check:
    """What a captured graph assumed about tracked numbers: ``expr`` evaluates to ``expected``."""
    expr: object
    expected: object
    where: str = ""
    decided: bool = False   # a decision (bool) rather than a value the graph took

    def holds(self, leaves, args, memo) -> bool:
        try:
            return _same(evaluate(self.expr, leaves, args, memo), self.expected)
        except Exception:  # noqa: BLE001 - a missing attribute or a failing op is a miss
            return False

    def miss(self, leaves, args) -> str:
        try:
            now = repr(evaluate(self.expr, leaves, args, {}))
        except Exception as e:  # noqa: BLE001
            now = f"<{type(e).__name__}>"
        d = describe(self.expr)
        d = d if len(d) <= 120 else d[:100] + " ... " + d[-15:]   # (a discounted return over 8 rewards)
        return f"{d} {self.expected!r} -> {now}" + (f" (at {self.where})" if self.where else "")


def slot_rooted(x) -> bool:
    """A tracked number computed from an optimizer's Python state (a Root of kind "slot")."""
    return any(r.kind == "slot" for r in roots_of(x._e))


def roots_of(e) -> list:
    if isinstance(e, Root):
        return [e]
    return [r for a in e.args for r in roots_of(a)] if isinstance(e, Op) else []


def checks_hold(checks, leaves, args) -> bool:
    memo: dict = {}
    return all(c.holds(leaves, args, memo) for c in checks)


def substitute(e, values: dict):
    """``e`` with the Roots whose id is in ``values`` replaced by those constants."""
    if isinstance(e, Root):
        return values.get(id(e), e)
    if isinstance(e, Op):
        return Op(e.fn, tuple(substitute(a, values) for a in e.args))
    return e
