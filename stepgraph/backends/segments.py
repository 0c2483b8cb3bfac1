"""CUDA-graph segments: a step that reads values on the host, as CUDA graphs between the reads.

A host read (``loss.item()``, ``if torch.isfinite(loss):``, a mask checked on the host) needs
the value of a tensor computed earlier in the same step. One CUDA graph cannot stop midway,
so the graph is cut at each read: the device ops between two reads become one recorded
**segment** (replayed with one launch, all segments in one memory pool, replayed in the order
they were recorded), and the read and what Python does with it (the value guard, a read
returned for logging) run on the host between them:

    segment 0 (CUDA graph)  ->  host: read, guard  ->  segment 1 (CUDA graph)  ->  host: read

Each read costs one sync, which eager pays too. A read whose only use is to be returned
(``return loss.item()``) is taken after the last segment, so it cuts nothing; so is
a read only Python uses (``meter.sum += loss.item()``), and a live read of the user's number.
An op whose output shape depends on tensor values (``nonzero``, ``x[mask]``, ``unique``) ends a
segment: it runs on the host as in eager, its shape is guarded, and its output is copied into a
static buffer the next segment reads (backends/hostops.py says why). Each sync is timed (``syncs``).

What a segment takes from the host must be fixed while it is recorded: a value a guard checks
(the graph holds for that value only) or a live float fed as a device tensor
(passes/device_scalars.py). A read feeding a device op directly, unguarded, is refused:
``NeedsReplay`` (backend ``auto`` then runs the graph with the ``replay`` backend).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from ..markers import host_guard
from ..errors import NeedsReplay
from ..passes.analysis import collective_nodes
from . import CompileRequest
from .hostops import (READ as _READ, is_shape_read, materialiser, needs_host, shape_from_data, static_like,
                      sync_point, timed, writes_first_arg)
from .cudagraph import capture_graph, moved_state_check, persistent_copies, share_pool
from .refusals import drop_idle_rng_state_calls, check_graph, refuse_uncapturable
from .replay import generate
from .runner import Runner

def _stays_put(n: fx.Node) -> bool:
    """A guard, or the RNG snapshot a guard restores: host work tied to its place in the step."""
    return n.target is host_guard or getattr(n.target, "__name__", "") == "generator_state"


def _takes_host_number(n: fx.Node, host: set, fixed: dict) -> bool:
    """A device op taking a number computed on the host at each call (``meter.sum / meter.count``
    with ``count`` read live, capture/uselog.py): a recording would bake it, so it runs on the
    host, eager's own kernel with the Python scalar (bitwise: on CUDA a CPU-scalar divisor is a
    multiply by its reciprocal, which no tensor form reproduces). A guarded value (``fixed``) is
    what the segments are recorded for: those ops stay in them."""
    return isinstance(n.target, torch._ops.OpOverload) and any(
        a in host and a not in fixed and not isinstance(a.meta.get("val"), torch.Tensor)
        for a in n.all_input_nodes)


def _host_nodes(gm: fx.GraphModule) -> set:
    """Host reads, the guards and the RNG snapshot they use, the ops that sync to allocate
    (hostops.needs_host) with their shape reads, and every Python function: what computes on
    read values, and the live reads of the user's numbers (capture/uselog.py's ``read_*``:
    ``train_loss += loss.item()`` reads ``train_loss`` at each replay). Those once counted as
    device work when no host node fed them, so a segment's recording froze them: the
    write-back kept adding to the first value (4.63 where eager had 6.14, H100)."""
    host: set = set()
    fixed = _fixed_values(gm)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if t is _READ or _stays_put(n) \
                or is_shape_read(n) or needs_host(n) or _takes_host_number(n, host, fixed):
            host.add(n)
        elif isinstance(t, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            continue
        elif t is operator.getitem and not any(a in host for a in n.all_input_nodes):
            continue  # an element of a device op's tuple output
        else:
            host.add(n)
    return host


def _fixed_values(gm: fx.GraphModule) -> dict:
    """Host nodes whose value the graph is specialised on: the guarded ones (value = the traced
    value each guard checks)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is host_guard and isinstance(n.args[0], fx.Node):
            out[n.args[0]] = n.args[1]
    return out


def has_host_reads(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is _READ for n in gm.graph.nodes)


@dataclass
class Segment:
    """One recorded run of device ops."""
    module: fx.GraphModule
    inputs: list                 # nodes of the step graph feeding it
    outputs: list                # nodes of the step graph it defines and later nodes use
    graph: object = None         # torch.cuda.CUDAGraph once recorded
    static_outputs: list = field(default_factory=list)  # what its replays write, at fixed addresses
    materialise: list = field(default_factory=list)  # (host op node, its static buffer) it reads


def _place_host_nodes(gm: fx.GraphModule, host: set) -> None:
    """Host work no device op waits for goes after the last segment (``return loss.item()``,
    ``meter.sum += loss.item() * n``: one sync at the end instead of a cut mid-step), and a
    live read of a Python number, which needs nothing, before the first: neither cuts the
    step. Guards stay where they are: the segments after one are recorded for its value."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1:]  # hoisted after it, in order
    late: set = set()
    for n in reversed(list(gm.graph.nodes)):
        if n in host and not _stays_put(n) \
                and all(u is out or u in late for u in n.users):
            late.add(n)
    for n in list(gm.graph.nodes):
        if n in late:
            out.prepend(n)
        elif n in host and not n.all_input_nodes and n.target is not _READ and anchor:
            anchor[0].append(n)
            anchor[0] = n


def _getitems_beside_their_op(gm: fx.GraphModule, host: set) -> None:
    """Each element taken from a device op's tuple (``nll_loss_forward``'s total weight, used
    only by the backward) right after the op: segments then pass tensors, never a tuple, which
    Inductor cannot take as a segment's input or output ("output spec mismatch")."""
    last: dict = {}
    for n in list(gm.graph.nodes):
        src = n.args[0] if n.op == "call_function" and n.target is operator.getitem and n.args else None
        if isinstance(src, fx.Node) and src not in host and src.op == "call_function":
            last.get(src, src).append(n)
            last[src] = n


def split(gm: fx.GraphModule) -> tuple[list, set]:
    """The graph's nodes in order, runs of device nodes grouped into :class:`Segment` s."""
    host = _host_nodes(gm)
    _place_host_nodes(gm, host)
    _getitems_beside_their_op(gm, host)
    items: list = []
    run: list = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n in host:
            if run:
                items.append(run)
                run = []
            items.append(n)
        elif n.op == "get_attr":
            continue  # state: read by address in whichever segment uses it
        else:
            run.append(n)
    if run:
        items.append(run)
    return items, host


def _segment_module(gm: fx.GraphModule, nodes: list) -> Segment:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                if a not in inside and a.op != "get_attr"))
    g = fx.Graph()
    env: dict = {x: g.placeholder(f"in_{i}") for i, x in enumerate(inputs)}

    def arg(x):
        if x not in env:  # state: a get_attr of the step graph's module
            env[x] = g.get_attr(x.target)
        return env[x]

    for n in nodes:
        env[n] = g.node_copy(n, arg)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    g.output([env[n] for n in outputs])
    return Segment(fx.GraphModule(gm, g), inputs, outputs)


# (a module global, so the CPU tests can emulate the recording: tests/test_segments_cpu.py)
_record = capture_graph


def replay_segment_fn(module: fx.GraphModule, args: list):
    """A segment as the replay backend's generated Python (what the cudagraph backend records)."""
    return generate(module, "segment")[1]


def compile_segmented(gm: fx.GraphModule, example_inputs, request: CompileRequest,
                      segment_fn=replay_segment_fn, record=None):
    """The step as CUDA-graph segments between its host reads; the per-call runner.

    ``segment_fn(module, args)`` makes each segment's callable (Inductor's fused code for the
    ``inductor`` backend); ``record(fn, args, pool, outputs)`` returns ``(graph, static_outputs)``
    where ``graph.replay()`` runs the segment into those outputs (default: a CUDA graph)."""
    host_scalar_ops, rng_state_calls = request.host_scalar_ops, request.rng_state_calls
    problems: list = []
    check_graph(gm, problems, example_inputs)
    if "sparse" in problems:   # (a data-dependent shape runs on the host between segments)
        refuse_uncapturable(gm, inputs=example_inputs)  # (raises its NeedsReplay)
    if host_scalar_ops:  # (an optimizer's host step counter: no capturable form)
        refuse_uncapturable(fx.GraphModule(gm, fx.Graph()), host_scalar_ops)
    if rng_state_calls and not drop_idle_rng_state_calls(gm):
        raise NeedsReplay("the step saves and restores the RNG state on the host", op="torch.get_rng_state",
                          where="torch.utils.checkpoint / torch.random.fork_rng", fix="use backend='replay'")
    collectives = sorted({str(n.target) for n in collective_nodes(gm)})
    if collectives:
        # One CUDA graph with NCCL collectives is bitwise (test_cuda_collectives, FSDP2, DDP);
        # cut into segments by host reads it was not: MoCo v2 (0.29) and DINO (2.6e-2) grads
        # left eager's on the H200 (NCCL, world of one). Until that is understood, replay.
        raise NeedsReplay(
            f"the step calls collectives ({', '.join(collectives)}) and reads values on the host, "
            "which cut its CUDA graph into segments: such segments are not recorded yet",
            op=collectives[0], where="the step", fix="use backend='replay' (backend='auto' does so), "
            "or keep the host reads out of the step (a tensor condition with torch.where)")
    items, host = split(gm)
    gm.graph.lint()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = [_static_input(x, n) for x, n in zip(example_inputs, placeholders)]
    segments = [_segment_module(gm, it) for it in items if isinstance(it, list)]
    _record_in_order(gm, items, segments, dict(zip(placeholders, static)), request.pool, segment_fn, record)
    program, syncs = _per_call_program(gm, items, segments, placeholders)
    runner = SegmentedRunner(program, static, segments, set(request.inputs_written), request.n_user_outputs,
                             request.clone_outputs, moved_state_check(request.state_tensors), syncs)
    runner.shared = share_pool(request)
    return runner


def _static_input(x, node: fx.Node) -> torch.Tensor:
    """The static buffer of one input, holding ``x``. Where the value there now is no tensor --
    a variable the step rebinds after reading it (the Annotated Transformer's ``tokens = 0`` at its
    logging call: an int once the call ended) -- it is made from the trace's own tensor, zeroed:
    each call fills it before the segments run."""
    like = x if isinstance(x, torch.Tensor) else node.meta.get("val")
    if not isinstance(like, torch.Tensor):
        raise TypeError(f"input {node.name} of a segmented graph is no tensor ({type(x).__name__})")
    buf = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
    return buf.copy_(x) if like is x else buf.zero_()


def _record_in_order(gm: fx.GraphModule, items: list, segments: list, env: dict, pool, segment_fn,
                     record) -> None:
    """Record each segment; what it takes from the host must be fixed now: a guarded value, or
    a host op's output (a static buffer, filled at each call once its shape guard held)."""
    fixed = _fixed_values(gm)
    guarded: set = set()    # nodes whose shape a guard has checked by this point
    seg_iter = iter(segments)
    for it in items:
        if not isinstance(it, list):
            if it.target is host_guard and isinstance(it.args[0], fx.Node) and is_shape_read(it.args[0]):
                guarded.add(it.args[0].args[0])
            elif needs_host(it) and writes_first_arg(it):   # in place: its output is its argument's
                a = it.args[0]
                if a in env or a.op == "get_attr":
                    env[it] = env[a] if a in env else getattr(gm, a.target)
            continue
        seg = next(seg_iter)
        args = []
        for x in seg.inputs:
            if x not in env and x not in fixed and isinstance(x.meta.get("val"), torch.Tensor):
                if shape_from_data(x) and x not in guarded:
                    raise NeedsReplay(f"{x.name}'s shape depends on tensor values and no guard checks it "
                                      "before a CUDA graph segment reads it", op=str(x.target),
                                      where="the step", fix="use backend='replay' (backend='auto' does so)")
                env[x] = static_like(x.meta["val"])
                seg.materialise.append((x, env[x]))
            if x in env:
                args.append(env[x])
            elif x in fixed:
                args.append(fixed[x])
            else:
                raise NeedsReplay(
                    f"a value read on the host ({x.name}) feeds a device op without a guard: a CUDA "
                    "graph segment would bake it", op="host read", where="the step",
                    fix="use backend='replay' (backend='auto' does so)")
        fn = segment_fn(seg.module, args)
        if record is None:
            seg.graph, seg.static_outputs = _record(fn, args, pool)
        else:
            seg.graph, seg.static_outputs = record(fn, args, pool, seg.outputs)
        env.update(zip(seg.outputs, seg.static_outputs))


def _per_call_program(gm: fx.GraphModule, items: list, segments: list, placeholders: list):
    """Host nodes as they are (each sync timed), each segment a replay of its graph after its
    host inputs are copied into their buffers; (program, sync points in order)."""
    top = fx.Graph()
    tenv: dict = {p: top.placeholder(p.name) for p in placeholders}

    def val(x):
        return tenv[x] if x in tenv else _attr(top, gm, x, tenv)
    syncs: list = []
    seg_iter = iter(segments)
    k = -1
    for it in items:
        if isinstance(it, list):
            seg = next(seg_iter)
            k += 1
            for x, buf in seg.materialise:
                tenv[x] = top.call_function(materialiser(buf, x.name), (tenv[x],))
            call = top.call_function(_replayer(seg), ())
            for i, o in enumerate(seg.outputs):
                tenv[o] = top.call_function(operator.getitem, (call, i))
        else:
            tenv[it] = top.node_copy(it, val)
            point = sync_point(it, k)
            if point is not None:
                syncs.append(point)
                tenv[it].target = timed(it.target, point)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    top.output(fx.node.map_arg(out.args[0], val))
    _, program = generate(fx.GraphModule(gm, top), "segmented_step")
    return program, syncs


class SegmentedRunner(Runner):
    """The per-call program: host nodes run in Python, each segment replays its CUDA graph."""
    extras = ("static_inputs", "syncs", "segment_kind", "shared")
    segment_kind = "CUDA graph segments: {n} (one launch each, one memory pool)"   # (explain)
    shared: list = []   # cudagraph.share_pool

    def __init__(self, program, static, segments, written, n_user, clone_outputs, moved, syncs=()):
        self._program, self.static_inputs, self.segments = program, static, segments
        self.syncs = list(syncs)   # hostops.SyncPoint: each host wait, timed at every replay
        self._written, self._n_user, self._clone, self._moved = written, n_user, clone_outputs, moved

    def __call__(self, inputs):
        static = self.static_inputs
        copied = []
        for i, x in enumerate(inputs):
            if x.data_ptr() != static[i].data_ptr():
                static[i].copy_(x)
                copied.append(i)
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            outs = list(self._program(*static))
        finally:
            torch._C._set_grad_enabled(prev)
        for i in copied:
            if i in self._written:
                inputs[i].copy_(static[i])
        k = len(outs) if self._n_user is None else self._n_user
        if self._clone:
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in outs[:k]] + persistent_copies(outs, k, self.shared)
        return outs

    def stale(self) -> str | None:
        return self._moved()


def _attr(top: fx.Graph, gm: fx.GraphModule, x: fx.Node, tenv: dict):
    if x.op != "get_attr":
        raise KeyError(x)
    tenv[x] = top.get_attr(x.target)
    return tenv[x]


def _replayer(seg: Segment):
    graph, outs = seg.graph, tuple(seg.static_outputs)

    def replay_segment():
        fresh = graph.replay()   # (a CUDA graph returns None: its outputs are the static ones)
        return outs if fresh is None else fresh
    replay_segment.__name__ = "replay_segment"
    return replay_segment
