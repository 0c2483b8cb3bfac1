"""Host work a CUDA step does before its device work: run before the graph at each call.

``_ts = torch.randint(1, n_T + 1, (x.shape[0],)).to(device)`` (a DDPM's timesteps, drawn by the
CPU generator as the program wrote it), ``torch.arange(n).to(device)``, a CPU index built from
the call's CPU tensors: a CUDA graph would run that CPU work once, at capture, and copy the
capture's bytes at every replay (so the trace refused it as "CPU work in a CUDA step"). Here the
CPU ops that depend only on the call's CPU tensors and on each other (``modes.
_DispatchCheckMode.host``), and their copies to the GPU, are cut out of the graph into a
prologue: a small fx graph run eagerly before the graph at each call, as eager runs those ops
(the same CPU generator draws, in the same order), whose results the graph reads as inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..errors import NeedsReplay
from .device_scalars import host_nodes


@dataclass(frozen=True)
class Prologue:
    """``module(*[inputs[i] for i in reads])`` -> the graph's extra inputs (appended after its
    others), at each call."""
    module: fx.GraphModule
    reads: tuple          # positions among the graph's inputs that the prologue reads
    n_outputs: int
    draws: bool = False   # it draws from the CPU generator (given back when the graph's guard misses)

    def __call__(self, inputs: list) -> list:
        out = self.module(*[inputs[i] for i in self.reads])
        return list(out)


def _mutable(n) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _numbers_read(host: list, numbers: set) -> set:
    """The live numbers (and arithmetic on them) the host nodes read, transitively."""
    out: set = set()
    todo = [a for n in host for a in n.all_input_nodes if a in numbers]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(a for a in n.all_input_nodes if a in numbers)
    return out


def split_prologue(gm: fx.GraphModule, example: list, skip=()) -> Prologue | None:
    """Move the host nodes of ``gm`` (CPU ops on CPU placeholders, get_attr constants and each
    other; their ``_to_copy`` to the device) into a prologue; ``example`` gets the values the
    trace computed for the new inputs. ``skip``: placeholder positions handled otherwise
    (moved_arguments). None when there is nothing to move."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    host: list = []
    # A tensor some op writes in place (an optimizer's CPU step counter) is read where the graph
    # reads it, after the writes before that read: not hoisted.
    written = {a for n in gm.graph.nodes if n.op == "call_function" and _mutable(n)
               for a in n.all_input_nodes}
    is_host: set = {n for n in placeholders if index[n] not in skip and n not in written}
    is_host |= {n for n in gm.graph.nodes if n.op == "get_attr" and n not in written}   # (constants)
    # Numbers read at each call (a loader's position, capture/dynslice.py) and the Python
    # arithmetic on them are host values too: the prologue reads them, as the graph would.
    numbers = set(host_nodes(gm, numbers=True))
    is_host |= numbers
    left = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.meta.get("stepgraph_host"):
            (host if all(i in is_host for i in n.all_input_nodes) else left).append(n)
            is_host.add(n)
    if left:
        raise NeedsReplay(
            f"the step computes on the CPU ({left[0].target}) from values the graph computes: a CUDA "
            "graph would run that only at capture", op=str(left[0].target), where="the step function",
            fix="compute it on the GPU, or before the step")
    if not host:
        return None
    hosted = set(host)
    # The prologue's results: host nodes some other node (or the output) reads.
    outs = [n for n in host if any(u not in hosted for u in n.users)]
    if not outs:
        return None
    read = _numbers_read(host, numbers)   # (copied in; kept in the graph too where it reads them)
    host = [n for n in gm.graph.nodes if n in hosted or n in read]
    pro = fx.Graph()
    env: dict = {}
    reads = []
    for n in placeholders:
        if any(u in hosted for u in n.users):
            env[n] = pro.placeholder(n.name)
            reads.append(index[n])
    for n in gm.graph.nodes:
        if n.op == "get_attr" and any(u in hosted for u in n.users):
            env[n] = pro.get_attr(n.target)
    for n in host:
        env[n] = pro.node_copy(n, lambda x: env[x])
    pro.output(tuple(env[n] for n in outs))
    module = fx.GraphModule(gm, pro)
    # In the graph: each result becomes an input after the others; the host nodes go.
    last = placeholders[-1] if placeholders else None
    for k, n in enumerate(outs):
        with gm.graph.inserting_after(last) if last is not None else gm.graph.inserting_before(None):
            ph = gm.graph.placeholder(f"host_{k}")
        ph.meta = {k: v for k, v in n.meta.items() if k != "stepgraph_host"}
        n.replace_all_uses_with(ph)
        last = ph
        v = n.meta["val"]   # (fake: the shape of what the prologue hands the graph at each call)
        example.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).zero_())
    for n in reversed(host):
        if n not in read or not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
    draws = any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in host)
    return Prologue(module, tuple(reads), len(outs), draws)
