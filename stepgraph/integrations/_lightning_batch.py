"""Each training batch under a ``StepGraphCallback`` (a mixin of it): Lightning's automatic
``run`` and manual ``advance`` replaced by a call of the step function, then the Python effects
a replay must still make (progress counters, ``self.log`` calls, the optimizers' step hooks)."""
from __future__ import annotations

from ._lightning_core import _GroupRead, _group_values, _odd_kwargs, settings


class BatchRunner:
    def _eager(self, reason: str | None) -> bool:
        """Whether this batch runs Lightning's own (eager) code."""
        if self.eager_reason is not None:
            return True
        if reason is not None:
            self._warn(f"stepgraph: {reason}; those batches run eagerly")
            return True
        return False

    def _run_automatic(self, optimizer, batch_idx, kwargs):
        ctx = self._ctx
        loop, trainer = ctx.loop, ctx.trainer
        skip = "a callback asked to skip backward (e.g. StochasticWeightAveraging)" if loop._skip_backward else None
        if self._eager(skip or _odd_kwargs(kwargs)):
            return type(loop).run(loop, optimizer, batch_idx, kwargs)
        step_now = trainer.strategy.handles_gradient_accumulation or not trainer.fit_loop._should_accumulate()
        zero_first = batch_idx % trainer.accumulate_grad_batches == 0
        progress = loop.optim_progress.optimizer
        if step_now:
            progress.step.increment_ready()
        if zero_first:
            progress.zero_grad.increment_ready()
            progress.zero_grad.increment_started()
        ctx.batch_idx, ctx.optimizer, ctx.pass_idx = batch_idx, optimizer, "batch_idx" in kwargs
        out, _ = self._call(kwargs["batch"], zero_first, step_now, settings(trainer))
        if zero_first:
            progress.zero_grad.increment_completed()
        if step_now:
            progress.step.increment_completed()
        return out

    def _advance_manual(self, kwargs) -> None:
        ctx = self._ctx
        loop = ctx.loop
        if self._eager(_odd_kwargs(kwargs)):
            return type(loop).advance(loop, kwargs)
        los = ctx.trainer.strategy._lightning_optimizers
        hooks = [(lo._on_before_step, lo._on_after_step) for lo in los]
        ctx.batch_idx, ctx.pass_idx = kwargs.get("batch_idx"), "batch_idx" in kwargs
        out, entry = self._call(kwargs["batch"])
        for i, after in entry["calls"]:  # the loop's progress counters, once per opt.step() made
            hooks[i][after]()
        loop._output = out

    def _call(self, batch, *flags):
        """Run the step function (eager, capture or replay); make its Python effects."""
        ctx, step = self._ctx, self.step_function
        st = step.stats
        before = (st.eager_calls, st.captures, st.failed_captures)
        counts = [int(m._update_count) for m in self._metrics]
        groups_before = _group_values(ctx.trainer)
        out, key, values = step(batch, *flags)
        entry = ctx.effects.get(key)
        ran_python = (st.eager_calls, st.captures, st.failed_captures) != before
        if ran_python:
            changed = [type(m).__name__ for m, c in zip(self._metrics, counts) if int(m._update_count) != c]
            if changed:
                self.eager_reason = f"torchmetrics {', '.join(changed)} updated inside the training step"
                self._warn(f"stepgraph: {self.eager_reason}: a metric's state is Python (counters, reassigned "
                           "tensors) that a replay cannot update; the training step runs eagerly from now on "
                           "(or update metrics in on_train_batch_end from the step's outputs)")
        module = ctx.module
        for fx, name, args, kwargs, index, obj in entry["logs"]:
            if isinstance(obj, _GroupRead):
                value = obj.read(ctx.trainer, groups_before)
            else:
                value = values[index] if index is not None else obj
            prev, module._current_fx_name = module._current_fx_name, fx
            try:
                self._real_log(name, value, *args, **kwargs)
            finally:
                module._current_fx_name = prev
        if ran_python and st.captures == before[1]:
            ctx.effects.forget(key)  # an eager call's entry (a graph's is used by its replays)
        return out, entry
