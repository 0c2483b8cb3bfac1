"""Remove what a ``make_fx`` trace carries but a replay does not need.

A raw trace holds autograd's ``detach`` calls, the optimizer's profiler ranges, and transposes
of transposes; on the CPU, where each op costs microseconds of dispatch, these alone made a
plain GraphModule replay slower than eager. Nothing here changes what any kernel computes.
"""
from __future__ import annotations

import torch
from torch import fx

from ..markers import zero_grad_marker

aten = torch.ops.aten
_PROFILER = {torch.ops.profiler._record_function_enter_new.default,
             torch.ops.profiler._record_function_exit._RecordFunction}
if hasattr(torch.ops.profiler, "_record_function_enter"):
    _PROFILER.add(torch.ops.profiler._record_function_enter.default)
    _PROFILER.add(torch.ops.profiler._record_function_exit.default)
# View-like ops that return their input's data unchanged when applied as found below.
_ALIAS = {aten.detach.default, aten.alias.default}


def _mutates(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def _impure(node: fx.Node) -> bool:
    """Nodes kept even when unused: writes, RNG draws (to keep the random stream eager-equal)."""
    if node.op in ("placeholder", "output"):
        return True
    t = node.target
    if getattr(t, "stepgraph_impure", False):  # e.g. host-read guards
        return True
    from ..markers import RNG_STATE_FUNCS
    if t in RNG_STATE_FUNCS:
        return True
    if isinstance(t, torch._ops.OpOverload):
        from .analysis import UNANNOTATED_WRITES
        return t._schema.is_mutable or t in UNANNOTATED_WRITES or torch.Tag.nondeterministic_seeded in t.tags
    return False


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.stride() == vb.stride() and va.dtype == vb.dtype)


def cleanup(gm: fx.GraphModule) -> fx.GraphModule:
    """Returns ``gm``; ``gm.meta["replaced"]`` maps each removed alias node to its replacement."""
    g = gm.graph
    replaced = gm.meta.setdefault("replaced", {})
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target in _PROFILER:
            n.replace_all_uses_with(None) if n.users else None
            g.erase_node(n) if not n.users else None
        elif n.target in _ALIAS:
            replaced[n] = n.args[0]
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
        elif n.target is aten.t.default and isinstance(n.args[0], fx.Node) \
                and n.args[0].target is aten.t.default:
            replaced[n] = n.args[0].args[0]
            n.replace_all_uses_with(n.args[0].args[0])
            g.erase_node(n)
        elif n.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) \
                and isinstance(n.args[0], fx.Node) and _same_meta(n, n.args[0]):
            replaced[n] = n.args[0]
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
    # profiler exit nodes consume enter nodes; erase in reverse until stable
    for n in reversed(list(g.nodes)):
        if n.op == "call_function" and n.target in _PROFILER and not n.users:
            g.erase_node(n)
    dce(g)
    g.lint()
    gm.recompile()
    return gm


def dce(g: fx.Graph) -> None:
    for n in reversed(list(g.nodes)):
        if not n.users and not _impure(n):
            g.erase_node(n)


def resolve_bindings(gm, bindings, keep_markers: bool) -> list:
    """Map recorded grad-binding nodes through the cleanup pass's replacements; for backends
    that cannot raise mid-graph (CUDA graphs, Inductor) drop the zero_grad markers instead."""
    if not keep_markers:
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and n.target is zero_grad_marker:
                gm.graph.erase_node(n)
        gm.recompile()
        return []
    replaced, live = gm.meta.get("replaced", {}), set(gm.graph.nodes)
    out = []
    for entry in bindings:
        node = entry[-1]
        while node in replaced:
            node = replaced[node]
        if node in live:
            out.append((*entry[:-1], node) if entry[0] == "bind" else ("zero", None, node))
    return out
