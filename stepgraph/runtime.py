"""The step function: an explicit warm-up -> capture -> replay state machine.

``StepFunction.__call__`` computes the call's guard signature; a cached graph with that
signature replays; otherwise the call runs eagerly (warm-up, or past ``max_captures``) or is
traced and captured, returning its real result. Every decision is counted in ``stats``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import warnings

import torch

from . import backends, config
from .capture.guards import Guards, arg_names
from .dropped import Busy, DroppedState
from .check import checked_call
from .capture.hooks import hooks_left_registered, registered_hooks, warn_side_effects
from .capture import distributed
from .capture.state import StateRegistry, adopt_arguments, discover
from .capture.watch import install_registration_hooks
from .capture.effects import resolve_bindings
from .capture.trace import discover_stepping_optimizers, raise_problems, trace_step
from .capture.outputs import container_sizes, live_outputs, read_side_effects, refuse_python_side_effects, warn_appends
from .capture.hostreads import GuardMiss
from .passes.guards import place_guards
from .captured import CapturedStep, Stats, log_recapture, plain_floats
from .backends.cudagraph import NeedsReplay, absorb_floats, capture_stream, refuse_uncapturable
from .errors import StepGraphError
from .failures import after_failed_trace, capture_failed
from .capture.rollback import Rollback
from .capture.compiled import note_compiled_parts
from .capture.libraries import untraceable_modules
from .passes import cleanup, summarize
from .livefloats import LiveFloats

log = logging.getLogger("stepgraph")


class StepFunction(DroppedState):
    """A training step captured as one graph. Build it with :func:`stepgraph.compile`."""

    def __init__(self, fn, *, backend="auto", warmup=1, max_captures=8, state=(), on_capture_error="raise",
                 clone_outputs=True, check=0, check_rtol=1e-5, host_reads="guard"):
        if warmup < 0 or max_captures < 1:
            raise StepGraphError("warmup must be >= 0 and max_captures >= 1")
        if on_capture_error not in ("raise", "eager"):
            raise StepGraphError("on_capture_error must be 'raise' or 'eager'")
        if host_reads not in ("guard", "error"):
            raise StepGraphError("host_reads must be 'guard' (values read on the host are guarded "
                                 "or live) or 'error' (refuse any host read)")
        self.host_reads = config.get("host_reads") or host_reads
        functools.update_wrapper(self, fn, updated=())
        self.fn = fn
        self.backend = config.get("backend") or backend
        if self.backend not in backends.names():
            raise StepGraphError(f"unknown backend {self.backend!r}; choose one of {backends.names()}")
        self.warmup = warmup
        self.max_captures = config.get("max_captures") or max_captures
        self.on_capture_error = on_capture_error
        self.clone_outputs = clone_outputs
        self.check = 3 if check is True else int(check or (3 if config.get("check") else 0))
        self.check_rtol = check_rtol
        self.disabled = bool(config.get("disable"))
        self._extra_state = tuple(state)
        self._lock = threading.RLock()
        self._agree = distributed.agree(self.__name__)  # ranks meet before each capture (DDP)
        install_registration_hooks()
        self.reset()

    # ---- public ------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every captured graph (and its memory) and start again from warm-up."""
        with self._lock:
            self._entries: dict[tuple, CapturedStep] = {}
            self._order: list[CapturedStep] = []
            self._reg: StateRegistry | None = None
            self._guards: Guards | None = None  # (a reset also forgets live hyper-parameters)
            self._calls = 0
            self._warm_done = 0
            self._live: LiveFloats | None = None  # which floats captures read live (livefloats.py)
            self._recapture_kinds: set = set()  # reasons already shown at WARNING
            self._last: CapturedStep | None = None
            self._last_quick = None
            self._warned_cap = False
            self._eager_only = False
            self._prepared: list[str] = []
            self._hook_notes: list[str] = []
            self._dropped = self._rescan = False  # a weakly held model/optimizer died (_state_dropped)
            self._busy = Busy()         # calls running (a dropped model is forgotten between them)
            had_graphs = bool(getattr(self, "_pool", None))
            self._pool = None
            self.stats = Stats()
            if had_graphs and torch.cuda.is_available():
                torch.cuda.empty_cache()  # give the dropped graphs' pool back to the device

    @property
    def graph(self) -> torch.fx.GraphModule | None:
        """The most recently captured graph (a ``torch.fx.GraphModule``; print ``.code``)."""
        return self._order[-1].graph if self._order else None

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        return [e.graph for e in self._order]

    @property
    def captures(self) -> tuple[CapturedStep, ...]:
        """The captured steps alive now, oldest first (read-only: each has ``.backend``, ``.graph``)."""
        return tuple(self._order)

    def __call__(self, *args, **kwargs):
        with self._lock, self._busy:
            self._calls += 1
            if self._agree.aborted:
                raise StepGraphError(self._agree.aborted_message())
            if self.disabled or self._eager_only:
                return self._eager(args, kwargs)
            if self._reg is None:
                names = arg_names(self.fn)
                self._reg = discover(self.fn, self._extra_state, args, kwargs, names)
                self._reg.on_death = self._state_dropped
                self._guards = Guards(self._reg, names)
                self._guards.find_python_values(self.fn, args)
                self._live = LiveFloats(self._guards, self._reg, self.__name__)
            elif self._dropped or self._rescan:
                if self._dropped:
                    self._forget_dropped()
                self._guards.find_python_values(self.fn, args)
                self._rescan = False
            if self._reg.device_hypers:
                absorb_floats(self._reg)  # e.g. OneCycleLR's new float betas -> the device tensors
            last = self._last
            if last is not None:
                try:
                    quick = self._guards.quick_key(args, kwargs)
                    hit = quick == self._last_quick
                except Exception:  # a tensor compared by value: not the same object
                    hit = False
                if hit and (last.stale is None or last.stale() is None) and last.checks_hold(list(args), args):
                    out, miss = self._try_replay(last, lambda: last.replay_args(args, kwargs), args, kwargs)
                    if miss is None:
                        return out  # (a miss was undone: go on to the full lookup)
            # A model or optimizer passed as an argument that is new to this step is state too.
            if adopt_arguments(self._reg, args, kwargs, self._guards.arg_names):
                self._guards.find_python_values(self.fn, args)
            sig = self._guards.signature(args, kwargs)
            entry = self._entries.get(sig.key)
            stale_reason = entry.stale() if entry is not None and entry.stale is not None else None
            if stale_reason is not None:
                self._drop(entry)
                return self._capture(sig, args, kwargs, reason=stale_reason)
            if entry is not None:
                return self._replay_entry(entry, sig, args, kwargs)
            if self._warm_done < self.warmup and not self._order:
                if self.backend == "inductor" and config.get("inductor_background"):
                    from .backends.background import prestart
                    prestart()  # the compile process starts up while warm-up and tracing run
                self._live.seen_at_warmup(args)
                with discover_stepping_optimizers(self._reg):  # e.g. optimizers stepped from hooks
                    out = self._eager(args, kwargs)
                self._warm_done += 1  # only a warm-up that returned created the state it is for
                return out
            if len(self._order) >= self.max_captures:
                if not self._warned_cap:
                    self._warned_cap = True
                    msg = (f"stepgraph: {self.__name__} reached max_captures={self.max_captures} graphs; "
                           f"calls with new signatures run eagerly (last reason: "
                           f"{self._guards.diff(self._order[-1].key, sig.key, args, kwargs)})")
                    warnings.warn(msg, stacklevel=2)
                    log.warning(msg)
                self._agree(self._reg, sig.leaves, self._calls, "eager call")  # (no-op without DDP)
                return self._eager(args, kwargs)
            return self._capture(sig, args, kwargs)

    def _replay_entry(self, entry, sig, args, kwargs):
        """Replay the graph for this key whose host reads hold (one per distinct value seen)."""
        if entry.gave_up:
            return self._eager(args, kwargs)
        miss = None
        for e in [entry] + entry.siblings:
            if not e.checks_hold(sig.leaves, args):   # a Python number it used differs (tracked.py)
                miss = miss or e.check_miss(sig.leaves, args)
                continue
            out, m = self._try_replay(e, lambda: e.replay(sig.leaves, sig.tensor_pos), args, kwargs)
            if m is None:
                self._remember(e, args, kwargs)
                return out
            miss = m
        if len(self._order) >= self.max_captures:
            entry.gave_up = True
            msg = (f"stepgraph: {self.__name__}: a value the graphs depend on keeps changing ({miss}); "
                   f"max_captures={self.max_captures} graphs are kept, so calls with it run eagerly "
                   "from now on. Return the value from the step and decide outside it, or raise "
                   "max_captures if it takes few values")
            warnings.warn(msg, stacklevel=3)
            log.warning(msg)
            return self._eager(args, kwargs)
        return self._capture(sig, args, kwargs, reason=str(miss), sibling_of=entry)

    def _try_replay(self, entry, replay, args, kwargs):
        """``(output, None)``, or ``(None, GuardMiss)`` when a host read differed from the
        capture's (the graph undid its writes; not counted as a replay). Check mode applies."""
        self.stats.replays += 1
        try:
            if len(self.stats.check_reports) < self.check:
                return checked_call(self, entry, replay, args, kwargs, self.check_rtol), None
            out = replay()
            entry.number_effects(args, kwargs)
            return out, None
        except GuardMiss as miss:
            self.stats.replays -= 1
            self.stats.guard_misses[miss.site] = self.stats.guard_misses.get(miss.site, 0) + 1
            return None, miss

    def overhead_us(self, *args, repeat: int = 500, **kwargs) -> dict:
        """Median per-call cost (µs) of stepgraph's own work for these arguments, without running
        the step: the quick guard (the replay fast path), the full signature (the miss path),
        and the CUDA backend's input-address check. For benchmarks and explain()."""
        from .explain import overhead_us
        return overhead_us(self, args, kwargs, repeat)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until background Inductor compiles are done and switch to them now (e.g. before
        timing). True when every graph is fused or there is nothing to wait for; False on
        timeout or a failed compile (warned). See ``STEPGRAPH_INDUCTOR_BACKGROUND``.

            step = stepgraph.compile(train_step, backend="inductor")
            step(batch); step(batch)       # warm-up, capture: training goes on unfused
            step.wait_compiled()           # later calls run the fused graph
        """
        ok = True
        with self._lock:
            for e in list(self._order):
                wait = getattr(e.run, "wait", None)
                if wait is not None:
                    ok &= wait(timeout)
        return ok

    def _on_fused(self, seconds: float, parity=None) -> None:
        self.stats.compile_seconds += seconds
        if parity is not None:  # backends/verify.py: the check at the switch to a fused graph
            self.stats.fused_parity.append(parity)

    def explain(self) -> str:
        """What was captured: ops, state by source name, inputs, written state, guards."""
        from .explain import explain
        return explain(self)

    def __repr__(self):
        return f"<stepgraph.StepFunction {self.__name__} backend={self.backend} graphs={len(self._order)}>"

    # ---- internals ---------------------------------------------------------------------
    def _drop(self, entry) -> None:
        for key in [k for k, e in self._entries.items() if e is entry]:
            del self._entries[key]
        for e in [entry] + entry.siblings:
            self._order.remove(e)
        self._last = self._last_quick = None

    def _remember(self, entry, args, kwargs):
        # The quick key is taken from the state *after* this call, which is the next call's
        # state only if nothing changes in between: trust it only when that post-call state
        # still has this entry's full signature (a graph that rebinds .grad does not), and
        # only for flat calls, whose leaves are the args themselves.
        key = self._guards.signature(args, kwargs).key if entry.flat_args and not kwargs else None
        if key is not None and (key == entry.key or self._entries.get(key) is entry):
            self._last, self._last_quick = entry, self._guards.quick_key(args, kwargs)
        else:
            self._last = self._last_quick = None

    def _eager(self, args, kwargs):
        self.stats.eager_calls += 1
        return self.fn(*args, **kwargs)

    def _capture(self, sig, args, kwargs, reason=None, sibling_of=None):
        if reason is None and self._order:
            reason = self._guards.diff(self._order[-1].key, sig.key, args, kwargs)
        device = _device_of(sig.leaves, self._reg)
        backend = backends.pick(self.backend, device)
        reason, resign = self._live.before_prepare(backend.name, device, args, reason,
                                                   self._order[-1].key if self._order else None, sig.key)
        if resign:
            sig = self._guards.signature(args, kwargs)
        if self._guards.pin_objects(args):
            sig = self._guards.signature(args, kwargs)
        t0 = time.perf_counter()
        self._reg.refresh_names()
        self._agree(self._reg, sig.leaves, self._calls, "capture")  # ranks meet (DDP steps only)
        if backend.prepare is not None:
            changed = backend.prepare(self._reg)
            if changed:
                self._prepared += changed
                log.info("stepgraph: %s: %s", self.__name__, "; ".join(changed))
                sig = self._guards.signature(args, kwargs)  # state changed: key it as it is now
        reason, resign = self._live.after_prepare(backend.name, args, reason)
        if resign:
            sig = self._guards.signature(args, kwargs)
        try:
            done = None  # (result,) once this call has run to its end
            refusal = untraceable_modules(self._reg, device)
            if refusal is not None:
                done = (self._eager(args, kwargs),)  # this call runs as eager would, then the error
                raise refusal
            around = backend.trace_context(self._reg) if backend.trace_context else contextlib.nullcontext()
            rollback = Rollback.take(self._reg, sig.leaves)   # what the trace writes, to undo if it fails
            try:
                with capture_stream(device), around, distributed.tracing(self._reg) as ddp_records:
                    live = self._guards.live
                    track = self._guards.tracking(args, kwargs)   # numbers checked only where used
                    py_before = self._guards.py.key(args)
                    frozen = self._guards.frozen_key(args, kwargs)
                    sizes_before = container_sizes(self._guards.py, args)
                    tr = trace_step(self.fn, args, kwargs, self._reg, device,
                                    live_hypers=sorted(h for h in live if isinstance(h, tuple)),
                                    live_sources=[h for h in live if not isinstance(h, tuple)],
                                    host_reads=self.host_reads == "guard", rollback=rollback,
                                    track=track)
            except BaseException as e:
                done = after_failed_trace(e, rollback, lambda: self._eager(args, kwargs))
                raise
            finally:
                rollback = None   # its copies of the state: not kept past the trace
            done = (tr.result,)
            raise_problems(tr.problems)
            refuse_python_side_effects(self._guards.py, py_before, self._guards.py.key(args),
                                       scheduled=bool(tr.scheduler_steps),
                                       replayed=[e.source for e in tr.number_effects])
            append_notes = warn_appends(self._guards.py, sizes_before, container_sizes(self._guards.py, args),
                                        self.__name__)
            live_outputs(tr, self._reg, self._guards.py, args, self.__name__)
            read_notes = read_side_effects(tr, self.__name__)
            distributed.refuse_direct_collectives(tr.graph_module)
            sig = self._live.after_trace(tr, sig, frozen, self._entries)
            gm = cleanup(tr.graph_module)
            tr.graph_module = gm
            checks = tr.uses.checks(gm)   # after dead-code elimination: dead uses need no check
            plan = place_guards(gm, device, self._reg.name_of)
            bindings = resolve_bindings(gm, tr.grad_bindings, backend.name == "replay")
            summary = summarize(gm, self._reg.name_of)
            n_user = sum(1 for kind, _ in tr.out_leaves if kind == "tensor")
            example = [sig.leaves[i] for i in sig.tensor_pos] + [p.grad for p, _ in tr.grad_inputs]
            if device == "cuda" and self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            consts = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"
                      and isinstance(getattr(gm, n.target), torch.Tensor)]
            opts = dict(pool=self._pool, inputs_written=summary.inputs_written, clone_outputs=self.clone_outputs,
                        n_user_outputs=n_user, state_tensors=list({id(t): t for t in consts}.values()),
                        host_scalar_ops=tr.host_scalar_ops, rng_state_calls=tr.rng_state_calls,
                        grad_bindings=bindings, on_fused=self._on_fused, name_of=self._reg.name_of,
                        input_names=[f"argument tensor #{i}" for i in range(len(sig.tensor_pos))]
                        + [f"{s}.grad" for _, s in tr.grad_inputs])
            scalars = None
            try:
                if tr.host_scalar_ops and not backend.runs_host_reads and device == "cuda":
                    refuse_uncapturable(gm, tr.host_scalar_ops)  # before baking live floats for it
                if not backend.runs_host_reads and self._guards.live:
                    scalars, sig = self._live.to_device(gm, device, sig, frozen)
                    self._prepared += self._live.notes
                    self._live.notes.clear()
                    if scalars is not None:
                        example.append(scalars.pack())
                if not backend.runs_host_reads and tr.reads is not None and tr.reads.sites():
                    if backend.segmented is None:
                        raise NeedsReplay(
                            f"the step reads tensor values on the host ({'; '.join(tr.reads.sites()[:3])}): "
                            f"backend {backend.name!r} has no graph segments between host reads yet",
                            op="host read", where=tr.reads.sites()[0],
                            fix="return the value from the step and read it outside, or use "
                                "backend='cudagraph' (segments) or 'replay'")
                    run = backend.segmented(gm, example, **opts)
                else:
                    run = backend.compile(gm, example, **opts)
            except NeedsReplay as e:
                if self.backend != "auto":
                    raise
                # Not silent: warned once, logged, and shown by explain().
                backend = backends.pick("replay", device)
                note = f"backend auto chose 'replay' for this graph: {str(e).splitlines()[0]}"
                self._prepared.append(note)
                warnings.warn(f"stepgraph: {self.__name__}: {note}", stacklevel=3)
                log.warning("stepgraph: %s: %s", self.__name__, note)
                run = backend.compile(gm, example, **opts)
        except BaseException as e:
            self.stats.failed_captures += 1
            # The user's own exceptions (and Ctrl-C) propagate and leave capture on (failures.py).
            return capture_failed(self, e, done)
        seconds = time.perf_counter() - t0
        self._hook_notes = warn_side_effects(registered_hooks(self._reg) + tr.hooks, self.__name__) + append_notes \
            + read_notes
        self._hook_notes += hooks_left_registered(tr, self.__name__)
        flat = not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args)
        entry = CapturedStep(sig.key, gm, run, tr, summary, backend.name, seconds, self._calls, n_user,
                             sig.tensor_pos, flat, getattr(run, "stale", None), bool(self._reg.ddp),
                             [(r.ddp, "require_forward_param_sync", r.ddp.require_forward_param_sync)
                              for r in ddp_records], plan, device_scalars=scalars,
                             checks=checks)
        if sibling_of is not None:
            sibling_of.siblings.insert(0, entry)  # the newest value is tried first after the first
        else:
            self._entries[sig.key] = entry
        self._order.append(entry)
        self.stats.captures += 1
        self.stats.capture_seconds += seconds
        note_compiled_parts(self, args, kwargs)
        self.stats.compile_seconds += getattr(run, "compile_seconds", 0.0)
        # The quick key must describe the state *before* a call: recompute it at the next call.
        self._last = self._last_quick = None
        if reason is not None:
            self.stats.recaptures.append(reason)
            log_recapture(self, reason, seconds)
        else:
            log.info("stepgraph: captured %s (%d ops, %.3fs, backend %s)", self.__name__,
                     summary.ops, seconds, backend.name)
        return plain_floats(tr.result)


def _device_of(leaves, reg: StateRegistry) -> str:
    for x in leaves:
        if isinstance(x, torch.Tensor):
            return x.device.type
    for _, p in reg.params:
        return p.device.type
    return "cpu"
