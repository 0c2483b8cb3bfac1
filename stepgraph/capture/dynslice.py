"""A slice at a moving position: ``tokens[pos : pos + n]`` with ``pos`` a Python number the step
advances at every call (llm.c's DataLoaderLite: ``self.current_position += B * T``).

A graph bakes a slice's bounds: each position was a new graph until ``max_captures``, then eager.
Once the position's value check has missed (``UseLog.moving``), the slice is traced as
``index_select(t, 0, arange(n) + pos)`` with ``pos`` read at each replay (a CPU shard of a CUDA
step is sliced before its graph: passes/host_prologue.py), guarded by what makes the two equal: the same
length ``n``, ``0 <= pos`` and ``pos + n <= len(t)`` (eager's slice would be clipped there).

The result is a copy, not a view: a write into it would not reach ``t``, so one is refused
at the end of the trace (:func:`check_unwritten`)."""
from __future__ import annotations

import operator

import torch

from .effects import Problem
from .hostscalar import HostFloat
from .numchecks import Op
from .tracked import _PROXIES, _where, plain


_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def dynamic_slice(log, args, kwargs):
    """``t[start:stop]`` as an index_select when ``start`` is a moving tracked number; None when
    this call is not such a slice (the caller runs the op as it is)."""
    if kwargs or len(args) != 2 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], slice):
        return None
    t, ix = args
    start, stop = ix.start, ix.stop
    # (in a CUDA step the CPU shard's slice runs before the graph at each call, with the position
    # read then: passes/host_prologue.py. Its difference from eager on the H200 was the test's
    # twin, left in the non-capturable AdamW)
    if type(start) not in _PROXIES or ix.step not in (None, 1) or stop is None or t.dim() == 0 \
            or not log.active or not log.moving(start):
        return None
    s0, e0, size = plain(start), plain(stop), t.shape[0]
    if not (isinstance(s0, int) and isinstance(e0, int) and 0 <= s0 <= e0 <= size):
        return None   # (a clipped or empty-by-order slice: left to its value check)
    node = log.lift(start, typed=False)
    if node is None:
        return None
    where = _where(3)
    stop_e = stop._e if type(stop) in _PROXIES else stop
    log.used(Op(operator.sub, (stop_e, start._e)), e0 - s0, where)          # the same length
    log.decide(Op(operator.ge, (start._e, 0)), True, where)                  # not from the end
    log.decide(Op(operator.le, (stop_e, size)), True, where)                 # not clipped
    pos = HostFloat(float(s0), node)
    pos.numbers = (start,)
    index = torch.arange(e0 - s0, device=t.device) + torch.scalar_tensor(pos, dtype=torch.int64, device=t.device)
    # (llm.c's shard is uint16, which index_select does not take: its bits as int16, and back)
    as_signed = _SIGNED.get(t.dtype)
    out = torch.index_select(t if as_signed is None else t.view(as_signed), 0, index)
    out = out if as_signed is None else out.view(t.dtype)
    log.dynamic_slices.append((out, out._version, where))
    return out


def check_unwritten(log, problems: list) -> None:
    """A moving slice written in place (its copy would keep the write from ``t``): refused."""
    for out, version, where in log.dynamic_slices:
        if out._version != version:
            problems.append(Problem(
                "a slice at a position the step moves at every call is written in place: "
                "stepgraph reads it as a copy (index_select) to keep one graph for every position",
                where, "write through an index instead (t.index_copy_(0, torch.arange(n) + pos, "
                       "values)), or slice outside the step", plain=True))
