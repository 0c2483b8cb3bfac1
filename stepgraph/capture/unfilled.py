"""Tensors an op fills behind the dispatcher, which no trace sees.

``nn.CTCLoss`` with its lengths given as lists (``reduction='mean'``) divides by
``at::tensor(target_lengths).clamp_min(1)``: ATen makes that tensor with ``aten.empty`` and
copies the numbers in with a memcpy. The trace recorded the ``empty`` only, so every replay
divided by uninitialized memory: garbage losses, and training on them, silently (helper-90,
session 36). A small CPU ``empty`` whose first use reads its values (not a write into it, not a
view of it) is baked as a constant holding what the real run had there when it was read. Those
values came from the op's arguments: numbers an op takes are keyed by value, so a graph holds
for them. (An ``empty`` the step reads before any write holds garbage in eager too.)
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

aten = torch.ops.aten
_EMPTIES = frozenset((aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
                      aten.new_empty_strided.default, aten.empty_like.default))
_LIMIT = 4096   # elements: lengths and offsets, not activations


class Unfilled:
    """Seen by the trace's dispatch mode (modes._DispatchCheckMode): each small CPU ``empty``
    until its first use, and what the first uses that read them found there."""

    def __init__(self):
        self.pending: dict = {}   # id -> (the tensor, its graph node)
        self.baked: list = []     # (graph node, its values when first read)

    def before(self, func, args, kwargs) -> None:
        schema = getattr(func, "_schema", None) if self.pending else None
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in pytree.tree_leaves(v):
                hit = self.pending.pop(id(t), None) if isinstance(t, torch.Tensor) else None
                if hit is not None and hit[0] is t and a.alias_info is None:   # (a read of its values)
                    self.baked.append((hit[1], t.detach().clone()))

    def after(self, func, out) -> None:
        if func in _EMPTIES and isinstance(out, torch.Tensor) and out.device.type == "cpu" \
                and out.numel() <= _LIMIT:
            from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, has_proxy_slot
            mode = get_proxy_mode()
            if mode is not None and has_proxy_slot(out, mode.tracer):   # (none: an op run untraced)
                self.pending[id(out)] = (out, get_proxy_slot(out, mode.tracer).proxy.node)

    def bake(self, gm) -> None:
        """Each ``empty`` read before any write becomes a constant of ``gm`` holding what was read."""
        for k, (node, values) in enumerate(self.baked):
            if node.graph is not gm.graph:
                continue
            name = f"_stepgraph_filled_{k}"
            setattr(gm, name, values)
            with gm.graph.inserting_before(node):
                const = gm.graph.get_attr(name)
            const.meta = dict(node.meta)
            node.replace_all_uses_with(const)
            gm.graph.erase_node(node)
        if self.baked:
            gm.recompile()
