"""Lightning: one callback captures the whole training step of ``Trainer.fit``.

    import lightning.pytorch as L
    from stepgraph.integrations.lightning import StepGraphCallback

    trainer = L.Trainer(max_epochs=3, precision="bf16-mixed", accumulate_grad_batches=2,
                        gradient_clip_val=1.0, callbacks=[StepGraphCallback()])
    trainer.fit(model, train_loader, val_loader)

**Why a Callback** (and not a Strategy or a Plugin): Lightning lets a Trainer have exactly one
Strategy (where and how the model runs: single device, DDP, FSDP, DeepSpeed) and one
precision Plugin (the numerics: ``bf16-mixed``, ``16-mixed`` with its GradScaler). stepgraph
changes neither: it records what the chosen strategy and precision plugin do and replays it.
As a Strategy or a Plugin it would take the user's choice away (or have to wrap every one of
them); as a Callback it composes with whatever the Trainer is configured with, and adding or
removing it is the one line ``callbacks=[StepGraphCallback()]``. Lightning's own callbacks that
change how the loop runs (``StochasticWeightAveraging``, the batch-size and LR finders) are
callbacks for the same reason.

**What is captured.** With automatic optimization, the body of one training batch:
``training_step`` (inside the precision plugin's autocast), ``on_before_zero_grad`` /
``optimizer_zero_grad`` at the first batch of an accumulation window, ``on_before_backward``,
backward (the precision plugin's, with GradScaler scaling under ``16-mixed``),
``on_after_backward``, and at the batch that steps: ``on_before_optimizer_step``, gradient
clipping (``gradient_clip_val``/``configure_gradient_clipping``), ``optimizer.step``. Each kind
of batch (first / middle / last of an accumulation window) is its own graph. With manual
optimization: ``training_step`` with every ``manual_backward``, ``opt.step()``,
``opt.zero_grad()`` and scheduler step it makes.

**What stays Python, around the graph, every batch** (as eager runs it): the loop's progress
counters (``global_step``), the LR schedulers Lightning steps (the new ``lr`` is read live by
the next replay), ``self.log(...)``: while the step's Python runs (warm-up and capture) each
call is recorded and its tensor value copied inside the graph; after every call (replays
included) the same ``self.log`` calls are made with that call's values, under the hook name
they were made from. Validation, checkpointing and callbacks' other hooks are untouched.

**Fallbacks, each announced once with a warning naming the feature** (the training step then
runs eagerly; everything else in the fit is unchanged): a strategy other than single-device or
DDP, a ``training_step``/``optimizer_step``/``optimizer_zero_grad`` that reads its
``batch_idx``/``epoch`` argument (a new value each batch), ``training_step(dataloader_iter)``,
batches that skip backward (``StochasticWeightAveraging``), torchmetrics ``Metric`` objects
updated inside the step (their state is Python a replay cannot update), and anything stepgraph
itself refuses (``stepgraph.CaptureError``: the reason is in the warning). A profiler other
than the pass-through one is warned about: its sections inside the step time only the calls
that run Python.
"""
from __future__ import annotations

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise ImportError("stepgraph.integrations.lightning needs Lightning: pip install 'stepgraph[lightning]'") from e

from lightning.pytorch.profilers import PassThroughProfiler

from ..runtime import StepFunction
from ._common import Effects, Once, detached_copy
from ._lightning_batch import BatchRunner
from ._lightning_checks import unsupported
from ._lightning_core import _GroupRead, _group_slot, _scheduler_epochs, _is_metric, _user_calls, _automatic_core, \
    _manual_core, _Ctx

__all__ = ["StepGraphCallback"]


class StepGraphCallback(BatchRunner, Callback):
    """Capture Lightning's training step with stepgraph (see the module docstring).

    Args:
        backend, max_captures, check, host_reads: as for :func:`stepgraph.compile`.
        on_capture_error: ``"eager"`` (default): a step stepgraph refuses runs eagerly from then
            on, with one warning giving the reason; ``"raise"``: the ``CaptureError`` propagates.

    After (or during) ``fit``, ``callback.stats`` holds the step's counters (eager calls,
    captures, replays) and ``callback.step_function.explain()`` describes the graphs.
    """

    def __init__(self, *, backend: str = "auto", max_captures: int = 8, check=0, host_reads: str = "guard",
                 on_capture_error: str = "eager"):
        super().__init__()
        self.compile_kwargs = dict(backend=backend, max_captures=max_captures, check=check, host_reads=host_reads,
                                   on_capture_error=on_capture_error)
        self.step_function: StepFunction | None = None
        self.eager_reason: str | None = None
        self._warn = Once()
        self._ctx: _Ctx | None = None
        self._patched: list = []

    # ---- public --------------------------------------------------------------------------
    @property
    def stats(self):
        """The captured step's ``stepgraph.Stats`` (None before the first fit)."""
        return self.step_function.stats if self.step_function is not None else None

    # ---- Lightning hooks -----------------------------------------------------------------
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._uninstall()
        self.eager_reason = unsupported(trainer, pl_module)
        if self.eager_reason is not None:
            self._warn(f"stepgraph: {self.eager_reason}; the training step runs eagerly (the rest of the fit is "
                       "unchanged)")
            return
        if not isinstance(trainer.profiler, PassThroughProfiler):
            self._warn(f"stepgraph: the profiler ({type(trainer.profiler).__name__}) times sections inside the "
                       "training step only at the calls that run Python (warm-up and capture); replays show up "
                       "in 'run_training_batch' as one piece")
        self._install(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._uninstall()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._uninstall()

    # ---- installing ----------------------------------------------------------------------
    def _install(self, trainer, module) -> None:
        ctx = self._ctx = _Ctx()
        ctx.trainer, ctx.module = trainer, module
        ctx.effects, ctx.values, ctx.warn = Effects("lightning"), None, self._warn
        ctx.batch_idx = ctx.optimizer = None
        epoch_loop = trainer.fit_loop.epoch_loop
        manual = not module.automatic_optimization
        ctx.loop = epoch_loop.manual_optimization if manual else epoch_loop.automatic_optimization
        ctx.pass_idx = None  # whether Lightning passes batch_idx to training_step (its kwargs say)
        core = _manual_core(ctx) if manual else _automatic_core(ctx)
        core.__name__ = core.__qualname__ = f"{type(module).__name__}.training_step (Lightning)"
        core._stepgraph_user_calls = _user_calls(trainer, module)
        state = [("model", module)] + [(f"optimizers[{i}]", o) for i, o in enumerate(trainer.optimizers)]
        # Warm-up: one whole accumulation window runs eagerly, so the optimizer state exists
        # before any graph is captured.
        warmup = 1 if manual else max(1, int(trainer.accumulate_grad_batches))
        self.step_function = StepFunction(core, warmup=warmup, state=state, **self.compile_kwargs)
        real_log = type(module).log.__get__(module)

        def log(name, value, *args, **kwargs):
            cur = ctx.effects.current
            if cur is None:  # outside the captured step (validation, other hooks)
                return real_log(name, value, *args, **kwargs)
            if kwargs.get("enable_graph") or (len(args) > 5 and args[5]):
                self._warn("stepgraph: self.log(..., enable_graph=True) inside the training step: logged values "
                           "come from the graph's outputs and carry no autograd graph")
            slot = _group_slot(trainer, value) if isinstance(value, float) else None
            if slot is not None:
                # An optimizer hyper-parameter (``self.log("lr", opt.param_groups[0]["lr"])``): read
                # from the group again at every call, before the call when no scheduler stepped
                # inside the step before this log, after it when every one had (manual optimization
                # steps schedulers inside the step; a replay re-runs them after the graph).
                cur["logs"].append((module._current_fx_name, name, args, kwargs, None,
                                    _GroupRead(slot, value, _scheduler_epochs(trainer))))
            elif isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool):
                cur["logs"].append((module._current_fx_name, name, args, kwargs, len(ctx.values), None))
                ctx.values.append(detached_copy(value))
            else:  # a torchmetrics Metric object (updated elsewhere) or another object: by reference
                cur["logs"].append((module._current_fx_name, name, args, kwargs, None, value))
        module.log = log
        self._patched.append((module, "log"))
        if manual:
            ctx.loop.advance = self._advance_manual
            self._patched.append((ctx.loop, "advance"))
        else:
            ctx.loop.run = self._run_automatic
            self._patched.append((ctx.loop, "run"))
        self._real_log = real_log
        self._metrics = [m for m in module.modules() if _is_metric(m)]

    def _uninstall(self) -> None:
        for obj, name in self._patched:
            obj.__dict__.pop(name, None)
        self._patched = []
