"""What runs on the host between CUDA-graph segments (backends/segments.py), and what it costs.

Besides host reads (``loss.item()``) and the Python that uses them, some device ops cannot be
recorded into a CUDA graph because they ask the host to allocate: an op whose **output shape
depends on tensor values** (``nonzero``, ``x[mask]``, ``masked_select``, ``unique``) reads the
count first (one sync inside the op), and indexing *with* a boolean mask (``index_put`` of a
mask: the backward of ``x[mask]``) calls ``nonzero`` inside. Such an op ends a segment and runs
eagerly on the host, exactly as eager runs it (same kernel, same inputs: bitwise), paying the
sync eager pays. Its output shape is a value guard recorded by the trace (``tensor_shape`` +
``host_guard``, capture/modes.py): once the guard holds, the output is copied into a static
buffer of the traced shape, which the next segment was recorded to read (:func:`materialiser`).

Why run the op rather than split it (``nonzero`` on the host, the gather as a recorded kernel):
the op's own kernel is what eager runs, for every data-dependent op at once, with no rewrite
to keep bitwise; the cost is one device copy of its output.

Each sync on the host (a read, a data-dependent op) is timed with ``time.perf_counter`` around
the call that already waits: :class:`SyncPoint` keeps the sum and the count, which ``explain()``
shows as the average host wait per replay.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import torch
from torch import fx

from ..markers import host_guard

READ = torch.ops.aten._local_scalar_dense.default
_MASK_DTYPES = (torch.bool, torch.uint8)
_INDEX_PUT = {torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
              torch.ops.aten._index_put_impl_.default, torch.ops.aten._unsafe_index_put.default}


def _mask_indices(n: fx.Node) -> bool:
    idx = n.args[1] if len(n.args) > 1 else ()
    return any(isinstance(i, fx.Node) and isinstance(i.meta.get("val"), torch.Tensor)
               and i.meta["val"].dtype in _MASK_DTYPES for i in idx or ())


def shape_from_data(n: fx.Node) -> bool:
    """An op whose output shape depends on tensor values (or an item of its tuple output)."""
    if n.op != "call_function":
        return False
    t = n.target
    if t is operator.getitem and isinstance(n.args[0], fx.Node):
        return shape_from_data(n.args[0])
    if not isinstance(t, torch._ops.OpOverload) or torch.Tag.dynamic_output_shape not in t.tags:
        return False
    if t in (torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor):
        return _mask_indices(n)   # integer indexing has a static output shape
    return True


def needs_host(n: fx.Node) -> bool:
    """A device op a CUDA graph cannot record because it syncs to allocate: runs on the host."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    return shape_from_data(n) or (n.target in _INDEX_PUT and _mask_indices(n))


def is_shape_read(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "tensor_shape"


def writes_first_arg(n: fx.Node) -> bool:
    """An in-place op (``index_put_``): its output is its first argument."""
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.arguments or not schema.returns:
        return False
    a, r = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return a is not None and a.is_write and r is not None


def static_like(v: torch.Tensor) -> torch.Tensor:
    """The static buffer a segment reads a host op's output from, shaped as ``v`` (the trace's
    fake value): zeros until the first call fills it (valid indices, should a recording run)."""
    buf = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    with torch.no_grad():
        buf.zero_()
    return buf


def materialiser(buf: torch.Tensor, name: str):
    """A per-call program node: copy a host op's output into its static buffer (after its shape
    guard held); later nodes and segments read the buffer."""
    shape, dtype = buf.shape, buf.dtype

    def materialise(v):
        if v.shape != shape or v.dtype != dtype:   # (its guard runs first: an internal error)
            raise RuntimeError(f"stepgraph: {name} has shape {tuple(v.shape)}, its segment was recorded "
                               f"for {tuple(shape)} with no guard in between")
        buf.copy_(v)
        return buf
    materialise.__name__ = f"materialise_{name}"
    return materialise


@dataclass(eq=False)
class SyncPoint:
    """One place a replay waits for the device on the host: a read or a data-dependent op."""
    site: str                 # file:line (code) of the step, or the op
    what: str
    after_segment: int        # the segment it follows (-1: before the first)
    seconds: float = 0.0      # host wall time in the call, summed over replays
    count: int = 0

    def average_us(self) -> float:
        return self.seconds / self.count * 1e6 if self.count else 0.0


def timed(fn, point: SyncPoint):
    """``fn`` with its host wall time added to ``point`` (the call waits anyway: two clock reads)."""
    clock = time.perf_counter

    def call(*args, **kwargs):
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            point.seconds += clock() - t
            point.count += 1
    call.__name__ = f"timed_{getattr(fn, '__name__', 'read')}"
    return call


def sync_point(n: fx.Node, after_segment: int) -> SyncPoint | None:
    """The sync ``n`` makes on the host, named by the guard or read site it serves; None if none."""
    if n.target is READ:
        what = "value read on the host"
    elif needs_host(n):
        what = f"{n.target} runs on the host (" + ("its output shape depends on tensor values)"
                                                   if shape_from_data(n) else "it indexes with a boolean mask)")
    else:
        return None
    return SyncPoint(_site(n) or n.meta.get("stepgraph_site") or str(n.target), what, after_segment)


def _site(n: fx.Node) -> str | None:
    """The site of the first guard reached from ``n`` through host-side uses."""
    seen, todo = set(), [n]
    while todo:
        x = todo.pop(0)
        for u in x.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if u.target is host_guard:
                return u.args[2]
            if not isinstance(u.target, torch._ops.OpOverload):
                todo.append(u)
    return None
