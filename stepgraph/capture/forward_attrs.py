"""Scalar attributes a module's ``forward`` reads on ``self`` (``Dropout.p``, a temperature):
Python values of the step like those pyvalues.py finds in its own code; one the forward assigns
(``self.calls += 1``) is the step's own change, tracked and replayed (trackplan.py)."""
from __future__ import annotations

import dis
import types

from .chains import _chains
from .pyvalues import _SCALARS, _SKIP, Source

_FORWARD_ATTRS: dict = {}   # class -> attribute names forward reads on self


def _self_attrs(cls) -> tuple:
    """(names forward reads on self, names it assigns: ``self.calls += 1``)."""
    got = _FORWARD_ATTRS.get(cls)
    if got is not None:
        return got
    names, written = [], set()
    fwd = getattr(cls, "forward", None)
    if isinstance(fwd, types.FunctionType) and fwd.__code__.co_argcount >= 1:
        self_name = fwd.__code__.co_varnames[0]
        for op, name, path, _ in _chains(fwd.__code__):
            if op in ("LOAD_FAST", "LOAD_FAST_CHECK") and name == self_name and path and path[0][0] == "attr":
                if path[0][1] not in names and path[0][1] != "training":
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
            if isinstance(v, _SCALARS) and not a.startswith("__"):
                label = (names or {}).get(id(m)) or type(m).__name__
                # (a counter forward keeps, ``self.calls += 1``: the step's own change, replayed)
                out.append(Source("object", m, label, (("attr", a),), "", from_step=a in written))
    return out
