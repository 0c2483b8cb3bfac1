"""No stepgraph float left in the user's objects once a capture is over.

While tracing, a float the step reads live (a param group's lr: ``HyperFloat``; a value read
from a tensor: ``ReadFloat``) is a ``hostscalar.HostFloat``, a float subclass that carries its
graph node. Python code that copies one into its own objects kept it after the capture:
``ReduceLROnPlateau.step`` stepped in the step copies the lr into ``_last_lr``, and a checkpoint of
the scheduler then failed ``torch.load``'s default ``weights_only=True`` ("Unsupported global:
GLOBAL float"); ``log.append(("loss", step, loss.item()))`` left one in the user's list, where
``type(x) is float`` is false (both found by probes). After the capture, each one still held
outside stepgraph is replaced by the plain float in the lists, dicts, cells and tuples holding it
(sinks.replace_escaped, which also scrubs tracked numbers).
"""
from __future__ import annotations

import contextlib
import gc
import types

from . import hostscalar
from .sinks import replace_escaped


@contextlib.contextmanager
def plain_after():
    """Around a capture: the HostFloats it makes are replaced by plain floats where the
    user's objects hold them, whatever the capture's outcome."""
    outer, hostscalar.MADE = hostscalar.MADE, []
    made = hostscalar.MADE
    try:
        yield
    finally:
        hostscalar.MADE = outer
        replace_escaped(made, float.__float__, _users)


def _users(holders: list) -> list:
    """The holders not stepgraph's or a graph's (a trace's records, fx nodes), held neither
    directly by one nor as an attribute in one's ``__dict__`` (a user's module dict is no such
    thing, even where a stepgraph source refers to it). Two heap scans, whatever their number."""
    holders = [h for h in holders if not isinstance(h, types.FrameType)]
    if not holders:
        return []
    by_id = {id(h): h for h in holders}
    internal, dicts = set(), []
    for r in gc.get_referrers(*holders):
        if isinstance(r, types.FrameType) or r is holders:
            continue
        held = [id(x) for x in gc.get_referents(r) if id(x) in by_id]
        if _ours(r):
            internal.update(held)
        elif type(r) is dict:
            dicts.append((r, held))
    if dicts:
        ours = {id(vars(o)) for o in gc.get_referrers(*[d for d, _ in dicts])
                if _ours(o) and isinstance(getattr(o, "__dict__", None), dict)}
        for d, held in dicts:
            if id(d) in ours:
                internal.update(held)
    return [h for h in holders if id(h) not in internal]


# stepgraph objects that only point at a place in the user's objects (a state slot, a replayed
# number's container, a source's root): what they point at stays the user's -- timm LaProp's and
# NAdamLegacy's per-parameter state kept a HyperFloat after the capture
_POINTERS = frozenset(("Slot", "NumberEffect", "SlotTarget", "Source", "Root"))


def _ours(o) -> bool:
    t = type(o)
    return (t.__module__ or "").startswith(("stepgraph", "torch.fx")) and t.__name__ not in _POINTERS
