"""Buffers the step rebinds (DINO's ``self.center = self.center * m + c * (1 - m)``, a custom
BatchNorm's ``self.running_mean = ...``): written into the old buffer in place by the graph.

As a rebinding, each replay would bind a new tensor while the graph kept reading the old one,
its constant (a stale center), and the step's own code, reading ``self.center``, keyed it by
identity: a capture per call. Instead the graph ends with ``old.copy_(new)``, and after the
trace the buffer is bound back to its old tensor holding the new values: one graph, the buffer
always current, the same values as eager (only its identity stays, unlike eager's new tensor).
"""
from __future__ import annotations

import torch

from .rollback import before_write


def rebind_in_place(gm: torch.fx.GraphModule, escapes: list, olds: list, first: int) -> list:
    """For each buffer ``escapes[i]`` (its tensor before the step ``olds[i]``, its new value the
    graph's output ``first + i``) of the same shape, dtype, device and strides: the graph copies
    the new value into the old tensor instead of returning it, and the buffer is bound back to the
    old tensor, now holding the new values. Returns the escapes still rebound after each replay."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    consts = {id(getattr(gm, n.target, None)): n for n in gm.graph.nodes if n.op == "get_attr"}
    kept, drop = [], set()
    for i, (s, old) in enumerate(zip(escapes, olds)):
        new = s.get()
        if not (s.kind == "buffer" and isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
                and type(old) is torch.Tensor and not old.requires_grad
                and (old.shape, old.dtype, old.device, old.stride()) == (new.shape, new.dtype, new.device, new.stride())):
            kept.append(s)
            continue
        with gm.graph.inserting_before(out):
            ref = consts.get(id(old))
            if ref is None:
                name = f"_sg_rebound_{len(consts)}"
                setattr(gm, name, old)
                ref = consts[id(old)] = gm.graph.get_attr(name)
            gm.graph.call_function(torch.ops.aten.copy_.default, (ref, outs[first + i]))
        drop.add(first + i)
        before_write(old)   # (undone with the rest if the capture fails after this)
        with torch.no_grad():
            old.copy_(new)
        s.set(old)
    if drop:
        out.args = ([o for k, o in enumerate(outs) if k not in drop],)
        gm.recompile()
    return kept
