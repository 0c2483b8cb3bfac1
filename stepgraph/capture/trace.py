"""Trace one real call of the step at the aten level with ``make_fx``.

The trace *is* the step: every op runs on the user's real tensors, so the capturing call
returns its real result and leaves state exactly as the eager call would. While tracing,
two modes (modes.py) watch for what cannot be replayed:

* ``_HostReadMode`` (torch-function level) sees Python-visible host reads — ``.item()``,
  ``.tolist()``, ``.numpy()``, ``print(t)``, ``bool(t)`` — on tensors computed by the step,
  and turns ``.item()`` on optimizer step counters into host scalars (hostscalar.py).
* ``_DispatchCheckMode`` (aten level) sees ops whose output shape or value depends on data.
Problems are collected, the trace runs to its end (so state stays eager-equal), and then one
``CaptureError`` names the first problem's op, the user's file:line and the fix.
"""
from __future__ import annotations

import contextlib
import sys
import traceback
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from ..errors import CaptureError, user_frame
from ..optimizers import absorb_floats, counter_branch_fix
from . import argchanges, argtree, attrstores, modstate
from .bindings import binding
from .hostrandom import host_random_watch
from .hostscalar import HyperLog, current, _DataDependentBranch, group_reader, live_hyper, live_source
from .hostreads import ReadLog, math_patches, tolist
from .randomreads import random_guards
from .dynslice import check_unwritten
from .effects import (Problem, _is_traced, _host_read_patches, _opaque_outputs, _register_dataclasses,
                      _RngStateRecorder, discover_stepping_optimizers, record_grad_bindings)
from .compiled import inline_compiled
from .libraries import record_scheduler_steps, torch_fast_paths, tracing_hints
from .libstate import library_effects, state_counter
from .rnns import RnnDecomposition
from .fnbackward import backward_under_modes
from . import nextlr, pycalls, pyeffects
from .rollback import CopyOnWrite, Rollback, saving_writes
from .datarebind import data_assignments
from .schedules import array_conversions
from .sinks import TrackMode, scrub, sinks, sized_calls, unwrap_result
from .trackplan import TrackPlan, names_slot, swap_in
from .groupwrites import live_floats, number_effects, snapshot
from .tracked import UseLog
from .state import Slot, StateRegistry
from .watch import paused_registration_epoch
from .modes import _DispatchCheckMode, _HostReadMode
from .steparrays import is_step_array
from .tohost import to_host_outputs
from .rebound import float_effect, rebind_in_place
from .arrays import as_input, input_array, rebind_array_constants, watch, watching

@dataclass
class TraceResult:
    graph_module: torch.fx.GraphModule
    out_spec: object                     # pytree spec of the user's output
    out_leaves: list                     # per output leaf: ("tensor", k) or ("const", value)
    escapes: list[Slot]                  # slots the graph rebinds, in graph-output order after the user's
    input_grads: list                    # leaf indices whose .grad the graph sets (outputs after escapes)
    host_scalar_ops: tuple               # (op, site) of CPU 0-dim ops in a CUDA step (replay runs them, a CUDA graph cannot)
    rng_state_calls: int                 # host RNG get/set calls recorded (checkpointing); replay backend only
    hooks: list                          # (where, fn) of hooks registered while tracing
    baked_hypers: set                    # live hyper-parameters the step branched on (guard them)
    grad_bindings: list                  # ("bind", param, node) / ("zero", node), in trace order
    state_hooks: list                    # (source, tensor, fn) hooks the step registered on state
    clear_slots: list[tuple[Slot, object]]  # slots rebound to a non-graph value (None or a constant)
    grad_inputs: list                    # (Parameter, source) whose existing .grad is a graph input
    result: object                       # the real result of the traced call
    problems: list[Problem] = field(default_factory=list)
    scheduler_steps: list = field(default_factory=list)  # (scheduler, args, kwargs, _) to call after a replay
    reads: ReadLog | None = None         # host reads: value guards, printed values (hostreads.py)
    uses: UseLog | None = None           # what the step did with tracked numbers (tracked.py)
    track: TrackPlan | None = None       # which numbers were tracked (trackplan.py)
    number_effects: list = field(default_factory=list)  # trackplan.NumberEffect: replayed after each call
    source_inputs: list = field(default_factory=list)   # Sources whose tensor is a graph input (pyeffects.py)
    source_effects: list = field(default_factory=list)  # pyeffects.SourceEffect: written after each replay
    append_effects: list = field(default_factory=list)  # pyeffects.SourceEffect: appended after each replay
    call_effects: list = field(default_factory=list)    # pycalls.CallEffect: called after each replay
    call_notes: list = field(default_factory=list)      # calls that run only at capture (warned)
    read_roots: list = field(default_factory=list)      # (Root("read"), output position): number effects' reads
    array_reads: list = field(default_factory=list)     # leaf positions of input arrays read in Python (arrays.py)
    to_host: frozenset = frozenset()   # user outputs copied to the host after each run (tohost.py)
    fetches: list = field(default_factory=list)   # fetches.SeenNext: batches the step took with next()
    kept_olds: list = field(default_factory=list)  # (Slot, tensor before) of escapes not rebound in place
    held_attrs: list = field(default_factory=list)  # attributes holding a graph constant (attrstores._Synced)
    attr_sets: list = field(default_factory=list)   # modstate.SetEffect: a library module's attributes set
    slot_effects: list = field(default_factory=list)  # SourceEffect to a rebound.SlotTarget: state floats


def _step_counter_ids(reg: StateRegistry) -> set[int]:
    ids = set()
    for _, opt in reg.optimizers:
        for st in opt.state.values():
            s = st.get("step") if isinstance(st, dict) else None
            if isinstance(s, torch.Tensor) and s.numel() == 1 and s.device.type == "cpu":
                ids.add(id(s))
    return ids


@contextlib.contextmanager
def _call_patches(track, reg):
    """torch callables patched while traced: sizes given one by one (sinks.sized_calls), conversions
    of the numpy views the step is handed (schedules.array_conversions), ``t.data = new`` (datarebind.py)."""
    with sized_calls(), array_conversions(track), data_assignments(reg.name_of):
        yield


def trace_step(fn, args, kwargs, reg: StateRegistry, device: str = "cpu", live_hypers=(),
               live_sources=(), host_reads: bool = True, rollback: Rollback | None = None,
               track: TrackPlan | None = None, live_tensors=(), effect_sources=(), append_sources=(),
               append_lens=(), moving_numbers=frozenset(), lift_numbers: bool | None = None,
               call_sources=(), rebound=frozenset(), library_state=(), max_captures: int = 8) -> TraceResult:
    """Run ``fn(*args, **kwargs)`` once under ``make_fx``; return the graph and how to replay it.
    ``rollback`` (rollback.py) is told what the trace writes, to undo it if tracing fails;
    ``track`` (trackplan.py): the Python numbers whose uses are tracked; ``live_tensors``: the
    Sources whose tensors are graph inputs, ``effect_sources``: those whose rebinding is replayed,
    ``append_sources``: lists whose appends are replayed, with their ``append_lens`` before the call
    (pyeffects.py); ``call_sources``: library objects whose statement calls are redone (pycalls.py);
    ``moving_numbers``: labels of tracked numbers whose value check missed before
    (read live into the ops they feed on every device: uselog.UseLog.moving); ``lift_numbers``:
    read every tracked number fed to a tensor op live (default: on the CPU; a backend that runs
    no Python at replay, Inductor's, says no)."""
    leaves, in_spec = argtree.flatten(args, kwargs)
    # (numpy arrays are graph inputs too, the step getting a watching view: arrays.py)
    array_pos = [i for i, x in enumerate(leaves) if input_array(x)]
    tensor_pos = sorted([i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)] + array_pos)
    array_reads: list = []
    slots = reg.slots()
    before = [s.get() for s in slots]
    grad_inputs = [(s.owner, s.source) for s, v in zip(slots, before) if s.kind == "grad" and v is not None]
    problems: list[Problem] = []
    step_ids = _step_counter_ids(reg)
    source_tensors = [s.read(()) for s in live_tensors]
    known = set(reg.names) | {id(leaves[i]) for i in tensor_pos} | {id(t) for t in source_tensors}
    box: dict = {}

    def traced(user_tensors, grad_tensors, source_tensors):
        attrstores.own_state_objects(reg)
        olds = pyeffects.before(effect_sources)
        flat = list(leaves)
        for i, t in zip(tensor_pos, user_tensors):
            flat[i] = t
        for i in array_pos:
            flat[i] = watch(leaves[i], i, array_reads)
        uses = box.setdefault("uses", UseLog(lift_tensor_ops=device == "cpu" if lift_numbers is None else lift_numbers,
                                                   moving_labels=frozenset(moving_numbers)))
        for r in (track.leaves if track else ()):
            flat[r.ref] = uses.wrap(leaves[r.ref], r)  # a proxy that records its uses (tracked.py)
        a, kw = pytree.tree_unflatten(flat, in_spec)
        argw = argchanges.watch((a, kw), (args, kwargs))   # (what the step changes through them)
        swapped: list = []
        groups = snapshot(reg)   # (live hyper-parameters, read at replay, go in below: groupwrites.py)
        saved_hypers = []
        hyper_slots = {(id(reg.optimizers[oi][1].param_groups[gi]), k) for oi, gi, k in live_hypers}
        for src in live_sources:  # Python floats read live (pyvalues.py)
            v = src.read(a)
            if not isinstance(v, float) or names_slot(src, a, hyper_slots):
                continue   # (None now, say: keyed by value for this graph, Guards._py_key)
            at = binding(src, a)   # (where it lives: a class attribute stays on its class)
            if at is None or at.get() is not v:   # (a frozen dataclass, a property: keyed by value)
                box.setdefault("baked", HyperLog()).add(src)
                continue
            live = live_source(get_proxy_mode().tracer, src, v, box.setdefault("baked", HyperLog()))
            saved_hypers.append((src, at, v, live))
            at.set(live)
        for oi, gi, k in live_floats(reg, live_hypers):
            group = reg.optimizers[oi][1].param_groups[gi]
            live = live_hyper(get_proxy_mode().tracer, group, k, (oi, gi, k), box.setdefault("baked", HyperLog()),
                              f"{reg.optimizers[oi][0]}.param_groups[{gi}]['{k}']")
            saved_hypers.append((group, k, group[k], live))
            group[k] = live
        hm = box.setdefault("hm", _HostReadMode(step_ids, problems, reg, ReadLog(uses=uses) if host_reads else None))
        get_proxy_mode().tracer.sg_reads = hm.reads   # (decisions on step counters: hostscalar.guard_decision)
        with discover_stepping_optimizers(reg, hm), _host_read_patches(problems, (lambda t: tolist(t, hm.reads)) if hm.reads is not None else None,
                                                                         hm.step_arrays if hm.reads is not None else None), tracing_hints(_is_traced, device), \
                math_patches(), torch_fast_paths(user_frame), host_random_watch(problems, lambda t: id(t) in known or reg.name_of(t) is not None, box.setdefault("fetches", rollback.taken if rollback else [])), \
                record_scheduler_steps(box.setdefault("sched", []), problems, [], rollback and rollback.keep_object,
                                       box.setdefault("sched_set", [])), \
                hm, box.setdefault("dm", _DispatchCheckMode(problems, device == "cuda", known, hm.reads, list(arrays.values()))), \
                box.setdefault("rng", _RngStateRecorder(device == "cuda", problems)), \
                CopyOnWrite(rollback) if rollback is not None else contextlib.nullcontext(), \
                pycalls.recording(call_sources, box.setdefault("calls", pycalls.CallLog()), get_proxy_mode().tracer,
                                  box["sched"], hm.reads), \
                sinks(uses), _call_patches(track, reg), TrackMode(uses), RnnDecomposition(problems, user_frame, box["dm"].guard_batch_sizes), \
                watching(array_reads) if array_pos else contextlib.nullcontext():
            try:
                swapped = swap_in(track, uses, a) if track else []
                with backward_under_modes(hm.reads.ctxs if hm.reads is not None else None):   # (all modes on)
                    out = fn(*a, **kw)
                absorb_floats(reg)   # (an lr set after the last opt.step: transformer-xl's warm-up)
            except _DataDependentBranch as e:
                # (down to where it was raised: the user's line inside the step, not the call's)
                stack = traceback.extract_stack(e.__traceback__.tb_frame)[:-1] + traceback.extract_tb(e.__traceback__)
                narrow = _narrow_numpy_hyper(reg)
                if narrow is not None:   # (np.float32 / step counter: numpy asks the counter for a float)
                    raise CaptureError(f"{narrow} is a numpy float32 scalar: the optimizer's arithmetic on it is "
                                       "float32, which the graph's host arithmetic cannot repeat", op="numpy.float32 "
                                       "hyper-parameter", where=user_frame(stack), fix="assign float(value) (or "
                                       "build the schedule as float64): eager then computes in float64 too") from None
                raise CaptureError("Python control flow on an optimizer step counter cannot be captured",
                                   op=f"HostFloat.__{e}__", where=user_frame(stack),
                                   fix=counter_branch_fix(reg)) from None
            finally:
                # (the values put back, unless the step assigned new ones: those written after each replay)
                box["number_effects"] = number_effects(swapped, a, track, reg, saved_hypers, box["sched_set"], groups,
                                                         box.setdefault("slot_effects", []))
                argchanges.write_back(argw, rollback.keep_object if rollback is not None else None)
        out = unwrap_result(out, uses)
        uses.guard_stored_reads()
        check_unwritten(uses, problems)   # (a moving slice read as a copy: dynslice.py)
        for where, why in hm.step_arrays.problems(out):   # (L = E.detach().numpy(): steparrays.py)
            problems.append(Problem(f"Tensor.numpy() in the step (the graph cannot follow numpy): {why}", where,
                                    "do the numpy work in the loop: before the call (pass its result in) or "
                                    "after it (return the tensor and convert it there)"))
        box["result"] = out
        _register_dataclasses(out)
        out_leaves, out_spec = pytree.tree_flatten(out)
        opaque = _opaque_outputs(out_leaves)
        if opaque is not None:
            problems.append(Problem(
                f"the step returns a {opaque} that holds tensors it computed, inside an object "
                "stepgraph cannot see into (replays would hand back this call's tensors)",
                user_frame(), "return tensors in tuples/lists/dicts (e.g. `return out.loss`), "
                "or register the type with torch.utils._pytree (register_dataclass / "
                "register_pytree_node); for Hugging Face models with a cache, pass use_cache=False"))
        box["out_spec"] = out_spec
        graph_outs, kinds = [], []
        for i, v in enumerate(out_leaves):
            if i in uses.returned_exprs or i in uses.returned_nodes:   # a number computed from the
                # call's numbers (at replay), or from the step's reads (a graph output): sinks.py
                kinds.append(("number", uses.returned_exprs[i]) if i in uses.returned_exprs else ("read", uses.returned_nodes[i]))
            elif is_step_array(v):          # .numpy() of a graph value: converted after each replay
                kinds.append(("numpy", len(graph_outs)))
                graph_outs.append(v.sg_tensor)
            elif isinstance(v, torch.Tensor):
                kinds.append(("tensor", len(graph_outs)))
                graph_outs.append(v)
            elif nextlr.slot(v) is not None:   # the lr a scheduler stepped here set: read after the replay
                kinds.append(("live", group_reader(*nextlr.slot(v))))
            elif nextlr.derived(v):   # (``lr * 2`` of it: this capture's number, warned)
                kinds.append(("const", float.__float__(v)))
            elif current(v, get_proxy_mode().tracer):  # a read value, lr, lr * 2, ...
                kinds.append(("read", v.node))  # made a graph output below: live at each replay
            else:
                kinds.append(("const", v))
        box["out_leaves"] = kinds
        # (counters on an object passed in: ``train_state.step += 1``, argchanges.replayed)
        from .guards import arg_names
        taken = argchanges.replayed(argw, a, arg_names(fn), graph_outs, box["number_effects"],
                                    track.const_stores if track else frozenset())
        box["effects"] = pyeffects.collect(effect_sources, olds, graph_outs, problems, user_frame(),
                                           box.get("number_effects", ()), track.const_stores if track else (), rebound,
                                           taken)
        argchanges.check(argw, [e.source for e in box["number_effects"] + box["effects"][0] + box["effects"][1] if e.source is not None],
                         a, problems, user_frame(), rollback.keep_container if rollback is not None else None)
        box["effects"][1].extend(library_effects(library_state, get_proxy_mode().tracer, box["number_effects"]))
        if not box["sched"]:   # (a scheduler stepped in the step sets the groups again at replay)
            box["effects"][1].extend(pyeffects.group_reads(reg, get_proxy_mode().tracer))
        box["appends"] = pyeffects.collect_appends(append_sources, append_lens, graph_outs, get_proxy_mode().tracer)
        counted = {(id(e.root.ref[0].owner), e.root.ref[1]) for e in box.get("number_effects", ()) if e.root.kind == "slot"}
        lib_appends, box["attr_sets"] = modstate.collect(graph_outs, get_proxy_mode().tracer, problems, user_frame(), counted)
        box["appends"] += lib_appends   # (torchmetrics' list states: modstate.py)
        box["call_effects"] = pycalls.collect_calls(box["calls"], graph_outs, get_proxy_mode().tracer, reg,
                                                    hm.reads, problems)
        escapes, clears, olds = [], [], []
        box["escape_at"] = len(graph_outs)
        for s, old in zip(slots, before):
            new = s.get()
            if new is old or (id(s.owner), s.key) in counted:   # (a Python step count: written after each replay)
                continue
            if isinstance(new, torch.Tensor) and _is_traced(new):
                escapes.append(s)
                olds.append(old)
                graph_outs.append(new)
            elif (e := float_effect(s, new, get_proxy_mode().tracer)) is not None:
                box.setdefault("slot_effects", []).append(e)
            else:
                counter = state_counter(s, old, new, reg)
                if counter is not None and all(p.where != counter.where for p in problems):
                    problems.append(counter)   # (once per optimizer line, not per parameter)
                clears.append((s, new))
        box["escapes"], box["clears"], box["escape_olds"] = escapes, clears, olds
        input_grads = []
        for i, t in zip(tensor_pos, user_tensors):
            g = t.grad if t.requires_grad and t.is_leaf else None
            if g is not None and _is_traced(g):
                input_grads.append(i)
                graph_outs.append(g)
        box["input_grads"] = input_grads
        return graph_outs

    user_tensors = [as_input(leaves[i]) for i in tensor_pos]
    arrays = {id(user_tensors[tensor_pos.index(i)]): user_tensors[tensor_pos.index(i)] for i in array_pos}
    for i, t in zip(tensor_pos, user_tensors):
        if t.requires_grad and t.is_leaf and t.grad is not None:
            raise CaptureError("an input that requires grad already holds a .grad: the step would "
                               "accumulate into that one tensor on every replay",
                               op=".grad of an input", where=user_frame(),
                               fix="pass inputs whose .grad is None (set x.grad = None before the call)")
    grad_tensors = [p.grad for p, _ in grad_inputs]
    # make_fx constant-folds ops on 1-element untracked tensors by running them a second time,
    # which would double-apply in-place updates such as an optimizer's step-counter increment.
    import torch.fx.experimental.proxy_tensor as _pt
    saved_limit, _pt.CONSTANT_NUMEL_LIMIT = _pt.CONSTANT_NUMEL_LIMIT, 0
    try:
        with paused_registration_epoch(), record_grad_bindings(reg, box.setdefault("bindings", [])), \
                _one_fake_mode(), inline_compiled(), saving_writes(rollback), modstate.logging_sets():
            gm = make_fx(traced, tracing_mode="real", _allow_non_fake_inputs=True)(user_tensors, grad_tensors,
                                                                                    source_tensors)
    finally:
        _pt.CONSTANT_NUMEL_LIMIT = saved_limit
        if "uses" in box:
            scrub(box["uses"])  # no proxy stays in the user's objects
    box["dm"].constants.unfilled.bake(gm)   # (CTCLoss's lengths, memcpy'd behind the dispatcher: unfilled.py)
    if array_pos:   # (the constants over their memory: those inputs)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        odd = rebind_array_constants(gm, {phs[tensor_pos.index(i)]: user_tensors[tensor_pos.index(i)]
                                          for i in array_pos})
        array_reads += [(tensor_pos[phs.index(ph)], "a view of another dtype") for ph in odd]
    with saving_writes(rollback):   # (a buffer the step rebinds: copied into its old one, rebound.py)
        box["escapes"], kept_olds = rebind_in_place(gm, box["escapes"], box["escape_olds"], box["escape_at"],
                                                    before + [p for _, p in reg.params])
    box["out_leaves"] = _output_reads(gm, box["out_leaves"])
    tensor_effects, read_effects = box.get("effects", ([], []))
    appends = box.get("appends", [])
    calls, call_notes = box.get("call_effects", ([], []))
    pyeffects.place_reads(gm, read_effects + [e for e in appends if e.kind == "read"] + pycalls.reads_of(calls)
                          + box.get("slot_effects", []))
    read_roots = pyeffects.place_read_roots(gm, box.get("number_effects", []))
    to_host, refused = to_host_outputs(gm, box["hm"].to_host, box["escape_at"])   # (return x.cpu())
    problems += refused + random_guards(gm, max_captures) + nextlr.used(gm)
    return TraceResult(gm, box["out_spec"], box["out_leaves"], box["escapes"], box["input_grads"],
                       box["dm"].host_scalar_ops, box["rng"].count, box["hm"].hooks, box.get("baked", HyperLog()), box["bindings"], box["hm"].state_hooks, box["clears"], grad_inputs,
                       box.pop("result"), problems, box.get("sched", []), box["hm"].reads, box["uses"], track,
                       number_effects=box.get("number_effects", []), source_inputs=list(live_tensors),
                       source_effects=tensor_effects + read_effects, read_roots=read_roots,
                       append_effects=appends, call_effects=calls, call_notes=call_notes,
                       array_reads=sorted({i for i, _ in array_reads}), to_host=to_host, fetches=box["fetches"],
                       kept_olds=kept_olds, slot_effects=box.get("slot_effects", []), held_attrs=attrstores.take_held(),
                       attr_sets=box.get("attr_sets", []))


def _output_reads(gm, out_leaves: list) -> list:
    """Returned values read from tensors become extra graph outputs (after all others)."""
    reads = [node for kind, node in out_leaves if kind == "read"]
    if not reads:
        return out_leaves
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    first = len(outs)
    out.args = (outs + reads,)
    gm.recompile()
    pos = iter(range(first, first + len(reads)))
    return [("read", next(pos)) if kind == "read" else (kind, v) for kind, v in out_leaves]


def _one_fake_mode():
    """make_fx in real mode records each op's output metadata through a fake tensor, building a
    new FakeTensorMode per value when none is active -- and each one captures a Python stack
    trace: about half of a capture's time (GPT-2L on CPU: 0.55 of 1.15 s). One mode, made
    visible the way make_fx looks for it (the tracing context), serves every value."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    if TracingContext.try_get() is not None:
        return contextlib.nullcontext()
    return tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True)))


def raise_problems(problems: list[Problem]) -> None:
    if not problems:
        return
    p = problems[0]
    others = list({(q.op, q.where): q for q in problems[1:] if (q.op, q.where) != (p.op, p.where)}.values())
    more = f"\n  ({len(others)} more: " + "; ".join(
        f"{_clip(q.op)} at {q.where}" for q in others[:3]) + ")" if others else ""
    raise CaptureError(p.message() + more + "\n  this call ran eagerly to its end: your model and "
                       "optimizer hold the result of this step", op=p.op, where=p.where, fix=p.fix)


def _clip(text: str, n: int = 100) -> str:
    """``text`` cut at a word boundary near ``n`` characters."""
    return text if len(text) <= n else text[:n].rsplit(" ", 1)[0] + " ..."


def _narrow_numpy_hyper(reg) -> str | None:
    """The first param-group value that is a numpy float narrower than float64 (a float32 lr)."""
    from .schedules import narrow_float
    np = sys.modules.get("numpy")
    if np is None:
        return None
    for name, opt in reg.optimizers:
        for gi, g in enumerate(opt.param_groups):
            for k, v in g.items():
                if isinstance(v, np.floating) and narrow_float(v.dtype):
                    return f"{name}.param_groups[{gi}]['{k}']"
    return None
