"""The functions a ``StepGraphCallback`` captures (Lightning's automatic and manual optimization
bodies, rebuilt from Lightning's own loop pieces) and what they read per call. Imported by
lightning.py; needs Lightning installed."""
from __future__ import annotations

import inspect
from collections import OrderedDict
from functools import partial

from lightning.pytorch.loops.optimization.automatic import Closure
from lightning.pytorch.loops.optimization.manual import ManualResult
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from lightning.pytorch.trainer import call

from ._common import user_function

# Hooks that run inside the captured step: the user's overrides are scanned for the Python
# values they read (guards), exactly as a plain step function's own code is.
_MODULE_HOOKS = ("training_step", "optimizer_step", "optimizer_zero_grad", "backward", "on_before_backward",
                 "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
                 "configure_gradient_clipping", "manual_backward", "clip_gradients")
_CALLBACK_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")
# Arguments that take a new value at every batch: a hook that reads one cannot be replayed.
_PER_BATCH_ARGS = {"training_step": (1, "batch_idx"), "optimizer_step": (0, "epoch", "batch_idx"),
                   "optimizer_zero_grad": (0, "epoch", "batch_idx")}


class _Ctx:
    """What the captured function reads per call (slots: stepgraph's state discovery does not
    walk it; model and optimizers are passed as ``state``)."""
    __slots__ = ("trainer", "module", "loop", "batch_idx", "optimizer", "pass_idx", "effects", "values",
                 "sched_start", "warn")


class _GroupRead:
    """A logged optimizer hyper-parameter: which group entry, and whether eager logged it before
    or after the schedulers stepped inside the step (None: neither; the value of this call's
    Python, kept)."""

    def __init__(self, slot, value, epochs):
        # (``float.__float__``: during a capture the group holds a tracing float; a plain
        # ``float()`` of it would count as reading it on the host)
        self.slot, self.value, self.at_log, self.when = slot, float.__float__(value), epochs, None

    def settle(self, start, end, warn, values=(None, None)) -> None:
        """``values``: the group entry's value before the step and after it. The lr a user's
        ``optimizer_step`` sets before ``optimizer.step(closure)`` (Lightning's warm-up recipe) is
        logged by training_step after it was set: read after the call, not before (the logger
        got the previous step's lr)."""
        v0, v1 = values
        if v0 != v1 and self.value in (v0, v1):
            self.when = "before" if self.value == v0 else "after"
            return
        self.when = "before" if self.at_log == start else "after" if self.at_log == end else None
        if self.when is None:
            warn(f"stepgraph: a hyper-parameter logged between two scheduler steps inside the training step "
                 f"(param_groups[{self.slot[1]}]['{self.slot[2]}']): replays log the captured value")

    def read(self, trainer, before):
        oi, gi, k = self.slot
        if self.when == "before":
            return before[oi][gi][k]
        if self.when == "after":
            return trainer.optimizers[oi].param_groups[gi][k]
        return self.value


def _group_slot(trainer, value):
    for oi, opt in enumerate(trainer.optimizers):
        for gi, g in enumerate(opt.param_groups):
            for k, v in g.items():
                if isinstance(v, float) and v is value:
                    return oi, gi, k
    return None


def _group_values(trainer) -> list:
    return [[{k: v for k, v in g.items() if isinstance(v, float)} for g in opt.param_groups]
            for opt in trainer.optimizers]


def _scheduler_epochs(trainer) -> tuple:
    return tuple(getattr(c.scheduler, "last_epoch", None) for c in trainer.lr_scheduler_configs)


def _odd_kwargs(kwargs) -> str | None:
    if "batch" not in kwargs or set(kwargs) - {"batch", "batch_idx"}:
        return f"training_step takes {list(kwargs)} (stepgraph captures training_step(batch[, batch_idx]))"
    return None


def _has_varargs(f) -> bool:
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in inspect.signature(f).parameters.values())


def _is_metric(m) -> bool:
    return any(c.__module__.startswith("torchmetrics") and c.__name__ == "Metric" for c in type(m).__mro__) \
        and hasattr(m, "_update_count")


def _user_calls(trainer, module) -> list:
    """(function, {parameter: object}) of the user code the captured step runs."""
    out = []
    for name in _MODULE_HOOKS:
        f = getattr(module, name, None)
        if f is not None and user_function(f):
            out.append((f, {}))
    for cb in trainer.callbacks:
        for name in _CALLBACK_HOOKS:
            f = getattr(cb, name, None)
            if f is not None and user_function(f):
                params = list(inspect.signature(f).parameters)
                binds = dict(zip(params[:2], (trainer, module)))
                out.append((f, binds))
    return out


def _begin(ctx):
    entry = ctx.effects.begin()
    ctx.values = []
    ctx.sched_start = _scheduler_epochs(ctx.trainer), _group_floats(ctx.trainer)
    return entry


def _group_floats(trainer) -> list:
    # (``float.__float__``: while tracing, a group may hold a tracing float)
    return [[{k: float.__float__(v) for k, v in g.items() if isinstance(v, float)} for g in opt.param_groups]
            for opt in trainer.optimizers]


def _end(ctx, out):
    end, after = _scheduler_epochs(ctx.trainer), _group_floats(ctx.trainer)
    start, before = ctx.sched_start
    for *_, obj in ctx.effects.current["logs"]:
        if isinstance(obj, _GroupRead):
            oi, gi, k = obj.slot
            obj.settle(start, end, ctx.warn, (before[oi][gi].get(k), after[oi][gi].get(k)))
    values, ctx.values = ctx.values, None
    return out, ctx.effects.end(), values


def settings(trainer) -> tuple:
    """The Trainer's numbers Lightning's code reads in the step (the loss divided by
    ``accumulate_grad_batches``; clipping by ``gradient_clip_val`` and its algorithm), passed as an
    argument: a callback changing them (GradientAccumulationScheduler) is a capture for the new
    values. Lightning's code is not scanned: a replay kept the captured ones, silently. As text:
    a number argument the graph does not read would be no key (as hf._settings)."""
    return (f"accumulate_grad_batches={trainer.accumulate_grad_batches!r}",
            f"gradient_clip_val={trainer.gradient_clip_val!r}",
            f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}")


def _automatic_core(ctx: _Ctx):
    """One batch of Lightning's automatic optimization, without the loop's progress counters."""
    def lightning_training_step(batch, zero_first: bool, step_now: bool, settings: tuple):
        trainer, loop = ctx.trainer, ctx.loop
        optimizer, batch_idx = ctx.optimizer, ctx.batch_idx
        _begin(ctx)
        try:
            kwargs = OrderedDict(batch=batch)
            if ctx.pass_idx:
                kwargs["batch_idx"] = batch_idx

            def zero_grad():
                call._call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
                call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer)
                call._call_lightning_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx,
                                                 optimizer)
            closure = Closure(step_fn=partial(loop._training_step, kwargs), backward_fn=loop._make_backward_fn(optimizer),
                              zero_grad_fn=zero_grad if zero_first else None)
            if step_now:
                call._call_lightning_module_hook(trainer, "optimizer_step", trainer.current_epoch, batch_idx,
                                                 trainer.strategy._lightning_optimizers[0], closure)
            else:
                with _block_parallel_sync_behavior(trainer.strategy, block=True):
                    closure()
            result = closure.consume_result()
            out = {} if result.loss is None else result.asdict()
        except BaseException:
            ctx.effects.current, ctx.values = None, None
            raise
        return _end(ctx, out)
    return lightning_training_step


def _manual_core(ctx: _Ctx):
    """One batch of Lightning's manual optimization; ``opt.step()`` calls are recorded so the
    loop's counters advance after every call."""
    def lightning_training_step(batch):
        trainer = ctx.trainer
        entry = _begin(ctx)
        los = trainer.strategy._lightning_optimizers
        saved = [(lo._on_before_step, lo._on_after_step) for lo in los]
        try:
            for i, lo in enumerate(los):
                lo._on_before_step = partial(entry["calls"].append, (i, 0))
                lo._on_after_step = partial(entry["calls"].append, (i, 1))
            kwargs = OrderedDict(batch=batch)
            if ctx.pass_idx:
                kwargs["batch_idx"] = ctx.batch_idx
            output = call._call_strategy_hook(trainer, "training_step", *kwargs.values())
            trainer.strategy.post_training_step()
            out = ManualResult.from_training_step_output(output).asdict()
        except BaseException:
            ctx.effects.current, ctx.values = None, None
            raise
        finally:
            for lo, (before, after) in zip(los, saved):
                lo._on_before_step, lo._on_after_step = before, after
        return _end(ctx, out)
    return lightning_training_step
