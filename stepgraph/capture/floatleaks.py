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
    """The holders not stepgraph's or a graph's (a trace's records, fx nodes): held by something
    that is neither stepgraph's nor an attribute dict of stepgraph's, or by nothing of stepgraph's
    (a user's module dict, an optimizer's per-parameter state that a stepgraph effect refers to
    too: both are the user's). Two heap scans, whatever their number."""
    holders = [h for h in holders if not isinstance(h, types.FrameType)]
    if not holders:
        return []
    by_id = {id(h): h for h in holders}
    internal, user, dicts = set(), set(), []
    for r in gc.get_referrers(*holders):
        if isinstance(r, types.FrameType) or r is holders:
            continue
        held = [id(x) for x in gc.get_referents(r) if id(x) in by_id]
        if _ours(r):
            internal.update(held)
        elif type(r) is dict:
            dicts.append((r, held))
        else:
            user.update(held)
    if dicts:
        ours = {id(vars(o)) for o in gc.get_referrers(*[d for d, _ in dicts])
                if _ours(o) and isinstance(getattr(o, "__dict__", None), dict)}
        for d, held in dicts:
            (internal if id(d) in ours else user).update(held)
    return [h for h in holders if id(h) not in internal or id(h) in user]


def _ours(o) -> bool:
    return (type(o).__module__ or "").startswith(("stepgraph", "torch.fx"))
