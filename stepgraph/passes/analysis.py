"""What a captured graph reads and writes, by source name: the facts behind ``explain()``."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx


@dataclass
class GraphSummary:
    ops: int = 0
    inplace_ops: int = 0
    host_scalar_reads: int = 0
    state_read: list[str] = field(default_factory=list)     # source names, graph constants
    state_written: list[str] = field(default_factory=list)
    inputs_written: list[int] = field(default_factory=list)  # placeholder indices the graph mutates
    constants: dict = field(default_factory=dict)           # attr name -> source name
    random_ops: int = 0


# Kernels that write their running statistics although their schema does not say so
# (arguments 3 and 4, in training mode: argument 5).
UNANNOTATED_WRITES = {torch.ops.aten.native_batch_norm.default, torch.ops.aten.cudnn_batch_norm.default}
if hasattr(torch.ops.aten, "miopen_batch_norm"):
    UNANNOTATED_WRITES.add(torch.ops.aten.miopen_batch_norm.default)
# Frees or allocates its argument's storage (FSDP2's unsharded parameters, traced by
# capture/fsdp.py); its schema says nothing, so dead-code elimination would drop it.
RESIZE_STORAGE = torch.ops.inductor.resize_storage_bytes_.default
UNANNOTATED_WRITES.add(RESIZE_STORAGE)


def collective_nodes(gm: fx.GraphModule) -> list:
    """The graph's functional collectives (``_c10d_functional`` ops, their ``wait_tensor``s left
    out): DDP's buckets, FSDP2's gathers and scatters, the step's own ``dist.all_reduce`` & co."""
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and getattr(n.target, "namespace", "") == "_c10d_functional" and "wait" not in str(n.target)]


def host_staged(group) -> str | None:
    """The backend of a process group that stages CUDA tensors through the host (gloo), or None
    for one that runs them on the device (NCCL, XCCL)."""
    import torch.distributed as dist
    backend = str(dist.get_backend(group))
    return None if "nccl" in backend or "xccl" in backend else backend


def written_args(op, args, kwargs):
    """The arguments ``op`` writes in place: its schema's ``a!`` ones, BatchNorm's running
    statistics, a resized storage (fx nodes for a graph node's arguments, tensors for a real call's)."""
    if op is RESIZE_STORAGE:
        yield args[0]
        return
    if op in UNANNOTATED_WRITES and len(args) > 5 and args[5]:
        yield from args[3:5]
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        val = args[i] if i < len(args) else kwargs.get(arg.name)
        yield from (val if isinstance(val, (list, tuple)) else [val])


def _written_args(node: fx.Node):
    return (v for v in written_args(node.target, node.args, node.kwargs) if isinstance(v, fx.Node))


def summarize(gm: fx.GraphModule, name_of) -> GraphSummary:
    """``name_of(tensor) -> source or None`` names graph constants."""
    s = GraphSummary()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    unnamed = 0
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = getattr(gm, n.target)
            if not isinstance(t, torch.Tensor):  # e.g. a c10d ProcessGroup (DDP's collectives)
                s.constants.setdefault(n.target, f"<{type(t).__name__}>")
                continue
            if n.target not in s.constants:
                src = name_of(t)
                if src is None:
                    src = f"<constant #{unnamed} {tuple(t.shape)}>"
                    unnamed += 1
                s.constants[n.target] = src
                if src not in s.state_read:
                    s.state_read.append(src)
        elif n.op == "call_function":
            if n.target is torch.ops.aten._local_scalar_dense.default:
                s.host_scalar_reads += 1
            if not isinstance(n.target, torch._ops.OpOverload):
                continue
            if n.target.namespace == "aten" or n.target.namespace == "prims":
                s.ops += 1
            if torch.Tag.nondeterministic_seeded in n.target.tags:
                s.random_ops += 1
            if n.target._schema.is_mutable or n.target in UNANNOTATED_WRITES:
                s.inplace_ops += 1
                for w in _written_args(n):
                    root = _base(w)
                    if root.op == "get_attr":
                        src = s.constants.get(root.target) or name_of(getattr(gm, root.target)) or root.target
                        if src not in s.state_written:
                            s.state_written.append(src)
                    elif root.op == "placeholder":
                        idx = placeholders.index(root)
                        if idx not in s.inputs_written:
                            s.inputs_written.append(idx)
    return s


def _base(n: fx.Node) -> fx.Node:
    """Follow views and in-place results back to the tensor they alias."""
    seen = 0
    while n.op == "call_function" and seen < 64 and n.args and isinstance(n.args[0], fx.Node):
        t = n.target
        if isinstance(t, torch._ops.OpOverload) and (t.is_view or t._schema.is_mutable):
            n = n.args[0]
        elif t is operator.getitem and isinstance(n.args[0], fx.Node):
            n = n.args[0]
            if isinstance(n.args[0] if n.args else None, (list, tuple)):
                break
        else:
            break
        seen += 1
    return n


@dataclass
class GraphWrites:
    """The tensors a graph writes in place, as graph positions (not source names)."""
    attrs: list[str] = field(default_factory=list)         # get_attr targets (state constants)
    placeholders: list[int] = field(default_factory=list)  # input indices


def graph_writes(gm: fx.GraphModule) -> GraphWrites:
    """What ``gm`` writes, found as ``summarize`` finds it (for a backend that must copy it)."""
    w = GraphWrites()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        if not (n.target._schema.is_mutable or n.target in UNANNOTATED_WRITES):
            continue
        for arg in _written_args(n):
            root = _base(arg)
            if root.op == "get_attr" and root.target not in w.attrs:
                w.attrs.append(root.target)
            elif root.op == "placeholder" and placeholders.index(root) not in w.placeholders:
                w.placeholders.append(placeholders.index(root))
    return w
