"""Hugging Face: ``StepGraphTrainer`` captures the training step of ``Trainer.train()``;
``accelerate_step`` captures the step of a plain Accelerate loop.

    from stepgraph.integrations.hf import StepGraphTrainer

    trainer = StepGraphTrainer(model=model, args=TrainingArguments(..., bf16=True,
                               gradient_accumulation_steps=4), train_dataset=ds, eval_dataset=ev)
    trainer.train()
    print(trainer.stepgraph_stats)      # eager_calls=4 captures=2 replays=...

**Why a Trainer subclass** (``StepGraphTrainerMixin`` for your own Trainer subclasses:
``class MyTrainer(StepGraphTrainerMixin, SFTTrainer)``): a ``TrainerCallback`` only observes
the loop (its hooks get ``args, state, control``), it cannot run the step; ``training_step`` is
the method the Trainer documents for overriding what one micro-batch does.

**What is captured**, per micro-batch: ``training_step`` (``compute_loss``: the model's forward
under Accelerate's autocast, the loss, its division for gradient accumulation, backward through
``accelerator.backward``), and at the micro-batch that ends an accumulation window: gradient
clipping and the gradient norm (``max_grad_norm``), ``optimizer.step()`` and ``model.zero_grad()``.
The Trainer's loop around it is unchanged and runs every micro-batch: the loss accumulation and
its NaN/inf filter, ``lr_scheduler.step()`` (the new ``lr`` is read live by the next replay),
callbacks, logging (``loss``, ``grad_norm``, ``learning_rate``), evaluation and checkpoints. After
a captured optimizer step the loop's own ``_clip_grad_norm`` returns the norm the graph computed
and its ``optimizer.step()`` call is skipped once (the graph made it). A micro-batch that starts,
continues or ends an accumulation window is its own graph.

**Fallbacks, each said once in a warning naming the feature**: a callback implementing
``on_pre_optimizer_step``/``on_optimizer_step`` (it runs between backward and the optimizer step)
and fp16 with a GradScaler keep clipping and the optimizer step eager (forward and backward stay
captured); DeepSpeed, FSDP, XLA, SageMaker MP and context parallelism run the step eagerly.
Anything stepgraph refuses (``stepgraph.CaptureError``) runs eagerly from then on, with the
reason in the warning.
"""
from __future__ import annotations


try:
    import transformers
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("stepgraph.integrations.hf needs transformers: pip install 'stepgraph[hf]'") from e

import torch

from ..runtime import StepFunction
from ._common import Effects, Once, overrides, user_function

__all__ = ["StepGraphTrainerMixin", "StepGraphTrainer", "accelerate_step"]

_OPT_HOOKS = ("on_pre_optimizer_step", "on_optimizer_step")
_NONE = object()


class _Ctx:
    """What the captured function reads per call (slots: not walked by state discovery)."""
    __slots__ = ("trainer", "model", "warn")


def _inner_optimizer(opt):
    while hasattr(opt, "optimizer") and isinstance(getattr(opt, "optimizer"), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


class StepGraphTrainerMixin:
    """Put before a ``transformers.Trainer`` (sub)class to capture its training step.

    Keyword argument ``stepgraph``: options for :func:`stepgraph.compile` (``backend``,
    ``max_captures``, ``check``, ``host_reads``, ``on_capture_error``; the default
    ``on_capture_error="eager"`` turns a refused step into eager calls with one warning).
    """

    def __init__(self, *args, stepgraph: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stepgraph_options = dict(dict(on_capture_error="eager"), **(stepgraph or {}))
        self.stepgraph_step: StepFunction | None = None
        self.stepgraph_eager_reason: str | None = None
        self._sg_warn = Once()
        self._sg_norm = None      # the grad norm of the graph's optimizer step, for the loop's calls
        self._sg_pending = False  # the loop's next optimizer.step() is the graph's, already made
        self._sg_saved_step = _NONE
        self._sg_split = None     # why clipping + optimizer step stay eager (None: captured)

    @property
    def stepgraph_stats(self):
        """The captured step's ``stepgraph.Stats`` (None before the first training step)."""
        return self.stepgraph_step.stats if self.stepgraph_step is not None else None

    # ---- Trainer methods -----------------------------------------------------------------
    def train(self, *args, **kwargs):
        self.stepgraph_step, self._sg_norm, self._sg_pending = None, None, False
        try:
            return super().train(*args, **kwargs)
        finally:
            self._sg_unskip()

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._sg_unskip()  # (a leftover from an interrupted window)
        if self.stepgraph_step is None and self.stepgraph_eager_reason is None:
            self._sg_setup(model)
        if self.stepgraph_eager_reason is not None:
            return super().training_step(model, inputs, num_items_in_batch)
        # Modes are set outside the graph: a replay runs no Python, so ``model.train()`` inside
        # it would not undo an evaluation's ``model.eval()``.
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        sync = bool(self.accelerator.sync_gradients)
        full = sync and self._sg_split is None
        out = self.stepgraph_step(inputs, num_items_in_batch, int(self.current_gradient_accumulation_steps),
                                  sync, full, _settings(self))
        if not full:
            return out
        loss, self._sg_norm = out
        self._sg_pending = True
        opt = self.optimizer
        # The loop's next ``optimizer.step()`` is the one the graph made: skipped once. (An LR
        # scheduler has usually put its own counting wrapper on the instance: kept, restored.)
        self._sg_saved_step = opt.__dict__.get("step", _NONE)

        def graph_made_this_step(*a, **k):
            if getattr(self._sg_saved_step, "_wrapped_by_lr_sched", False):
                opt._opt_called = True  # what the scheduler's wrapper records
            self._sg_unskip()
        opt.step = graph_made_this_step
        return loss

    def _clip_grad_norm(self, model):
        if self._sg_pending:
            return self._sg_norm
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self._sg_pending:
            return self._sg_norm
        return super()._get_grad_norm(model, grad_norm)

    # ---- internals -----------------------------------------------------------------------
    def _sg_unskip(self) -> None:
        if self._sg_pending:
            opt = self.optimizer
            if self._sg_saved_step is _NONE:
                opt.__dict__.pop("step", None)
            else:
                opt.step = self._sg_saved_step
        self._sg_pending = False

    def _sg_unsupported(self) -> str | None:
        if getattr(self, "is_deepspeed_enabled", False):
            return "DeepSpeed runs its own engine step"
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_fsdp_xla_enabled", False):
            return "FSDP is not captured"
        if getattr(self, "is_distributed_loading_by_transformers", False):
            return "a model sharded at load time is not captured"
        if getattr(self.accelerator, "parallelism_config", None) is not None:
            return "context/sequence parallelism is not captured"
        from transformers.trainer import is_sagemaker_mp_enabled, is_torch_xla_available
        if is_sagemaker_mp_enabled() or is_torch_xla_available():
            return "SageMaker MP / XLA is not captured"
        return None

    def _sg_setup(self, model) -> None:
        reason = self._sg_unsupported()
        if reason is not None:
            self.stepgraph_eager_reason = reason
            self._sg_warn(f"stepgraph: {reason}; the training step runs eagerly (the rest of train() is unchanged)")
            return
        split = [type(cb).__name__ + "." + h for cb in self.callback_handler.callbacks for h in _OPT_HOOKS
                 if overrides(cb, h, TrainerCallback)]
        if not all(hasattr(Trainer, n) for n in ("_clip_grad_norm", "_get_grad_norm")):
            self._sg_split = f"this transformers version ({transformers.__version__}) clips inside its loop"
        elif split:
            self._sg_split = f"callback {', '.join(split)} runs between backward and the optimizer step"
        elif getattr(self.accelerator, "scaler", None) is not None:
            self._sg_split = "fp16's GradScaler decides on the host whether the optimizer steps"
        if self._sg_split:
            self._sg_warn(f"stepgraph: {self._sg_split}: gradient clipping and the optimizer step run eagerly "
                          "(forward and backward are captured)")
        ctx = _Ctx()
        ctx.trainer, ctx.model, ctx.warn = self, model, self._sg_warn
        core = _trainer_core(ctx, super(StepGraphTrainerMixin, self).training_step)
        core._stepgraph_user_calls = [(f, {}) for f in (getattr(self, "compute_loss", None),
                                                         getattr(self, "compute_loss_func", None))
                                      if f is not None and user_function(f)]
        state = [("model", model), ("optimizer", _inner_optimizer(self.optimizer))]
        warmup = max(1, int(self.args.gradient_accumulation_steps))  # one whole window eagerly
        self.stepgraph_step = StepFunction(core, warmup=warmup, state=state, **self.stepgraph_options)


class StepGraphTrainer(StepGraphTrainerMixin, Trainer):
    """``transformers.Trainer`` whose training step is captured by stepgraph (see the module
    docstring); ``stepgraph={...}`` passes options to :func:`stepgraph.compile`."""


def _settings(trainer) -> tuple:
    """The Trainer's numbers its library code reads in the step -- its arguments' (``max_grad_norm``)
    and its label smoother's (``epsilon``, a callback may anneal it) -- passed as an argument, so a
    change is a capture for the new value (the code reading them is transformers', which stepgraph
    does not scan: a replay kept the captured value, silently). As text: a number argument the
    graph does not read would be no key."""
    out = {k: v for k, v in vars(trainer.args).items() if type(v) in (int, float, bool)}
    ls = getattr(trainer, "label_smoother", None)
    out.update({f"label_smoother.{k}": v for k, v in vars(ls).items() if type(v) in (int, float, bool)} if ls else {})
    return tuple(f"{k}={v!r}" for k, v in sorted(out.items()))


def _trainer_core(ctx: _Ctx, training_step):
    def hf_training_step(inputs, num_items_in_batch, accumulation_steps: int, sync: bool, full: bool, settings: tuple):
        trainer, model = ctx.trainer, ctx.model
        loss = training_step(model, inputs, num_items_in_batch)
        if not full:
            return loss
        # The loop's order at the end of a window: clip (norm), optimizer step, zero_grad.
        grad_norm = None
        if trainer.args.max_grad_norm > 0:
            grad_norm = Trainer._clip_grad_norm(trainer, model)
        grad_norm = Trainer._get_grad_norm(trainer, model, grad_norm=grad_norm)
        trainer.optimizer.step()
        model.zero_grad()
        return loss, grad_norm
    hf_training_step.__qualname__ = "Trainer.training_step (stepgraph)"
    return hf_training_step


# ---- Accelerate ------------------------------------------------------------------------------
class _AccCtx:
    __slots__ = ("accelerator", "effects")


def accelerate_step(accelerator, fn=None, **compile_kwargs):
    """Capture the step function of an Accelerate training loop::

        accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
        model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)

        @accelerate_step(accelerator)
        def train_step(batch):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            return loss

        for batch in dl:
            with accelerator.accumulate(model):   # around the call, not inside the step
                loss = train_step(batch)

    ``accelerator.sync_gradients`` is part of the guard signature (accumulating and syncing calls
    are different graphs). ``AcceleratedScheduler.step()`` steps where it is called on a
    syncing call without a GradScaler; otherwise (it decides on the host whether the optimizer
    stepped, or counts an accumulating call) it runs as Python right after the step. Options
    are :func:`stepgraph.compile`'s (``on_capture_error`` defaults to ``"eager"``); the returned
    callable has ``.step_function`` and ``.stats``.
    """
    compile_kwargs.setdefault("on_capture_error", "eager")

    def wrap(f):
        from accelerate.scheduler import AcceleratedScheduler
        ctx = _AccCtx()
        ctx.accelerator, ctx.effects = accelerator, Effects("accelerate")
        warn = Once()

        def core(sync: bool, *args, **kwargs):
            entry = ctx.effects.begin()
            orig = AcceleratedScheduler.step

            def deferred(sched, *a, **k):
                if sync and getattr(accelerator, "scaler", None) is None:
                    # (nothing for it to decide on the host: it steps where it is called, its inner
                    # scheduler re-run after each replay as in any step; deferred, what the step read
                    # after it -- get_last_lr(), an opt.step() after it -- was a schedule step behind)
                    return orig(sched, *a, **k)
                if any(isinstance(x, torch.Tensor) for x in list(a) + list(k.values())):
                    warn("stepgraph: AcceleratedScheduler.step(tensor) inside the step: the scheduler gets the "
                         "tensor of the call that ran Python; pass a number or step it outside")
                entry["calls"].append((sched, a, k))
            AcceleratedScheduler.step = deferred
            try:
                out = f(*args, **kwargs)
            except BaseException:
                ctx.effects.current = None
                raise
            finally:
                AcceleratedScheduler.step = orig
            return out, ctx.effects.end()
        core.__name__ = core.__qualname__ = getattr(f, "__name__", "accelerate_step")
        core._stepgraph_user_calls = [(f, {})]
        state = [(f"model{i}", m) for i, m in enumerate(accelerator._models)]
        state += [(f"optimizer{i}", _inner_optimizer(o)) for i, o in enumerate(accelerator._optimizers)]
        warmup = max(1, int(accelerator.gradient_accumulation_steps))
        sf = StepFunction(core, warmup=warmup, state=state, **compile_kwargs)
        eager = []

        def step(*args, **kwargs):
            if eager:
                return f(*args, **kwargs)
            st = sf.stats
            before = (st.eager_calls, st.captures, st.failed_captures)
            counter = getattr(accelerator, "step", None)
            out, key = sf(bool(accelerator.sync_gradients), *args, **kwargs)
            entry = ctx.effects.get(key)
            for sched, a, k in entry["calls"]:
                AcceleratedScheduler.step(sched, *a, **k)
            ran_python = (st.eager_calls, st.captures, st.failed_captures) != before
            if ran_python and getattr(accelerator, "step", None) != counter:
                eager.append(True)
                warn("stepgraph: the step enters accelerator.accumulate() itself (its counter is Python a replay "
                     "cannot advance); it runs eagerly from now on: put `with accelerator.accumulate(model):` "
                     "around the call")
            if ran_python and st.captures == before[1]:
                ctx.effects.forget(key)
            return out
        step.step_function = sf
        step.stats = sf.stats
        step.__wrapped__ = f
        step.__name__ = getattr(f, "__name__", "accelerate_step")
        return step
    return wrap(fn) if fn is not None else wrap


