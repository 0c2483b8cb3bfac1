"""The step function: an explicit warm-up -> capture -> replay state machine.

``StepFunction.__call__`` computes the call's guard signature; a cached graph with that
signature replays; otherwise the call runs eagerly (warm-up, or past ``max_captures``) or is
traced and captured, returning its real result. Every decision is counted in ``stats``.
"""
from __future__ import annotations

import logging
import threading
import warnings

import torch

from . import backends, config
from .capture.guards import Guards, arg_names
from .capture.hints import recapture_hint
from .capture.reasons import nearest_key
from .dropped import Busy, DroppedState
from .capture import callbinds, collectives, distributed, fetches, modstate
from .capture.valuekeys import calling
from .capture.state import StateRegistry, adopt_arguments, adopt_code, discover
from .capture.watch import install_registration_hooks
from .capture.trace import discover_stepping_optimizers
from .optimizers import absorb_floats
from .captured import Branch, CapturedStep, Stats
from .binding import PerInstance, wrap_step
from .errors import StepGraphError
from .livefloats import LiveFloats
from .stepviews import StepViews
from .replaying import NO_QUICK_REPLAY, ReplayPaths
from .pipeline import capture

log = logging.getLogger("stepgraph")


class StepFunction(DroppedState, ReplayPaths, StepViews, PerInstance):
    """A training step captured as one graph. Build it with :func:`stepgraph.compile`."""

    def __init__(self, fn, *, backend="auto", warmup=1, max_captures=8, state=(), on_capture_error="raise",
                 clone_outputs=True, check=0, check_rtol=1e-5, host_reads="guard"):
        self._options = {k: v for k, v in locals().items() if k not in ("self", "fn")}   # (PerInstance)
        if warmup < 0 or max_captures < 1:
            raise StepGraphError("warmup must be >= 0 and max_captures >= 1")
        if on_capture_error not in ("raise", "eager"):
            raise StepGraphError("on_capture_error must be 'raise' or 'eager'")
        if host_reads not in ("guard", "error"):
            raise StepGraphError("host_reads must be 'guard' (values read on the host are guarded "
                                 "or live) or 'error' (refuse any host read)")
        self.host_reads = config.get("host_reads") or host_reads
        wrap_step(self, fn)
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
            self._moving_numbers: set = set()   # tracked numbers a value check saw change (UseLog.moving)
            self._fetch: list | None = None     # inputs the step takes itself (next(), draws), taken first (fetches.py)
            self._replans = 0                   # times that plan grew (fetches.MAX_REPLANS)
            self._last: CapturedStep | None = None
            self._last_quick = None
            self._warned_cap = False
            self._eager_only = False
            self._prepared: list[str] = []
            self._hook_notes: list[str] = []
            self._dropped = self._rescan = False  # a weakly held model/optimizer died (_state_dropped)
            self._busy = Busy()         # calls running (a dropped model is forgotten between them)
            had_graphs = bool(getattr(self, "_pool", None))
            self._pool, self._pool_graphs = None, []   # (CompileRequest.pool_graphs)
            self.stats = Stats()
            if had_graphs and torch.cuda.is_available():
                torch.cuda.empty_cache()  # give the dropped graphs' pool back to the device

    def __call__(self, *args, **kwargs):
        with self._lock, self._busy, calling(args):   # (``loss_compute.scale`` read live: this call's)
            self._calls += 1
            if self._agree.aborted:
                raise StepGraphError(self._agree.aborted_message())
            if self.disabled or self._eager_only:
                self.stats.took(Branch.EAGER)
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
                    adopt_code(self._reg, self.fn)   # (what a rebound global holds now)
                self._guards.find_python_values(self.fn, args)
                self._rescan = False
            if self._reg.device_hypers:
                absorb_floats(self._reg)  # e.g. OneCycleLR's new float betas -> the device tensors
            if self._fetch:   # (its batches, taken now and handed to its next(): inputs like arguments)
                kwargs = fetches.take(self._fetch, args, kwargs)
                if not fetches.taken_all(self._fetch, kwargs):   # (an iterator ran out: eager's except)
                    self.stats.took(Branch.EAGER)
                    plan, self._fetch = self._fetch, fetches.kept(self._fetch)   # (a data call ran the model)
                    return self._eager(args, kwargs, plan)
            out = self._quick_replay(args, kwargs)   # (the last graph again, on the quick key)
            if out is not NO_QUICK_REPLAY:
                return out
            # A model or optimizer passed as an argument that is new to this step is state too.
            adopted = adopt_arguments(self._reg, args, kwargs, self._guards.arg_names)
            if adopted:
                self._guards.find_python_values(self.fn, args)
            sig = self._guards.signature(args, kwargs)
            entry = self._entries.get(sig.key)
            if entry is None and self._found_more(args, sig):   # (a global rebound to a new model, a new hook)
                sig = self._guards.signature(args, kwargs)
                entry = self._entries.get(sig.key)
            live_key = self._live.read_live_key(sig.key)   # graphs from before a value was baked
            older = self._entries.get(live_key) if live_key is not None else None
            if older is not None and older.stale() is not None:
                self._drop(older)
                older = None
            stale_reason = entry.stale() if entry is not None else None
            if stale_reason is not None:
                self._drop(entry)
                self.stats.took(Branch.CAPTURE)
                return capture(self, sig, args, kwargs, reason=stale_reason)
            if entry is not None or older is not None:
                return self._replay_entry(entry, sig, args, kwargs, older)
            if self._warm_done < self.warmup and not self._order:
                if self.backend == "inductor" and config.get("inductor_background"):
                    _prestart(self._reg)  # compile processes start up while warm-up and tracing run
                self.stats.took(Branch.WARMUP)
                self._live.seen_at_warmup(args)
                counters = modstate.counters_before(self._reg.all_modules)
                with discover_stepping_optimizers(self._reg), collectives.watching(self._reg), \
                        callbinds.recording(self.fn, args, self._guards.helper_calls) as calls:   # (its helpers')
                    out = self._eager(args, kwargs)   # (optimizers stepped from hooks; collectives)
                self._reg.module_counters = modstate.counters_after(counters)   # (torchmetrics' _update_count)
                self._warm_done += 1  # only a warm-up that returned created the state it is for
                self._rescan |= self._guards.py.partial or bool(calls)   # (``self.last_loss = ...`` its first call made)
                return out
            if adopted and self.warmup and self._order and len(self._order) < self.max_captures:
                # New state warms up as the first did: its grads and optimizer state come to
                # exist eagerly, so its graph is traced once, with them (captured now, it would
                # trace the optimizer's state init with grads None, then recapture next call).
                self.stats.new_state_warmups += 1
                self.stats.took(Branch.WARMUP)
                with discover_stepping_optimizers(self._reg):
                    return self._eager(args, kwargs)
            if len(self._order) >= self.max_captures:
                if not self._warned_cap:
                    self._warned_cap = True
                    last = self._guards.diff(nearest_key([e.key for e in self._order], sig.key), sig.key, args, kwargs)
                    hint = recapture_hint(last)
                    msg = (f"stepgraph: {self.__name__} reached max_captures={self.max_captures} graphs; "
                           f"calls with new signatures run eagerly (last reason: {last})"
                           + (f"; {hint}" if hint else ""))
                    warnings.warn(msg, stacklevel=2)
                    log.warning(msg)
                self._agree(self._reg, sig.leaves, self._calls, "eager call")  # (no-op without DDP)
                self.stats.took(Branch.EAGER)
                return self._eager(args, kwargs)
            self.stats.took(Branch.CAPTURE)
            return capture(self, sig, args, kwargs)


def _prestart(reg) -> None:
    from .backends.background import prestart
    from .backends.partition import spares_for
    prestart(spares_for(sum(1 for _, m in reg.modules for _ in m.parameters())))
