"""Storages freed between steps become graph temporaries (FSDP2's unsharded parameters).

FSDP2 frees each unsharded parameter after use: the storage is empty (0 bytes) at every step
boundary, and inside a step it goes through one or more intervals of

    resize_storage_bytes_(S, full) -> copy the all-gathered shard into S -> reads -> resize(S, 0)

(``reshard_after_forward=True``: one interval in forward, one more in backward; ``False``: one
from forward to the end of backward). A CUDA graph cannot record a storage resize
(backends/cudagraph.py refuses it). Here each interval's storage becomes a fresh tensor the
graph allocates (``empty`` where the resize to full was), the copy-in writes into it, and every
read in the interval (the unsharded parameter, the all-gather output, views of them, tensors
autograd saved in forward and reads in backward) is redirected to it; views made in an earlier
interval and read in a later one are made again from the later interval's tensor, as eager
reads the storage refilled by the second all-gather. The resizes go. The temporary lives from
its copy-in to its last read, so its memory is the allocator's to reuse afterwards (in a CUDA
graph: the capture's private pool), as FSDP2's free would have released it.

Applied to a storage only when the graph proves it safe: every constant on it is a plain
strided tensor of one dtype, the storage is empty now (the graph's exit: the pass runs right
after the trace), its first op in the graph is a resize to full (so it held nothing the step
read at entry), resizes alternate full/0 and end at 0, no op touches it outside an interval,
and the graph returns nothing aliasing it. Otherwise the storage is left as traced (resize
ops kept: the replay backend runs them). Kernels and their order do not change: results are
bitwise the same.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .analysis import RESIZE_STORAGE
from .cleanup import dce

aten = torch.ops.aten
TEMP_META = "stepgraph_unsharded_bytes"   # node.meta key on each temporary: its size in bytes


@dataclass
class UnshardedReport:
    storages: int = 0          # storages turned into temporaries
    temporaries: int = 0       # intervals (one temporary each)
    resizes_removed: int = 0
    left: dict = field(default_factory=dict)   # storage index -> why it was left as traced


def _const(gm: fx.GraphModule, n: fx.Node):
    obj = gm
    for part in n.target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _storage_key(t) -> object:
    if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter) \
            or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - no storage (a wrapper subclass): never a candidate
        return None


def _alias_source(n: fx.Node):
    """The argument node ``n``'s result aliases (a view's input, an in-place op's ``self``), else None."""
    if n.op != "call_function":
        return None
    t = n.target
    if t is operator.getitem:
        src = n.args[0]
        return src if isinstance(src, fx.Node) and _alias_source(src) is not None else None
    if not isinstance(t, torch._ops.OpOverload) or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if t.is_view:
        return n.args[0]
    rets = t._schema.returns
    if rets and rets[0].alias_info is not None and t._schema.arguments[0].alias_info is not None \
            and rets[0].alias_info.before_set == t._schema.arguments[0].alias_info.before_set:
        return n.args[0]
    return None


def _root(n: fx.Node) -> fx.Node:
    for _ in range(256):
        src = _alias_source(n)
        if src is None:
            return n
        n = src
    return n


def _tensor_args(n: fx.Node):
    """Every node among ``n``'s arguments (nested lists, tuples and dicts included), once each."""
    seen = {}
    fx.node.map_arg((n.args, n.kwargs), lambda x: seen.setdefault(x, None))
    return list(seen)


def _candidates(gm: fx.GraphModule, report: UnshardedReport) -> dict:
    """Storage key -> (constants on it, full size in bytes), for storages the graph resizes
    whose every precondition (module doc) holds."""
    nodes = list(gm.graph.nodes)
    key_of = {}       # get_attr node -> storage key
    consts = {}       # storage key -> [tensor]
    for n in nodes:
        if n.op == "get_attr":
            t = _const(gm, n)
            k = _storage_key(t)
            if k is not None:
                key_of[n] = k
                if not any(t is c for c in consts.setdefault(k, [])):
                    consts[k].append(t)
    resized = {}
    for n in nodes:
        if n.op == "call_function" and n.target is RESIZE_STORAGE:
            r = _root(n.args[0])
            k = key_of.get(r)
            resized.setdefault(k, [])
    ok, order = {}, list(resized)
    for k in resized:
        why = None
        cs = consts.get(k, [])
        if k is None:
            why = "resized tensor is not a plain graph constant"
        elif len({(c.dtype, c.device) for c in cs}) != 1:
            why = "constants of several dtypes or devices share the storage"
        elif cs[0].untyped_storage().nbytes() != 0:
            why = "storage not empty at the graph's end"
        if why:
            report.left[order.index(k)] = why
        else:
            ok[k] = [cs, None]
    if not ok:
        return {}
    # One walk in graph order: intervals alternate, every touch lies inside one, nothing escapes.
    live = {k: False for k in ok}
    rooted = {}       # node -> storage key, for nodes aliasing a candidate storage
    for n in nodes:
        if n.op == "get_attr" and key_of.get(n) in ok:
            rooted[n] = key_of[n]
            continue
        if n.op == "output":
            for a in _tensor_args(n):
                k = rooted.get(_root(a))
                if k in ok:
                    report.left[order.index(k)] = "the graph returns a tensor aliasing it"
                    ok.pop(k)
            continue
        if n.op != "call_function":
            continue
        src = _alias_source(n)
        if src is not None and rooted.get(_root(src)) is not None:
            rooted[n] = rooted[_root(src)]
        if n.target is RESIZE_STORAGE:
            k = rooted.get(_root(n.args[0]))
            if k not in ok:
                continue
            size = n.args[1]
            full, c0 = ok[k][1], ok[k][0][0]
            why = None
            if not isinstance(size, int):
                why = "symbolic resize"
            elif size > 0 and (live[k] or (full is not None and size != full) or size % c0.itemsize):
                why = "resized to full twice, or to two sizes"
            elif size == 0 and not live[k]:
                why = "freed while already free"
            if why:
                report.left[order.index(k)] = why
                ok.pop(k)
                continue
            live[k] = size > 0
            ok[k][1] = size if size > 0 else full
            continue
        for a in _tensor_args(n):
            k = rooted.get(_root(a))
            if k in ok and not live[k]:
                report.left[order.index(k)] = f"{n.name} touches it while it is freed"
                ok.pop(k)
    for k in list(ok):
        if live[k] or ok[k][1] is None:
            report.left[order.index(k)] = "not freed at the graph's end"
            ok.pop(k)
    return {k: (v[0], v[1]) for k, v in ok.items()}


def storages_to_temporaries(gm: fx.GraphModule) -> UnshardedReport:
    """The transformation of the module doc, in place; ``gm.meta["unsharded"]`` holds the report."""
    report = UnshardedReport()
    gm.meta["unsharded"] = report
    ok = _candidates(gm, report)
    if not ok:
        return report
    g = gm.graph
    # Which storage each node aliases, and what it aliases, taken before any rewrite.
    orig_src, rooted = {}, {}
    for n in g.nodes:
        if n.op == "get_attr" and _storage_key(_const(gm, n)) in ok:
            rooted[n] = _storage_key(_const(gm, n))
        elif n.op == "call_function":
            orig_src[n] = src = _alias_source(n)
            if src is not None and src in rooted:
                rooted[n] = rooted[src]
    cur, epoch, memo = {}, {k: 0 for k in ok}, {}

    def key(x: fx.Node):
        return rooted.get(x)

    def rebuild(a: fx.Node, k, before: fx.Node) -> fx.Node:
        """``a`` (aliasing storage ``k``) as it reads in the current interval."""
        m = (a, epoch[k])
        if m in memo:
            return memo[m]
        T = cur[k]
        with g.inserting_before(before):
            if a.op == "get_attr":
                c = _const(gm, a)
                if c.dim() == 1 and c.numel() == T.meta["val_numel"] and c.stride() == (1,) \
                        and c.storage_offset() == 0:
                    new = T
                else:
                    new = g.call_function(aten.as_strided.default,
                                          (T, list(c.shape), list(c.stride()), c.storage_offset()))
            else:
                src_new = rebuild(orig_src[a], k, before)
                if a.target is operator.getitem or a.target.is_view:
                    first = a.args[0]   # (the alias source, perhaps rewritten to an earlier interval's)
                    new = g.node_copy(a, lambda y: src_new if y is first else y)
                else:
                    new = src_new   # an in-place op's result is its (rebuilt) self
        memo[m] = new
        return new

    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is RESIZE_STORAGE and key(n.args[0]) is not None:
            k = key(n.args[0])
            if n.args[1] > 0:
                cs, full = ok[k]
                with g.inserting_before(n):
                    T = g.call_function(aten.empty.memory_format, ([full // cs[0].itemsize],),
                                        {"dtype": cs[0].dtype, "device": cs[0].device, "pin_memory": False})
                T.meta[TEMP_META] = full
                T.meta["val_numel"] = full // cs[0].itemsize
                cur[k] = T
                epoch[k] += 1
                report.temporaries += 1
            else:
                cur[k] = None
            g.erase_node(n)
            report.resizes_removed += 1
            continue
        for a in _tensor_args(n):
            k = key(a)
            if k is not None:
                new = rebuild(a, k, n)
                if new is not a:
                    n.replace_input_with(a, new)
        if key(n) is not None:
            memo[(n, epoch[key(n)])] = n   # made from this interval's temporary already
    report.storages = len(ok)
    dce(g)
    for n in g.nodes:
        n.meta.pop("val_numel", None)
    g.lint()
    gm.recompile()
    return report


def peak_unsharded_bytes(gm: fx.GraphModule) -> int:
    """The most bytes of FSDP2-style storages live at once when the generated code runs ``gm``:
    from resizes (as traced), or from the temporaries' lifetimes (after the pass: a temporary
    lives from its ``empty`` to the last use of anything aliasing it)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    events = []        # (position, +bytes / -bytes)
    sizes = {}
    for i, n in enumerate(nodes):
        if n.op == "call_function" and n.target is RESIZE_STORAGE:
            r = _root(n.args[0]).target   # (one constant, several get_attr nodes)
            events.append((i, n.args[1] - sizes.get(r, 0)))
            sizes[r] = n.args[1]
        elif TEMP_META in n.meta:
            alias, end, todo = {n}, i, [n]
            while todo:
                x = todo.pop()
                for u in x.users:
                    end = max(end, pos[u])
                    if u not in alias and _alias_source(u) is x:
                        alias.add(u)
                        todo.append(u)
            events += [(i, n.meta[TEMP_META]), (end + 0.5, -n.meta[TEMP_META])]
    peak = live = 0
    for _, d in sorted(events, key=lambda e: (e[0], -e[1])):
        live += d
        peak = max(peak, live)
    return peak
