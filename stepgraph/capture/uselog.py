"""What one trace did with the tracked numbers (tracked.py): ``UseLog`` records each use of a
proxy (a decision, a value use, a number lifted into the graph) and turns them into the
:class:`numchecks.Check` list a captured graph keeps."""
from __future__ import annotations

import collections
import sys
from dataclasses import dataclass, field

from .numchecks import Check, Op, Root, call_values, describe, roots_of, substitute
from .tracked import TrackedFloat, TrackedInt, _where, plain


# ---- what one trace saw ------------------------------------------------------------------
def _reader(root: Root, of_call: bool = False):
    """Graph node target: the root's value at the replay (the Python before the step's);
    ``of_call``: a number of the replayed call's arguments (numchecks.set_call)."""
    def read_number():
        return root.read(*call_values()) if of_call else root.read((), ())
    read_number.__name__ = "read_" + "".join(c if c.isalnum() else "_" for c in root.label)[:40]
    read_number.number_label = root.label   # (explain(): the numbers read live)
    return read_number


def _reads_in(expr) -> list:
    return [r for r in roots_of(expr) if r.kind == "read"]


def _settle(expr):
    """A check runs before its graph replays, when the replay's own host reads (hostreads.ReadRef)
    are not known yet: the reads ``expr`` involves are guarded by value in the graph, where it
    is used, and the check keeps the rest (``correct + n > 5`` -> ``n`` guarded, ``correct + 3 > 5``)."""
    reads = _reads_in(expr)
    if not reads:
        return expr
    for r in reads:
        r.ref.guard()
    return substitute(expr, {id(r): r.ref.value for r in reads})


@dataclass(eq=False)
class UseLog:
    """Uses of the tracked numbers during one trace, turned into checks by :meth:`checks`."""
    active: bool = True
    found: dict = field(default_factory=dict)       # describe(expr) -> Check (first seen)
    node_uses: list = field(default_factory=list)   # (expr, value, graph nodes, where)
    pending: list = field(default_factory=list)     # formats waiting for a print: [frame, offset, expr, value, where, ok]
    proxies: list = field(default_factory=list)     # every proxy made (to clean out of user objects)
    returned: set = field(default_factory=set)      # ids of the plain numbers handed back as results
    returned_exprs: dict = field(default_factory=dict)  # result leaf index -> expression computed at replay
    returned_nodes: dict = field(default_factory=dict)  # result leaf index -> graph node of a number from reads
    prints: list = field(default_factory=list)      # sites of print() calls the step made (sinks.py)
    clocks: list = field(default_factory=list)      # sites where a value from time.time() & co. is used as a constant
    start_clocks: list = field(default_factory=list)  # clock Roots read before any tensor op: read before a replay
    # Numbers meeting host reads become graph nodes (a CUDA graph holding one goes to the replay
    # backend: pipeline.refuse_host_python); numbers fed to tensor ops only where this is set (the
    # CPU, for backends that run Python at replay: pipeline.trace's ``lift_numbers``).
    lift_tensor_ops: bool = False
    # On CUDA too, numbers whose value check missed once (a meter's ``count``, 16 then 24): a
    # CUDA graph's segments run the op they feed on the host (backends/segments.py), as eager.
    moving_labels: frozenset = frozenset()
    lifted: dict = field(default_factory=dict)      # id(Root) -> its reader node in this graph
    formats: list | None = None   # ReadLog.formats: numbers formatted into text go there too (formats.py)
    root_values: dict = field(default_factory=dict)  # id(Root) -> its value in this trace
    dynamic_slices: list = field(default_factory=list)  # (copy, its version, where): dynslice.py

    def moving(self, proxy) -> bool:
        # (the clock moves at every call: ``time.time() - end`` with ``end`` a float read live;
        # so does an optimizer's Python step counter)
        return any(r.kind in ("clock", "slot") or r.label in self.moving_labels for r in roots_of(proxy._e))

    def wrap(self, value, root: Root):
        p = (TrackedFloat if isinstance(value, float) else TrackedInt)(plain(value), root, self)
        self.root_values[id(root)] = plain(value)
        self.proxies.append(p)
        return p

    def derive(self, value, expr):
        if type(value) is int:
            p = TrackedInt(value, expr, self)
        elif type(value) is float or type(value).__name__ == "float64":   # (numpy's exp: hostufuncs.py)
            p = TrackedFloat(value, expr, self)
        else:   # a bool (``a & b`` of 0/1), a complex: handed out plain, so used as is
            self.used(expr, value, _where(3))
            return value
        self.proxies.append(p)
        return p

    def used(self, expr, value, where=""):
        if any(r.kind == "clock" for r in roots_of(expr)):
            # (a value the clock gives differs at every call: a check would miss at each one.
            # Kept as this capture's value and named at capture: outputs.read_side_effects)
            self.clocks.append(where or _where(3))
            return
        expr = _settle(expr)
        self.found.setdefault(("=", describe(expr)), Check(expr, value, where))

    def decide(self, expr, outcome: bool, where=""):
        if isinstance(outcome, bool) and _reads_in(expr) and _decide_in_graph(self, expr, outcome, where):
            return
        expr = _settle(expr)
        self.found.setdefault(("?", describe(expr)), Check(expr, outcome, where, decided=True))

    def lift(self, proxy, typed: bool = True):
        """The graph node computing ``proxy`` from its roots read at each replay, or None: where
        a number meets a value read from a tensor (``meter.sum += loss.item() * n``) the sum is
        then live, not baked and checked (each step would miss). Roots only the call's Python
        holds (arguments) are not lifted. ``typed``: their types are checked (a tensor op
        promotes an int and a float apart; Python arithmetic with a float does not)."""
        from .hostscalar import _tracer
        tracer = _tracer()

        def build(e):
            if isinstance(e, Op):
                return tracer.create_node("call_function", e.fn, tuple(build(a) for a in e.args), {})
            if not isinstance(e, Root):
                return e
            if e.kind == "read":
                return e.ref.node
            of_call = e.kind == "leaf" or e.kind not in ("clock", "slot") and (e.ref if e.kind == "source" else e.ref[0]).kind == "arg"
            if of_call and e.label not in self.moving_labels:
                raise LookupError(e.label)   # (an argument that never changed stays checked)
            if id(e) not in self.lifted:
                self.lifted[id(e)] = tracer.create_node("call_function", _reader(e, of_call), (), {})
            if typed:
                t = Op(type, (e,))
                v = self.root_values[id(e)] if id(e) in self.root_values else e.read((), ())
                self.found.setdefault(("?", describe(t)), Check(t, type(v), "", True))
            return self.lifted[id(e)]
        try:
            return build(proxy._e)
        except LookupError:
            return None

    def guard_stored_reads(self) -> None:
        """At the end of the step, still in its trace: a number made from an int host read that
        the step stored somewhere (``stats.last = n``; trackplan's write-backs are plain by now)
        is guarded: a replay would not store it again, so it must not differ."""
        from . import hostscalar   # (a live float carrying it, ``meter += n``, is no store: hostscalar.live_op)
        carried = collections.Counter(id(q) for f in hostscalar.MADE or () for q in f.numbers)
        for p in [p for p in self.proxies if _reads_in(p._e) and sys.getrefcount(p) - carried[id(p)] > 3]:
            self.used(p._e, p._v, "stored in a Python object")

    def node_use(self, proxy, nodes):
        """The number became a constant of these graph nodes: used only if one survives."""
        if _reads_in(proxy._e):   # a host read: guarded now (after the trace no guard can be placed)
            self.used(proxy._e, proxy._v, _where(3))
            return
        self.node_uses.append((proxy._e, proxy._v, list(nodes), _where(3)))

    def formatted(self, proxy, frame, text: str = "", spec: str = ""):
        from .sinks import format_target, in_sink
        if in_sink():
            return  # formatted by print/logging themselves
        if _reads_in(proxy._e):
            self.used(proxy._e, proxy._v, _where(3))
            return
        from .callframes import reformatted
        offset = format_target(frame.f_code, frame.f_lasti)
        if offset is None or reformatted(frame):   # (padded again: its width is the value's)
            self.used(proxy._e, proxy._v, _where(3))
        else:
            self.pending.append(p := [frame, offset, proxy._e, proxy._v, _where(3), False])
            if self.formats is not None:   # (a call redone after each replay puts this call's there)
                from .formats import Format
                self.formats.append(Format(None, text, spec, proxy._e, f"{frame.f_code.co_filename}:{frame.f_lineno}", p))

    def confirm(self, frame, offset):
        for p in self.pending:
            if p[0] is frame and p[1] == offset:
                p[5] = True

    def checks(self, gm) -> list[Check]:
        """Every check of this trace, once the graph is final (after dead-code elimination)."""
        self.active = False
        for frame, _, expr, value, where, ok in self.pending:
            if not ok:   # formatted into text that went elsewhere than print/logging
                self.used(expr, value, where)
        self.pending.clear()
        if self.node_uses:
            alive = set(gm.graph.nodes)
            replaced = gm.meta.get("replaced", {})
            for expr, value, nodes, where in self.node_uses:
                for n in nodes:
                    while n not in alive and n in replaced:
                        n = replaced[n]
                    if n in alive:
                        self.used(expr, value, where)
                        break
        return list(self.found.values())


def _decide_in_graph(log: "UseLog", expr, outcome: bool, where) -> bool:
    """A decision on a value the step read from a tensor (``if decoder_input.item() ==
    EOS_token: break``) is guarded by its outcome in the graph, where the read is known: a
    replay computes the comparison and misses only when it decides the other way. (Settled
    before the replay instead, the read was guarded by value: one capture per predicted
    token, and behind dropout a refused step.) The other numbers it involves are checked by
    value before the replay; False where the graph cannot compute it."""
    from .hostscalar import _tracer
    tracer = _tracer()
    if tracer is None:
        return False
    others: dict = {}

    def build(e):
        if isinstance(e, Op):
            return tracer.create_node("call_function", e.fn, tuple(build(a) for a in e.args), {})
        if not isinstance(e, Root):
            return e
        if e.kind == "read":
            return e.ref.node
        if id(e) not in log.root_values:
            raise LookupError(e.label)
        others[id(e)] = e
        return log.root_values[id(e)]
    try:
        node = build(expr)
    except LookupError:
        return False
    for r in others.values():
        log.used(r, log.root_values[id(r)], where)
    what = describe(expr)
    for r in _reads_in(expr):   # (its label repeats the site the guard names)
        what = what.replace(r.label, r.ref.what)
    ref = _reads_in(expr)[0].ref
    ref.log.guard(node, outcome, f"the decision {what}", ref.site)
    return True
