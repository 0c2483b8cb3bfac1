"""The step function: an explicit warm-up -> capture -> replay state machine.

``StepFunction.__call__`` computes the call's guard signature; a cached graph with that
signature replays; otherwise the call runs eagerly (warm-up, or past ``max_captures``) or is
traced and captured, returning its real result. Every decision is counted in ``stats``.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from . import backends, config
from .capture.guards import Guards, arg_names
from .capture.state import StateRegistry, discover, install_registration_hooks
from .capture.trace import TraceResult, raise_problems, trace_step
from .errors import StepGraphError
from .passes import GraphSummary, cleanup, summarize

log = logging.getLogger("stepgraph")


@dataclass
class Stats:
    """Counters of what each call did. ``recaptures`` holds one reason line per recapture."""
    eager_calls: int = 0
    captures: int = 0
    replays: int = 0
    recaptures: list = field(default_factory=list)
    failed_captures: int = 0
    capture_seconds: float = 0.0


@dataclass
class CapturedStep:
    """One captured graph and everything needed to replay it and to explain it."""
    key: tuple
    graph: torch.fx.GraphModule
    run: object                # backend callable: flat inputs -> flat outputs
    trace: TraceResult
    summary: GraphSummary
    backend: str
    seconds: float
    captured_at_call: int
    n_user_outputs: int

    def replay(self, sig, stepfn) -> object:
        tr = self.trace
        inputs = [sig.leaves[i] for i in sig.tensor_pos]
        inputs += [p.grad for p, _ in tr.grad_inputs]
        outs = self.run(inputs)
        n = self.n_user_outputs
        for slot, value in zip(tr.escapes, outs[n:]):
            slot.set(value)
        for slot, value in tr.clear_slots:
            slot.set(value)
        leaves = [outs[v] if kind == "tensor" else v for kind, v in tr.out_leaves]
        return pytree.tree_unflatten(leaves, tr.out_spec)


class StepFunction:
    """A training step captured as one graph. Build it with :func:`stepgraph.compile`."""

    def __init__(self, fn, *, backend="auto", warmup=1, max_captures=8, state=(), on_capture_error="raise"):
        if warmup < 0 or max_captures < 1:
            raise StepGraphError("warmup must be >= 0 and max_captures >= 1")
        if on_capture_error not in ("raise", "eager"):
            raise StepGraphError("on_capture_error must be 'raise' or 'eager'")
        functools.update_wrapper(self, fn, updated=())
        self.fn = fn
        self.backend = config.get("backend") or backend
        if self.backend not in backends.names():
            raise StepGraphError(f"unknown backend {self.backend!r}; choose one of {backends.names()}")
        self.warmup = warmup
        self.max_captures = config.get("max_captures") or max_captures
        self.on_capture_error = on_capture_error
        self.disabled = bool(config.get("disable"))
        self._extra_state = tuple(state)
        self._lock = threading.RLock()
        install_registration_hooks()
        self.reset()

    # ---- public ------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every captured graph (and its memory) and start again from warm-up."""
        with self._lock:
            self._entries: dict[tuple, CapturedStep] = {}
            self._order: list[CapturedStep] = []
            self._reg: StateRegistry | None = None
            self._guards: Guards | None = None
            self._calls = 0
            self._warned_cap = False
            self._eager_only = False
            self.stats = Stats()

    @property
    def graph(self) -> torch.fx.GraphModule | None:
        """The most recently captured graph (a ``torch.fx.GraphModule``; print ``.code``)."""
        return self._order[-1].graph if self._order else None

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        return [e.graph for e in self._order]

    def __call__(self, *args, **kwargs):
        with self._lock:
            self._calls += 1
            if self.disabled or self._eager_only:
                return self._eager(args, kwargs)
            if self._reg is None:
                self._reg = discover(self.fn, self._extra_state)
                self._guards = Guards(self._reg, arg_names(self.fn))
            sig = self._guards.signature(args, kwargs)
            entry = self._entries.get(sig.key)
            if entry is not None:
                self.stats.replays += 1
                return entry.replay(sig, self)
            if self.stats.eager_calls < self.warmup and not self._order:
                return self._eager(args, kwargs)
            if len(self._entries) >= self.max_captures:
                if not self._warned_cap:
                    self._warned_cap = True
                    msg = (f"stepgraph: {self.__name__} reached max_captures={self.max_captures} graphs; "
                           f"calls with new signatures run eagerly (last reason: "
                           f"{self._guards.diff(self._order[-1].key, sig.key, args, kwargs)})")
                    warnings.warn(msg, stacklevel=2)
                    log.warning(msg)
                return self._eager(args, kwargs)
            return self._capture(sig, args, kwargs)

    def explain(self) -> str:
        """What was captured: ops, state by source name, inputs, written state, guards."""
        lines = [f"stepgraph step {self.__name__!r}: backend={self.backend}, "
                 f"{len(self._order)} graph(s), max_captures={self.max_captures}, warmup={self.warmup}"
                 + (" [DISABLED by STEPGRAPH_DISABLE: every call runs eagerly]" if self.disabled else ""),
                 f"  stats: eager_calls={self.stats.eager_calls} captures={self.stats.captures} "
                 f"replays={self.stats.replays} failed_captures={self.stats.failed_captures} "
                 f"capture_seconds={self.stats.capture_seconds:.3f}"]
        if self._reg is not None:
            lines.append("  state found: modules " + (", ".join(n for n, _ in self._reg.modules) or "-")
                         + "; optimizers " + (", ".join(n for n, _ in self._reg.optimizers) or "-"))
        for r in self.stats.recaptures:
            lines.append(f"  recapture: {r}")
        for i, e in enumerate(self._order):
            s = e.summary
            tr = e.trace
            lines.append(f"  graph {i} (captured at call {e.captured_at_call} in {e.seconds:.3f}s, "
                         f"backend {e.backend}): {s.ops} aten ops, {s.inplace_ops} in-place, "
                         f"{s.random_ops} random")
            k = e.key
            ins = [x for x in k[1] if len(x) == 6]
            lines.append("    inputs (" + ("copied into static buffers" if e.backend == "cudagraph"
                                          else "used in place, never copied") + "): "
                         + ", ".join(f"{str(m[1]).replace('torch.', '')}{list(m[3])}@{m[2]}" for m in ins))
            if tr.grad_inputs:
                lines.append(f"    persistent grads read as inputs: {_names([s for _, s in tr.grad_inputs])}")
            lines.append(f"    state read ({len(s.state_read)}): {_names(s.state_read)}")
            lines.append(f"    state written in place ({len(s.state_written)}): {_names(s.state_written)}")
            if s.inputs_written:
                lines.append(f"    inputs written in place: {s.inputs_written}")
            if tr.escapes or tr.clear_slots:
                lines.append(f"    rebound after each replay: "
                             f"{_names([x.source for x in tr.escapes] + [x.source for x, _ in tr.clear_slots])}")
            if s.host_scalar_reads:
                lines.append(f"    host scalars: {s.host_scalar_reads} optimizer step-counter reads "
                             "recomputed on the host each replay (eager-identical numerics)")
            lines.append("    guards: input shapes/dtypes/devices/strides/requires_grad and non-tensor "
                         "values; grad mode; autocast; train/eval of "
                         f"{len(self._reg.all_modules) if self._reg else 0} modules; optimizer "
                         "hyper-parameters; optimizer state identity; module parameter registration; "
                         ".grad presence and layout")
        return "\n".join(lines)

    def __repr__(self):
        return f"<stepgraph.StepFunction {self.__name__} backend={self.backend} graphs={len(self._order)}>"

    # ---- internals ---------------------------------------------------------------------
    def _eager(self, args, kwargs):
        self.stats.eager_calls += 1
        return self.fn(*args, **kwargs)

    def _capture(self, sig, args, kwargs):
        reason = None
        if self._order:
            reason = self._guards.diff(self._order[-1].key, sig.key, args, kwargs)
        device = _device_of(sig.leaves, self._reg)
        backend = backends.pick(self.backend, device)
        t0 = time.perf_counter()
        self._reg.refresh_names()
        prepare = getattr(backend, "prepare", None)
        try:
            tr = trace_step(self.fn, args, kwargs, self._reg)
            raise_problems(tr.problems)
        except BaseException:
            self.stats.failed_captures += 1
            if self.on_capture_error == "eager":
                log.warning("stepgraph: capture of %s failed; running eagerly from now on", self.__name__,
                            exc_info=True)
                self._eager_only = True
            raise
        gm = cleanup(tr.graph_module)
        example = [sig.leaves[i] for i in sig.tensor_pos] + [p.grad for p, _ in tr.grad_inputs]
        run = backend.compile(gm, example)
        n_user = sum(1 for kind, _ in tr.out_leaves if kind == "tensor")
        seconds = time.perf_counter() - t0
        entry = CapturedStep(sig.key, gm, run, tr, summarize(gm, self._reg.name_of), backend.name,
                             seconds, self._calls, n_user)
        tr.graph_module = gm
        self._entries[sig.key] = entry
        self._order.append(entry)
        self.stats.captures += 1
        self.stats.capture_seconds += seconds
        if reason is not None:
            self.stats.recaptures.append(reason)
            log.info("stepgraph: recapture %s: %s", self.__name__, reason)
        else:
            log.info("stepgraph: captured %s (%d ops, %.3fs, backend %s)", self.__name__,
                     entry.summary.ops, seconds, backend.name)
        del prepare
        return tr.result


def _names(xs, limit=12) -> str:
    xs = list(xs)
    if not xs:
        return "-"
    head = ", ".join(xs[:limit])
    return head + (f", ... (+{len(xs) - limit})" if len(xs) > limit else "")


def _device_of(leaves, reg: StateRegistry) -> str:
    for x in leaves:
        if isinstance(x, torch.Tensor):
            return x.device.type
    for _, p in reg.params:
        return p.device.type
    return "cpu"
