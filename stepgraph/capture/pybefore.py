"""Python values before the traced call, checked after it: a defaultdict the step fills (a
fresh ``MetricLogger``'s meters: the call is a warm-up) and a tensor the step replaces before any
read (a forward's ``self.attn = p_attn``, RAFT's ``self.corr_pyramid = [...]``: keyed by metadata,
not identity)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .outputs import _place, same_tensors


@dataclass
class PyBefore:
    """What the step's Python values were before the traced call (for the checks after it)."""
    defaults: list   # (Source, defaultdict, its keys) of each defaultdict it reads: filled_defaults
    tensors: dict    # source index -> the tensor (or None) held there: overwritten


def py_before_call(py, args) -> PyBefore:
    from .pyvalues import Source
    out, tensors = {}, {}
    for i, s in enumerate(py.sources):   # (the dict itself, or one a chain indexes: ``meters["acc1"].update``)
        for n in range(len(s.path), -1, -1):
            if n < len(s.path) and s.path[n][0] != "item":
                continue
            d = Source(s.kind, s.root, s.name, s.path[:n], s.where)
            v = d.read_or(args, None)
            if isinstance(v, dict) and hasattr(type(v), "__missing__"):
                out[id(v)] = (d, v, frozenset(v))
            elif n == len(s.path) and s.path and (v is None or type(v) is torch.Tensor or tensor_list(v)):
                # (not only the step's own reads: the Annotated Transformer's ``self.attn`` of each
                # attention module after the first, keyed as that one, pyvalues' ``classes``)
                tensors[i] = v
    return PyBefore(list(out.values()), tensors)


def overwritten(py, tr, before: PyBefore, args) -> list:
    """Indices of the sources holding a tensor the step replaces before reading it (a forward's
    ``self.attn = p_attn``, kept for visualisation): a replay writes the graph's tensor there, so
    the one held before the call is no input -- keyed by identity it missed at every call (a
    capture per call, never replayed); from now on by None-ness, dtype and shape (Source.key_for).
    Not one the graph reads (an input, a baked constant: that identity is its guard). Also a list
    the step rebinds to the tensors it held (``outputs.same_tensors``): keyed by those tensors."""
    written = {_place(e.source, args) for e in tr.source_effects if e.kind in ("tensor", "tensors") and e.source is not None}
    read = {_place(s, args) for s in tr.source_inputs}
    gm = tr.graph_module
    consts = {getattr(gm, n.target).untyped_storage().data_ptr() for n in gm.graph.nodes if n.op == "get_attr"
              and isinstance(getattr(gm, n.target, None), torch.Tensor) and getattr(gm, n.target).device.type != "meta"}
    out = []
    for i, s in enumerate(py.sources):
        old = before.tensors.get(i)
        if tensor_list(old) and same_tensors(old, s.read_or(args)):
            s.same_tensors = True   # (keyed by the list's identity: a capture per call)
            out.append(i)
        if i not in before.tensors or _place(s, args) not in written - read:
            continue
        old = before.tensors[i]
        if any(t.device.type == "meta" or t.untyped_storage().data_ptr() in consts
               for t in (old if tensor_list(old) else () if old is None else (old,))):
            continue
        s.overwritten = True
        out.append(i)
    return out


def tensor_list(v) -> bool:
    """A list or tuple of plain tensors (torchvision RAFT's ``self.corr_pyramid``)."""
    return type(v) in (list, tuple) and bool(v) and all(type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter) for t in v)


def filled_defaults(before: PyBefore, seen: list) -> str | None:
    """Why the traced call is a warm-up, when it made keys in a defaultdict it reads (a fresh
    ``MetricLogger``'s ``meters["acc1"].update(..)`` at an epoch's first call, as eager does).
    Its effects on the new items were not planned (they did not exist when the capture began),
    and a graph keyed by the dict's old length would never replay: the next call captures with
    the items made. Once per dict (``seen``): a dict that grows again is refused at capture."""
    for s, d, keys in before.defaults:
        if len(d) > len(keys) and not any(x is d for x in seen):
            seen[:] = seen[-7:] + [d]   # (a few kept: a new logger per epoch)
            new = sorted(map(repr, set(d) - keys))
            return f"it made {', '.join(new[:3])}{' ...' if len(new) > 3 else ''} in {s.describe()} (a defaultdict)"
    return None
