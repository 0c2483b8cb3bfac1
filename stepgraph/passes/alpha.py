"""Fold ``alpha=`` of add/sub into an explicit ``mul`` before Inductor sees the graph.

Inductor's post-grad pattern that fuses ``add(inp, mm(a, b))`` into ``addmm(inp, a, b)``
(torch/_inductor/fx_passes/post_grad.py, ``addmm``) ignores the add's ``alpha``: an SGD update
``param.add_(grad, alpha=-lr)`` whose ``grad`` comes straight from a matmul became
``param + grad`` (found on torch 2.13; the optimizer then *ascends*). Writing the scale as its
own ``mul`` keeps the pattern from matching and is the same arithmetic.
"""
from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten
_BINARY = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor}
_FOREACH = {aten._foreach_add.List, aten._foreach_add_.List, aten._foreach_sub.List, aten._foreach_sub_.List}


def fold_alpha(gm: fx.GraphModule) -> int:
    """Rewrite in place; returns how many nodes changed."""
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or "alpha" not in n.kwargs:
            continue
        alpha = n.kwargs["alpha"]
        if alpha == 1 and not isinstance(alpha, fx.Node):
            continue
        if n.target in _BINARY and len(n.args) == 2:
            with gm.graph.inserting_before(n):
                scaled = gm.graph.call_function(aten.mul.Tensor, (n.args[1], alpha))
        elif n.target in _FOREACH and len(n.args) == 2:
            with gm.graph.inserting_before(n):
                scaled = gm.graph.call_function(aten._foreach_mul.Scalar, (n.args[1], alpha))
        else:
            continue
        n.args = (n.args[0], scaled)
        n.kwargs = {k: v for k, v in n.kwargs.items() if k != "alpha"}
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
