"""What a ``StepGraphCallback`` refuses before installing: strategies it does not capture, Lightning
versions without the loop pieces it rebuilds, hooks that read a per-batch argument."""
from __future__ import annotations

import inspect

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from ._common import reads_parameter, user_function
from ._lightning_core import _PER_BATCH_ARGS, _has_varargs


def unsupported(trainer, module) -> str | None:
    """Why this fit's training step cannot be captured (then it runs eagerly), or None."""
    strategy = trainer.strategy
    if type(strategy) not in (SingleDeviceStrategy, DDPStrategy):
        return (f"the Lightning strategy {type(strategy).__name__} is not captured (single-device and DDP "
                "steps are)")
    if strategy.handles_gradient_accumulation:
        return f"the strategy {type(strategy).__name__} accumulates gradients itself"
    loop = trainer.fit_loop.epoch_loop
    for name in ("automatic_optimization", "manual_optimization"):
        if not hasattr(loop, name):
            return f"this Lightning version ({pl.__version__}) has no fit_loop.epoch_loop.{name}"
    auto = loop.automatic_optimization
    for obj, name in ((auto, "_training_step"), (auto, "_make_backward_fn"), (auto, "optim_progress"),
                      (trainer.fit_loop, "_should_accumulate"), (strategy, "_lightning_optimizers")):
        if not hasattr(obj, name):
            return f"this Lightning version ({pl.__version__}) has no {type(obj).__name__}.{name}"
    for hook, spec in _PER_BATCH_ARGS.items():
        if not module.automatic_optimization and hook != "training_step":
            continue
        f = getattr(type(module), hook, None)
        if f is None or not user_function(f):
            continue
        params = list(inspect.signature(f).parameters)[1:]
        first, names = spec[0], spec[1:]
        for i, name in enumerate(names):
            pos = first + i
            pname = params[pos] if pos < len(params) else name
            if hook == "training_step" and pos >= len(params) and not _has_varargs(f):
                continue  # training_step(self, batch): Lightning passes no batch_idx
            if reads_parameter(f, pname):
                return (f"{type(module).__name__}.{hook} reads its '{pname}' argument, which has a new value at "
                        f"every batch: a replayed graph would keep the captured value (use it outside the "
                        f"step, e.g. in on_train_batch_start, or drop it from {hook})")
    ts = getattr(type(module), "training_step", None)
    if ts is not None and "dataloader_iter" in inspect.signature(ts).parameters:
        return "training_step(dataloader_iter) fetches its own batches inside the step"
    return None
