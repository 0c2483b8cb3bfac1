"""Device values a CUDA step copies to the host only to return them (``return loss.detach().cpu()``,
DLRM's ``E.detach().cpu().numpy()``): the copy leaves the graph, which returns the device value;
the runtime copies it after each run (``CapturedStep.replay``), as eager's ``.cpu()`` would, to a
host tensor of the same values. A CUDA graph cannot hold that copy (it would copy into the
capture's host memory once). A copy used any other way in the step, of a value the step then
writes in place, or one that also changes dtype, stays refused at its line as before."""
from __future__ import annotations

import torch
from torch import fx


def _is_view(n) -> bool:
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and bool(schema.returns) \
        and schema.returns[0].alias_info is not None and not schema.is_mutable


def _aliases(node: fx.Node) -> set:
    """The tensors sharing ``node``'s memory: its base and the views of it (detach, view, ...)."""
    while _is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    found, todo = {node}, [node]
    while todo:
        for u in todo.pop().users:
            if _is_view(u) and u not in found:
                found.add(u)
                todo.append(u)
    return found


def _written(nodes: set) -> bool:
    return any(u.op == "call_function" and getattr(getattr(u.target, "_schema", None), "is_mutable", False)
               for n in nodes for u in n.users)


def _pure_move(node: fx.Node) -> bool:
    src, val = node.args[0], node.meta.get("val")
    before = src.meta.get("val") if isinstance(src, fx.Node) else None
    return (node.target is torch.ops.aten._to_copy.default and len(node.args) == 1
            and isinstance(val, torch.Tensor) and isinstance(before, torch.Tensor)
            and val.dtype == before.dtype and set(node.kwargs) <= {"dtype", "layout", "device"}
            and node.kwargs.get("layout", torch.strided) == torch.strided)


def to_host_outputs(gm: fx.GraphModule, pending: list, n_user: int) -> tuple[frozenset, list]:
    """``pending``: (graph node, Problem) of each device-to-host copy the trace saw. Returns the
    user output positions the runtime copies to the host after each run, and the problems of
    the copies that stay refused."""
    if not pending:
        return frozenset(), []
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    positions, left = set(), []
    for node, problem in pending:
        pos = [i for i, o in enumerate(outs) if o is node]
        if not pos or max(pos) >= n_user or any(u is not out for u in node.users) or not _pure_move(node) \
                or _written(_aliases(node.args[0])):
            left.append(problem)
            continue
        for i in pos:
            outs[i] = node.args[0]
        positions.update(pos)
    if positions:
        out.args = (type(out.args[0])(outs),)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return frozenset(positions), left
