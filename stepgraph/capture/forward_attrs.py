"""Scalar attributes a module's ``forward`` reads on ``self`` (``Dropout.p``, a temperature, and
containers of scalars keyed by value: an adjacency dict of neighbour sets):
Python values of the step like those pyvalues.py finds in its own code; one the forward assigns
(``self.calls += 1``) is the step's own change, tracked and replayed (trackplan.py)."""
from __future__ import annotations

import dis
import types

from .chains import _all_code, _chains, unwrapped_function
from .pyvalues import _SCALARS, _SKIP, Source, guard_value

_FORWARD_ATTRS: dict = {}   # class -> attribute names forward reads on self


def _self_attrs(cls) -> tuple:
    """(names forward reads on self, names it assigns: ``self.calls += 1``)."""
    got = _FORWARD_ATTRS.get(cls)
    if got is not None:
        return got
    names, written = [], set()
    fwd = unwrapped_function(getattr(cls, "forward", None))
    if isinstance(fwd, types.FunctionType) and fwd.__code__.co_argcount >= 1:
        self_name = fwd.__code__.co_varnames[0]
        # (comprehensions and inner functions too: GraphSAGE's ``[self.adj_lists[int(v)] for v in
        # nodes]`` reads ``self`` as a free variable of the comprehension's own code on 3.11)
        for code in _all_code(fwd.__code__):
            for op, name, path, _ in _chains(code):
                if op in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF") and name == self_name and path \
                        and path[0][0] == "attr" and path[0][1] not in names and path[0][1] != "training":
                    names.append(path[0][1])
        written = {x.argval for x in dis.get_instructions(fwd.__code__) if x.opname == "STORE_ATTR"}
    _FORWARD_ATTRS[cls] = got = (tuple(names), written)
    return got


def module_sources(modules, names: dict | None = None) -> list:
    """Scalar attributes each module's ``forward`` reads on ``self`` (``Dropout.p``...)."""
    out = []
    for m in modules:
        d = m.__dict__
        read, written = _self_attrs(type(m))
        for a in read:
            v = d.get(a, _SKIP)
            # (and containers of scalars: GraphSAGE's ``self.adj_lists``, a dict of neighbour sets
            # the forward turns into index constants -- keyed by value up to valuekeys' budget)
            if (isinstance(v, _SCALARS) or isinstance(v, (list, tuple, dict, set, frozenset))
                    and guard_value(v)[:1] != ("object",)) and not a.startswith("__"):
                label = (names or {}).get(id(m)) or type(m).__name__
                # (a counter forward keeps, ``self.calls += 1``: the step's own change, replayed)
                out.append(Source("object", m, label, (("attr", a),), "", from_step=a in written))
    return out
