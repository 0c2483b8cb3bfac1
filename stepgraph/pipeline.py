"""The capture pipeline: one call of the step becomes a :class:`CapturedStep`, in named stages.

    plan -> adapt_optimizers -> trace -> clean -> lower -> keep

``plan`` picks the device and backend and says why this call captures; ``adapt_optimizers``
runs the backend's ``prepare`` (capturable optimizers) and the live-float choices, then signs
the call once as the state now is; ``trace`` runs the step for real under make_fx (a trace that
stops midway is undone and the call runs eagerly); ``clean`` checks what the trace saw and runs
the graph passes, giving a :class:`Traced`; ``lower`` hands it to the backend as a
:class:`~stepgraph.backends.CompileRequest` (``auto`` falls back to ``replay`` on NeedsReplay);
``keep`` files the :class:`CapturedStep` and counts it.

Any exception from ``trace`` on goes to ``failures.capture_failed``: the call still ends as
eager would. ``plan`` and ``adapt_optimizers`` raise as they are (a DDP rank that aborted).
Warnings raised by helpers of the stages name the user's line: their stacklevels count
helper -> stage -> capture -> StepFunction.__call__ -> user.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings

import torch

from . import backends, config
from .backends import CompileRequest
from .backends.cudagraph import capture_stream
from .backends.refusals import refuse_collectives_with_reads, refuse_uncapturable
from .captured import STATE_WARMUPS, CapturedStep, log_recapture, optimizer_states, plain_floats, warmed_up
from .capture import collectives, datacalls, distributed, fetches, fsdp
from .capture.arrays import as_input, input_array
from .capture.compiled import note_compiled_parts
from .capture.guards import Signature
from .capture.hooks import hooks_left_registered, registered_hooks, replayed_targets, warn_side_effects
from .capture.hostrandom import generator_draws, generator_states, refuse_draw_checks
from .capture.libraries import untraceable_modules
from .capture.reasons import nearest_key
from .capture.numchecks import set_call
from .capture.rebound import list_tensors, object_tensors, stale_read_checks
from .capture.attrstores import attribute_checks
from .capture.guards import cpu_generator
from .livefloats import reason_after_trace
from .capture.pycalls import call_sources, tensors_of, warn_notes
from .capture import argtree
from .capture.pyeffects import append_sources, effect_sources, lengths, tensor_sources, truncate
from .capture.rollback import snapshot
from .capture.libstate import library_scalars, refuse_library_changes
from .capture.outputs import (container_slots, hidden_changed, hidden_containers, kept_reads, live_outputs, read_side_effects,
                              refuse_hidden_changes, refuse_host_python, refuse_python_side_effects, refuse_slot_stores, warn_appends)
from .capture.floatleaks import plain_after
from .capture.pybefore import filled_defaults, overwritten, py_before_call
from .capture.rollback import Rollback
from .capture.state import StateRegistry
from .capture.trace import raise_problems, trace_step
from .errors import NeedsReplay
from .failures import after_failed_trace, capture_failed
from .passes import cleanup, summarize
from .passes.cleanup import resolve_bindings
from .passes.guards import place_guards
from .passes.host_prologue import split_prologue
from .passes.moved_arguments import constants_to_device, move_arrays, moved_arguments
from .passes.device_scalars import is_number_reader, numbers_to_feed
from .passes.unsharded import storages_to_temporaries

from .stages import Lowered, Plan, Traced, _Done

log = logging.getLogger("stepgraph")


def capture(step, sig: Signature, args, kwargs, reason=None, sibling_of=None):
    """Capture this call; returns its real result (eager's, if the capture failed). No live
    float of the trace stays in the user's objects after it (floatleaks.plain_after)."""
    with plain_after():
        plan = plan_capture(step, sig, args, kwargs, reason)
        adapt_optimizers(step, plan, args, kwargs)
        done = _Done()
        states = optimizer_states(step._reg)
        try:
            traced = trace(step, plan, args, kwargs, done)
            if optimizer_states(step._reg) > states and step.stats.new_state_warmups < STATE_WARMUPS:
                return warmed_up(step, traced.trace.result)
            filled = filled_defaults(traced.before, step._guards.filled)
            if filled:
                return warmed_up(step, traced.trace.result, filled)
            new = traced.trace.fetches and not hidden_changed(traced.hidden_before, traced.trace, args) \
                and fetches.replan(step._fetch, step._replans, traced.trace.fetches, step._guards.py.sources, args)
            if new:   # (next(loader), host random draws in the step: fetches.py)
                step._replans, step._fetch = step._replans + (step._fetch is not None), new
                return warmed_up(step, traced.trace.result, "it takes its own inputs (next(), host random draws): "
                                 "from the next call on they are taken before the step and fed in")
            clean(step, plan, traced, args)
            lowered = lower(step, plan, traced, args)
        except BaseException as e:
            step.stats.failed_captures += 1
            return capture_failed(step, e, done.result)   # (the user's own exceptions propagate: failures.py)
        return keep(step, plan, traced, lowered, args, kwargs, sibling_of)


def plan_capture(step, sig: Signature, args, kwargs, reason) -> Plan:
    if reason is None and step._order:
        reason = step._guards.diff(nearest_key([e.key for e in step._order], sig.key), sig.key, args, kwargs)
    device = _device_of(sig.leaves, step._reg)
    return Plan(sig, device, backends.pick(step.backend, device), reason)


def adapt_optimizers(step, plan: Plan, args, kwargs) -> None:
    """Live floats and the backend's optimizer forms, then one signature of the state as it
    now is (each of these may change what the key must say)."""
    live, guards, backend = step._live, step._guards, plan.backend
    plan.reason, resign = live.before_prepare(backend.name, plan.device, args, plan.reason,
                                              step._order[-1].key if step._order else None, plan.sig.key)
    resign |= guards.pin_objects(args)
    plan.started = time.perf_counter()
    before = _registry_shape(step._reg)
    step._reg.refresh_names()
    # (a parameter pruning, weight_norm or register_parametrization put in since the key was
    # built: the graph was filed under the old key, and the next call captured once more)
    resign |= _registry_shape(step._reg) != before
    step._agree(step._reg, plan.sig.leaves, step._calls, "capture", plan.reason)  # ranks meet (DDP steps only)
    # Refused before prepare: a refused call runs eagerly with the user's optimizer form.
    plan.refusal = (fsdp.refusal(step._reg, plan.device, backend.name)
                    or untraceable_modules(step._reg, plan.device))
    if backend.prepare is not None and plan.refusal is None:
        changed = backend.prepare(step._reg)
        if changed:
            step._prepared += changed
            log.info("stepgraph: %s: %s", step.__name__, "; ".join(changed))
            resign = True
    plan.reason, resign_after = live.after_prepare(backend.name, args, plan.reason)
    if resign or resign_after:
        plan.sig = guards.signature(args, kwargs)


def _registry_shape(reg) -> tuple:
    return tuple(id(p) for _, p in reg.params), reg.module_ids


def trace(step, plan: Plan, args, kwargs, done: _Done) -> Traced:
    """Run the step once, for real, under make_fx; a trace that stops midway is undone and the
    call runs eagerly from its start (``done``)."""
    reg, guards = step._reg, step._guards
    if plan.refusal is not None:
        done.result = (step._eager(args, kwargs),)  # this call runs as eager would, then the error
        raise plan.refusal
    backend = plan.backend
    around = backend.trace_context(reg) if backend.trace_context else contextlib.nullcontext()
    rollback = Rollback.take(reg, plan.sig.leaves)   # what the trace writes, to undo if it fails
    rollback.keep_sources(guards.py, args)
    live_tensors = tensor_sources(guards, args)
    effects_at = effect_sources(guards, args)
    restore_vars = snapshot(live_tensors + effects_at)   # (loop variables: pyeffects.py)
    appends_at = append_sources(guards, args)
    append_lens = lengths(appends_at)   # (before the call: what a replay appends after)
    restore_lists = truncate(appends_at, append_lens)
    calls_at = call_sources(guards, args)
    try:
        with capture_stream(plan.device), around, distributed.tracing(reg) as ddp_records, \
                fsdp.tracing(reg, rollback) as fsdp_record, collectives.remapped(reg), \
                datacalls.tracing(step.fn, args, kwargs):
            live = guards.live
            track = guards.tracking(args, kwargs)   # numbers checked only where used
            py_before = guards.py.key(args)
            frozen = guards.frozen_key(args, kwargs)
            traced = Traced(trace=None, frozen=frozen, ddp_records=ddp_records, fsdp_record=fsdp_record,
                            py_before=py_before,
                            sizes_before=container_slots(guards.py, args), hidden_before=hidden_containers(guards.py, args),
                            generators=generator_states(guards.py, args),
                            library_state=library_scalars(guards.py, args, redone=calls_at),
                            training_before=[(m, m.training) for m in reg.all_modules],
                            before=py_before_call(guards.py, args))
            traced.trace = trace_step(fetches.calling(step.fn, step._fetch, step.__name__), args, kwargs, reg, plan.device,
                                      live_hypers=sorted(h for h in live if isinstance(h, tuple)),
                                      live_sources=[h for h in live if not isinstance(h, tuple)],
                                      host_reads=step.host_reads == "guard", rollback=rollback, track=track,
                                      live_tensors=live_tensors, effect_sources=effects_at,
                                      append_sources=appends_at, append_lens=append_lens,
                                      moving_numbers=step._moving_numbers | fetches.draw_labels(step._fetch), call_sources=calls_at, rebound=guards.rebound,
                                      library_state=traced.library_state, max_captures=step.max_captures,
                                      lift_numbers=plan.device == "cpu" and (plan.backend.runs_host_reads
                                                                             or plan.backend.segmented is not None))
            refuse_collectives_with_reads(reg, plan.device, traced.trace)
    except BaseException as e:
        back, kw = fetches.given_back(rollback.taken, kwargs)   # (batches the trace took: the rerun's)
        done.result = after_failed_trace(e, rollback, lambda: (restore_vars(), restore_lists(), step._eager(args, kw, back))[2])
        raise
    finally:
        rollback = None   # its copies of the state: not kept past the trace
    done.result = (traced.trace.result,)
    return traced


def clean(step, plan: Plan, traced: Traced, args) -> None:
    """Refuse what a replay could not repeat, re-key on what the step branched on, and run the
    graph passes (cleanup, number checks, host-read guards, grad bindings, summary)."""
    tr, guards, reg = traced.trace, step._guards, step._reg
    raise_problems(tr.problems + generator_draws(traced.generators))
    refuse_hidden_changes(traced.hidden_before, tr, args, step.fn)
    refuse_library_changes(traced.library_state, redone=[e.source for e in tr.call_effects],
                           replayed=[e.source for e in tr.number_effects + tr.source_effects if e.source is not None])
    if traced.fsdp_record is not None:
        traced.fsdp_record.raise_problems()
    refuse_python_side_effects(guards.py, traced.py_before, guards.py.key(args),
                               scheduled=bool(tr.scheduler_steps),
                               replayed=[e.source for e in tr.number_effects + tr.source_effects if e.source is not None],
                               slots=tr.escapes, args=args, held=traced.before.tensors)
    plan.sig = guards.overwritten_after(plan.sig, args, overwritten(guards.py, tr, traced.before, args), traced.before)
    slots_after = container_slots(guards.py, args)
    refuse_slot_stores(guards.py, traced.sizes_before, slots_after, args,
                       covered=[e.source for e in tr.number_effects + tr.source_effects if e.source is not None])
    traced.notes = warn_appends(guards.py, traced.sizes_before, slots_after, step.__name__,
                                replayed={id(e.source) for e in tr.append_effects})
    live_outputs(tr, reg, guards.py, args, step.__name__)
    traced.notes += read_side_effects(tr, step.__name__) + warn_notes(tr.call_notes, step.__name__)
    collectives.refuse_direct_collectives(tr.graph_module)
    plan.sig = step._live.after_trace(tr, plan.sig, traced.frozen, step._entries)
    plan.reason = reason_after_trace(plan.reason, tr)
    if tr.array_reads:   # (numpy arrays the step read in Python: keyed by value, arrays.py)
        plan.sig = guards.arrays_were_read(tr.array_reads, plan.sig)
    gm = traced.graph = tr.graph_module = cleanup(tr.graph_module)
    if reg.fsdp and config.get("fsdp2_temporaries"):
        storages_to_temporaries(gm)   # FSDP2's freed storages as graph temporaries: no resizes left
    traced.checks = tr.uses.checks(gm) + stale_read_checks(gm, tr.kept_olds + object_tensors(reg) + list_tensors(reg)) \
        + attribute_checks(gm, tr.held_attrs)   # (after DCE)
    refuse_draw_checks(step.fetches, traced.checks, step.max_captures)   # (drawn numbers: fetches.py)
    traced.guard_plan = place_guards(gm, plan.device, reg.name_of)
    traced.bindings = resolve_bindings(gm, tr.grad_bindings, plan.backend.name == "replay")
    traced.summary = summarize(gm, reg.name_of)
    # (tensors the step binds to loop variables are cloned like its results: pyeffects.py)
    traced.n_user = sum(1 for kind, _ in tr.out_leaves if kind in ("tensor", "numpy")) \
        + sum(e.n for e in tr.source_effects + tr.append_effects if e.kind in ("tensor", "tensors")) + tensors_of(tr.call_effects)


def lower(step, plan: Plan, traced: Traced, args=()) -> Lowered:
    """The backend's runner for the cleaned graph; ``auto`` falls back to ``replay``, warned."""
    tr, gm, backend, device = traced.trace, traced.graph, plan.backend, plan.device
    # A persistent grad the step itself sets to None (zero_grad at an accumulation boundary) is an
    # input whose tensor is gone by now: its static buffer is shaped after the parameter (hf_gpt2
    # on an H100: AttributeError in record).
    example = [as_input(plan.sig.leaves[i]) for i in plan.sig.tensor_pos] \
        + [p.grad if p.grad is not None else torch.zeros_like(p) for p, _ in tr.grad_inputs] \
        + [s.read(()) for s in tr.source_inputs]
    if device == "cuda" and step._pool is None:
        step._pool, step._pool_graphs = torch.cuda.graph_pool_handle(), []
    consts = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"
              and isinstance(getattr(gm, n.target), torch.Tensor)]
    request = CompileRequest(
        pool=step._pool, pool_graphs=step._pool_graphs, inputs_written=tuple(traced.summary.inputs_written), clone_outputs=step.clone_outputs,
        n_user_outputs=traced.n_user, state_tensors=tuple({id(t): t for t in consts}.values()),
        host_scalar_ops=tr.host_scalar_ops, rng_state_calls=tr.rng_state_calls,
        grad_bindings=tuple(traced.bindings), on_fused=step._on_fused, name_of=step._reg.name_of,
        input_names=tuple([f"argument tensor #{i}" for i in range(len(plan.sig.tensor_pos))]
                          + [f"{s}.grad" for _, s in tr.grad_inputs]
                          + [s.describe() for s in tr.source_inputs]))
    scalars, moved, prologue = None, [], None
    try:
        if device == "cuda":   # (x.to(device) of a CPU batch in the step: moved before the graph)
            move_arrays(gm, [k for k, i in enumerate(plan.sig.tensor_pos) if input_array(plan.sig.leaves[i])])
            constants_to_device(gm)   # (Z[:, li, lj] with li = torch.tensor([...]): DLRM)
            moved = moved_arguments(gm, len(plan.sig.tensor_pos), example)
            for m in moved:
                example[m.index] = example[m.index].to(m.device)
            # (torch.randint(...).to(device) in the step: run before the graph at each call)
            prologue = None if backend.runs_host_reads else split_prologue(gm, example, skip={m.index for m in moved})
            if prologue is not None:
                request = dataclasses.replace(request, input_names=request.input_names + tuple(
                    f"host value #{k} (computed on the CPU before the graph)" for k in range(prologue.n_outputs)))
        # (a graph cut into segments runs its Python between them: segments._host_nodes)
        host_reads = tr.reads is not None and bool(tr.reads.sites())
        # A number read at each replay (an optimizer's Python step count, a meter's count) is fed
        # to the device ops it reaches as a 0-dim tensor, with the live floats (microsoft/LoRA's
        # AdamW, word2vec's SparseAdam: one CUDA graph, was a recapture per call). Only to a graph
        # without segments (a host read, a clock or read value kept in Python, a number with no
        # tensor form): segments with fed numbers ran emulated on the CPU, never on a GPU; there
        # the ops the numbers feed run on the host between segments, as before.
        segmented = host_reads or bool(kept_reads(tr))
        # (numbers only the prologue reads, a loader's position, are not the graph's)
        lifted = bool(tr.uses.lifted) and any(is_number_reader(n) for n in gm.graph.nodes)
        numbers = numbers_to_feed(gm, device) if lifted and not backend.runs_host_reads \
            and not segmented else None
        numbers = None if numbers else numbers   # (some left out: segments run them, and so all)
        host_work = segmented or bool(lifted and numbers is None)
        if not backend.runs_host_reads and (device == "cuda" or lifted) \
                and not (host_work and backend.segmented is not None):
            refuse_host_python(tr, numbers_left=numbers is None and lifted)
            if tr.host_scalar_ops:
                refuse_uncapturable(gm, tr.host_scalar_ops)  # before baking live floats for it
        if not backend.runs_host_reads and (step._guards.live or numbers is not None):
            scalars, plan.sig = step._live.to_device(gm, device, plan.sig, traced.frozen, numbers,
                                                     segmented=host_work and backend.segmented is not None)
            step._prepared += step._live.notes
            step._live.notes.clear()
            if scalars is not None:
                set_call(plan.sig.leaves, args)   # (a number of the call's arguments: uselog._reader)
                try:
                    example.append(scalars.pack())
                finally:
                    set_call(None, None)
            # (a number to_device could not feed after all is Python a plain graph would bake)
            host_work = host_work or any(is_number_reader(n) for n in gm.graph.nodes)
        if not backend.runs_host_reads and host_work:
            if backend.segmented is None:
                raise NeedsReplay(
                    f"the step reads tensor values on the host ({'; '.join(tr.reads.sites()[:3])}): "
                    f"backend {backend.name!r} has no graph segments between host reads yet",
                    op="host read", where=tr.reads.sites()[0],
                    fix="return the value from the step and read it outside, or use "
                        "backend='cudagraph' (segments) or 'replay'")
            run = backend.segmented(gm, example, request)
        else:
            run = backend.compile(gm, example, request)
    except NeedsReplay as e:
        if step.backend != "auto":
            raise
        # Not silent: warned once, logged, and shown by explain().
        backend = backends.pick("replay", device)
        note = f"backend auto chose 'replay' for this graph: {str(e).splitlines()[0]}"
        step._prepared.append(note)
        warnings.warn(f"stepgraph: {step.__name__}: {note}", stacklevel=4)
        log.warning("stepgraph: %s: %s", step.__name__, note)
        run = backend.compile(gm, example, request)
    return Lowered(run, backend, scalars, tuple(moved), prologue)


def keep(step, plan: Plan, traced: Traced, lowered: Lowered, args, kwargs, sibling_of):
    """File the captured step (or a sibling for another host-read value), count it, log it;
    returns the call's result."""
    tr, run, sig = traced.trace, lowered.run, plan.sig
    seconds = time.perf_counter() - plan.started
    step._hook_notes = warn_side_effects(registered_hooks(step._reg) + tr.hooks, step.__name__,
                                         replayed_targets(tr)) + traced.notes
    step._hook_notes += hooks_left_registered(tr, step.__name__)
    # (an object opened as a batch, argtree.py, is a container too: its leaves are its tensors)
    flat = not kwargs and not any(isinstance(a, (list, tuple, dict)) or argtree.opened(a) for a in args)
    entry = CapturedStep(
        key=sig.key, graph=traced.graph, run=run, trace=tr, summary=traced.summary, backend=lowered.backend.name,
        seconds=seconds, captured_at_call=step._calls, n_user_outputs=traced.n_user, tensor_pos=sig.tensor_pos,
        flat_args=flat, stale=run.stale, distributed=bool(step._reg.ddp or step._reg.fsdp),
        python_effects=[(r.ddp, "require_forward_param_sync", r.ddp.require_forward_param_sync)
                        for r in traced.ddp_records]
        # (llm.c's step starts with model.train() after an eval() between steps: the graph for
        # that entry mode must leave the modules in train mode as eager does)
        + [(m, "training", m.training) for m, before in traced.training_before if m.training != before],
        guard_plan=traced.guard_plan, device_scalars=lowered.device_scalars, checks=traced.checks,
        to_device=lowered.moved, prologue=lowered.prologue,
        arrays=any(input_array(sig.leaves[i]) for i in sig.tensor_pos), draws_used=fetches.consumed() if step._fetch else None,
        generators=tuple((i, g) for i, g in enumerate(sig.leaves) if cpu_generator(g)))
    if sibling_of is not None:
        sibling_of.siblings.insert(0, entry)  # the newest value is tried first after the first
    else:
        step._entries[sig.key] = entry
    step._order.append(entry)
    step.stats.captures += 1
    step.stats.capture_seconds += seconds
    note_compiled_parts(step, args, kwargs)
    step.stats.compile_seconds += run.compile_seconds
    # The quick key must describe the state *before* a call: recompute it at the next call.
    step._last = step._last_quick = None
    if plan.reason is not None:
        step.stats.recaptures.append(plan.reason)
        log_recapture(step, plan.reason, seconds)
    else:
        log.info("stepgraph: captured %s (%d ops, %.3fs, backend %s)", step.__name__,
                 traced.summary.ops, seconds, lowered.backend.name)
    return plain_floats(tr.result)


def _device_of(leaves, reg: StateRegistry) -> str:
    """The accelerator when the state or any argument lives on one: a step called with CPU
    batches it moves to the GPU itself (``x = x.to(device)``) is a CUDA step."""
    types = {x.device.type for x in leaves if isinstance(x, torch.Tensor)} | {p.device.type for _, p in reg.params}
    return min(types - {"cpu", "meta"}, default="cpu")
