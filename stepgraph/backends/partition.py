"""A large whole-step graph compiled in parts, side by side (``backend="inductor"``, background).

Inductor compiles one graph in one Python thread. GPT-2 124M's step (nanoGPT's ``train.py``
body, 2 micro-batches: 3,578 aten ops) took 37-43 s on an H200 host: Scheduler 8.7 s, its
codegen 9.6, lowering 6.5, AOTAutograd's re-trace ~7 (``scripts/profile_inductor.py``). That was
most of the time until the fused step took over. Here the lifted graph is cut, at the points in
graph order where the fewest bytes are live, into parts that compile in as many child processes
at once (``background.BackgroundCompile`` each, each with its own artifact-cache entry). The
fused step then calls the compiled parts in order, inside the one CUDA graph recorded as before.

What a cut costs: no fusion across it (two or three cuts among thousands of ops) and the tensors
live at the cut are materialised (they are, mostly, anyway: a cut is put where few bytes cross).
The switch's check against the unfused graph (verify.py) covers the whole step, as before.
Cuts are only where every value crossing is a tensor, and no memory some op writes is shared by
two of them or is a graph input's (``_Crossing``; read-only views, such as micro-batch slices of
the batch, may cross): a part compiles its inputs as unaliased, so two inputs sharing memory, one
of them written, would be read before the write lands (AOTAutograd applies a graph's input writes
at its end).
"""
from __future__ import annotations

import operator
import os
import time
from dataclasses import dataclass

import torch
from torch import fx

from .. import config

# No part under this many ops: a small graph compiles in seconds anyway.
_MIN_OPS_PER_PART = 600


@dataclass(frozen=True)
class Part:
    """One part: a graph over the values it reads (by the whole graph's node names) and returning
    the values later parts or the step's outputs read."""

    gm: fx.GraphModule
    reads: tuple      # names of the whole graph's nodes (or placeholders) it takes, in order
    writes: tuple     # names of the whole graph's nodes it returns, in order


def parts_for(gm: fx.GraphModule) -> int:
    """How many parts: the knob when set (1: never split), else by size and host cores (a part
    per 4 cores, a child each: the GPU host's 16 cores give up to 4; CI's 2 give 1)."""
    ops = sum(n.op == "call_function" for n in gm.graph.nodes)
    want = int(config.get("inductor_parts"))
    if want > 0:   # (asked for: parts of any size over a few ops)
        return max(1, min(want, ops // 20))
    return max(1, min(4, (os.cpu_count() or 1) // 4, ops // _MIN_OPS_PER_PART))


def spares_for(param_tensors: int) -> int:
    """Compile processes to start at the warm-up, before the graph exists: as many as the parts
    its graph will likely be cut into. GPT-2 124M's step (75 parameter tensors, 2 micro-batches)
    has 3,578 aten ops, ~48 a tensor; a step without micro-batches about half that. At one part
    per ~12 tensors a spare may go unused (killed at exit); one missing cost its start-up (8-13 s
    on an H200 host) after the capture."""
    want = int(config.get("inductor_parts"))
    cap = want if want > 0 else min(4, (os.cpu_count() or 1) // 4)
    return max(1, min(cap, param_tensors // 12))


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _fresh(n: fx.Node) -> bool:
    """``n``'s op returns new memory, not a view or its mutated input. A part compiles its inputs
    as unaliased (fake inputs of their own): a view of a tensor the same part writes would be
    read before the write lands (AOTAutograd applies input mutations at the graph's end)."""
    t, idx = n.target, 0
    if t is operator.getitem and isinstance(n.args[0], fx.Node):
        t, idx = n.args[0].target, n.args[1]
    rets = getattr(getattr(t, "_schema", None), "returns", None)
    if not rets:
        return False
    ret = rets[idx] if len(rets) > 1 and isinstance(idx, int) and idx < len(rets) else rets[0]
    return ret.alias_info is None


def _root(n: fx.Node):
    """The node whose memory ``n`` is (``n`` itself when fresh; through views and in-place ops
    to the tensor they alias; a placeholder when that is a graph input)."""
    for _ in range(1000):
        if n.op != "call_function" or _fresh(n) or not n.args or not isinstance(n.args[0], fx.Node):
            return n
        n = n.args[0]
    return n


def _cuttable(n: fx.Node) -> bool:
    v = _val(n)
    return isinstance(v, torch.Tensor) and v.storage_offset() == 0 and not v.is_sparse


def _written(gm: fx.GraphModule) -> set:
    """The memory (``_root``) some op of the graph writes in place."""
    out = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = n.kwargs.get(a.name, n.args[i] if i < len(n.args) else None)
                for x in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(x, fx.Node):
                        out.add(_root(x))
    return out


class _Crossing:
    """The values live across a position, kept as counts while the position moves down the
    graph (a GPT-2 step: 3,578 ops, hundreds live): may a cut go here? Values live across a cut
    are the next part's inputs: tensors; of memory some op writes, at most one of them, and
    none a graph input's (the part may also take that input)."""

    def __init__(self, written: set):
        self.written, self.roots, self.bad, self.shared = written, {}, 0, 0
        self.bytes = 0

    def _root_of(self, n):
        r = _root(n)
        return r if r in self.written else None

    def add(self, n, sign: int = 1) -> None:
        self.bytes += sign * _bytes(_val(n))
        r = self._root_of(n)
        self.bad += sign * (not _cuttable(n) or (r is not None and r.op != "call_function"))
        if r is not None:
            before = self.roots.get(r, 0)
            self.roots[r] = before + sign
            self.shared += (before + sign > 1) - (before > 1)

    def ok(self) -> bool:
        return self.bad == 0 and self.shared == 0


def _bytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def cuts(gm: fx.GraphModule, k: int) -> list[int]:
    """Positions (indices into the ops in graph order) where a new part starts: near equal sizes,
    at the fewest live bytes within a window around each target, only where the values crossing
    the cut may (``_Crossing``). Fewer than ``k - 1`` where no such position is found."""
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    where = {n: i for i, n in enumerate(ops)}
    last = {}   # op index -> index of its last user among the ops (len(ops): the output)
    for i, n in enumerate(ops):
        users = [where.get(u, len(ops)) for u in n.users]
        last[i] = max(users, default=-1)
    ending: dict[int, list[int]] = {}
    for i, j in last.items():
        ending.setdefault(j, []).append(i)
    crossing = _Crossing(_written(gm))
    live_bytes, bad, live = [], [], set()   # before op i: values defined earlier, used at i or later
    for i in range(len(ops)):
        for d in ending.get(i - 1, []):
            if d in live:
                live.discard(d)
                crossing.add(ops[d], -1)
        live_bytes.append(crossing.bytes)
        bad.append(not crossing.ok())
        if last[i] > i:
            live.add(i)
            crossing.add(ops[i])
    out, width = [], max(1, len(ops) // (4 * k))
    for j in range(1, k):
        target = j * len(ops) // k
        window = [i for i in range(max(1, target - width), min(len(ops), target + width)) if not bad[i]]
        if window:
            out.append(min(window, key=lambda i: (live_bytes[i], abs(i - target))))
    return sorted(set(out))


def split(gm: fx.GraphModule, k: int) -> list[Part] | None:
    """``gm`` cut into at most ``k`` parts (None: no cut found)."""
    positions = cuts(gm, k) if k > 1 else []
    if not positions:
        return None
    nodes = list(gm.graph.nodes)
    ops = [n for n in nodes if n.op not in ("placeholder", "output")]
    output = nodes[-1]
    bounds = [0] + positions + [len(ops)]
    part_of = {n: p for p in range(len(bounds) - 1) for n in ops[bounds[p]:bounds[p + 1]]}
    parts = []
    for p in range(len(bounds) - 1):
        mine = ops[bounds[p]:bounds[p + 1]]
        g, env, reads = fx.Graph(), {}, []

        def arg(x):
            if x not in env:   # defined before this part: an input of it
                ph = g.placeholder(x.name)
                ph.meta = dict(x.meta)
                env[x] = ph
                reads.append(x.name)
            return env[x]
        for n in mine:
            for x in n.all_input_nodes:
                arg(x)
            env[n] = g.node_copy(n, lambda x: env[x])
        writes = [n for n in mine if any(part_of.get(u, p + 1) > p or u is output for u in n.users)]
        g.output(tuple(env[n] for n in writes))
        g.lint()
        parts.append(Part(fx.GraphModule(gm, g), tuple(reads), tuple(n.name for n in writes)))
    return parts


def chain(gm: fx.GraphModule, parts: list[Part], compiled: list):
    """The whole step as one callable over ``gm``'s inputs: the compiled parts called in order."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    plan = [(fn, part.reads, part.writes) for fn, part in zip(compiled, parts)]

    def run(*inputs):
        env = dict(zip(names, inputs))
        for fn, reads, writes in plan:
            env.update(zip(writes, fn(*[env[r] for r in reads])))
        return list(fx.map_arg(output.args[0], lambda n: env[n.name]))
    return run


class PartsCompile:
    """The parts of one step compiling in child processes at once: the job interface of
    ``background.BackgroundCompile`` (done, wait, load, started, ready_s, phases, proc)."""

    def __init__(self, gm: fx.GraphModule, parts: list[Part], inputs: list, patches: dict):
        from .background import BackgroundCompile
        from .progress import progress
        self._gm, self._parts = gm, parts
        vals = {n.name: _val(n) for n in gm.graph.nodes}
        vals.update(zip([n.name for n in gm.graph.nodes if n.op == "placeholder"], inputs))
        self.jobs = [BackgroundCompile(p.gm, [vals[r] for r in p.reads], patches, part=(i, len(parts)))
                     for i, p in enumerate(parts)]
        self.proc = self.jobs[0].proc
        self.started = min(j.started for j in self.jobs)
        self.ready_s, self.phases, self._said = 0.0, {}, False
        cached = sum(bool(j.cached) for j in self.jobs)
        if cached == len(parts):
            progress("stepgraph: the fused step's %d parts are in stepgraph's artifact cache; loading them in "
                     "the background, training continues on the unfused graph", len(parts))
        else:
            progress("stepgraph: compiling the fused step with Inductor in the background, in %d parts side "
                     "by side (pids %s%s); training continues on the unfused graph", len(parts),
                     ", ".join(str(j.proc.pid) for j in self.jobs if not j.cached),
                     f"; {cached} part(s) from stepgraph's artifact cache" if cached else "")

    def done(self) -> bool:
        ok = all(j.done() for j in self.jobs)
        if ok and not self._said:
            from .progress import progress
            self._said = True
            self.ready_s = max(j.ready_s for j in self.jobs) or time.perf_counter() - self.started
            progress("stepgraph: fused step ready after %.1fs (%d parts compiled side by side); it takes "
                     "over at the next call", self.ready_s, len(self.jobs))
        return ok

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.perf_counter() + timeout
        for j in self.jobs:
            if not j.wait(None if end is None else max(0.0, end - time.perf_counter())):
                return False
        return self.done()

    def load(self):
        compiled = [j.load() for j in self.jobs]
        self.done()
        for i, j in enumerate(self.jobs):   # (the slowest part's, and each part's compile)
            for key, v in j.phases.items():
                self.phases[key] = max(self.phases.get(key, 0.0), v)
            self.phases[f"part{i}_compile_s"] = j.phases.get("compile_s", 0.0)
        return chain(self._gm, self._parts, compiled)
