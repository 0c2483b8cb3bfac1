"""What a ``StepFunction`` shows of itself: its captures, the state it found, the notes of what
it changed, ``explain()``, ``overhead_us()``, and waiting for background compiles. Read-only
views over the fields ``runtime.StepFunction`` keeps (a mixin of it)."""
from __future__ import annotations

import torch

from .captured import CapturedStep
from .capture.state import StateRegistry


class StepViews:
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

    @property
    def registry(self) -> StateRegistry | None:
        """The modules, optimizers and tensors found for this step (None before the first call)."""
        return self._reg

    @property
    def fetches(self) -> tuple:
        """The ``next()`` calls whose batches each call takes before the step (capture/fetches.py)."""
        return tuple(self._fetch or ())

    @property
    def prepared_notes(self) -> tuple[str, ...]:
        """What stepgraph changed on the user's state for its graphs (capturable optimizers,
        device-held hyper-parameters, backend fallbacks), for explain()."""
        return tuple(self._prepared)

    @property
    def capture_notes(self) -> tuple[str, ...]:
        """Python effects of the last capture that run only at capture (hooks, appends, prints)."""
        return tuple(self._hook_notes)

    def overhead_us(self, *args, repeat: int = 500, **kwargs) -> dict:
        """Median per-call cost (µs) of stepgraph's own work for these arguments, without running
        the step: the quick guard (the replay fast path), the full signature (the miss path),
        and the CUDA backend's input-address check. For benchmarks and explain()."""
        from .explain import median_us
        if self._guards is None:
            return {}
        out = {"quick_guard": median_us(lambda: self._guards.quick_key(args, kwargs) == self._last_quick, repeat),
               "full_signature": median_us(lambda: self._guards.signature(args, kwargs), repeat)}
        if self._last is not None:
            out["state_address_check"] = median_us(self._last.stale, repeat)
        return out

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
                ok &= e.run.wait(timeout)
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
