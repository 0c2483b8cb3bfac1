"""Issue 18, Lightning: ``StepGraphCallback`` against the same Trainer run without it.

Each test fits the same model (same seed, same batches) twice — with the callback and without —
and compares, bitwise on the CPU: the loss of every batch, every metric the logger receives
(``self.log`` of tensors and of the lr, on_step and on_epoch), the parameters, the optimizer
state and the checkpoints. The stats assert that the step really was captured and replayed (a
silent eager fallback fails them). Skipped when Lightning is not installed.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

from stepgraph.integrations.lightning import StepGraphCallback  # noqa: E402

BATCHES, B, D, C = 20, 8, 8, 4  # 20 training batches of 8 per epoch


def dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, D, generator=g), torch.randint(0, C, (n,), generator=g))


TRAIN, VAL = dataset(BATCHES * B, 1), dataset(3 * B, 2)


def loaders():
    return (torch.utils.data.DataLoader(TRAIN, batch_size=B), torch.utils.data.DataLoader(VAL, batch_size=B))


class Classifier(L.LightningModule):
    """Dropout (the RNG must advance as in eager), LayerNorm, AdamW, a per-step StepLR; logs the
    loss on step and epoch, and the lr."""

    def __init__(self, manual=False):
        super().__init__()
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(32), nn.Linear(32, C))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if not self.automatic_optimization:
            opt, sched = self.optimizers(), self.lr_schedulers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            sched.step()
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"], on_step=True)
        return {"loss": loss, "logits_mean": self.net[-1].bias.detach().mean()}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class MemoryLogger(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


class Losses(L.Callback):
    """The loss curve: the step output of every batch."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())


def fit(model, root, *, stepgraph: bool, epochs: int, ckpt_path=None, accelerator="cpu", **trainer_kw):
    losses, logger = Losses(), MemoryLogger()
    cb = StepGraphCallback() if stepgraph else None
    trainer = L.Trainer(max_epochs=epochs, callbacks=[losses] + ([cb] if cb else []), logger=logger,
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                        accelerator=accelerator, devices=1, **trainer_kw)
    train, val = loaders()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train, val, ckpt_path=ckpt_path)
    notes = [str(w.message) for w in caught if "stepgraph" in str(w.message)]
    return trainer, cb, losses.losses, logger.rows, notes


def new_model(manual=False):
    torch.manual_seed(0)
    return Classifier(manual)


def assert_same_tensors(a, b, what):
    assert len(a) == len(b), f"{what}: {len(a)} != {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}[{i}] differs: {x} vs {y}"


def assert_same_state(m1, m2, t1, t2):
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), f"parameter {n} differs from eager"
    for o1, o2 in zip(t1.optimizers, t2.optimizers):
        for s1, s2 in zip(o1.state.values(), o2.state.values()):
            for k in s1:
                assert torch.equal(s1[k], s2[k]), f"optimizer state {k} differs"
        assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"]


def graph_dtypes(step):
    return {n.meta["val"].dtype for g in step.graphs for n in g.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


def test_automatic_bf16_accumulation_clipping_scheduler_eval_checkpoint_resume(tmp_path):
    """Fit 1 epoch (20 batches, accumulate 2: 10 optimizer steps, StepLR every 4, validation
    twice), save a checkpoint, resume in a new Trainer with a new model for a second epoch (10
    more steps, validation twice). Losses, logged metrics, parameters, optimizer state and the
    checkpoint equal the run without stepgraph bit for bit."""
    kw = dict(precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.5, val_check_interval=0.5)
    runs = {}
    for sg in (True, False):
        root = tmp_path / ("sg" if sg else "eager")
        m = new_model()
        t, cb, losses, rows, notes = fit(m, root, stepgraph=sg, epochs=1, **kw)
        ckpt = root / "epoch1.ckpt"
        t.save_checkpoint(ckpt)
        m2 = new_model()  # fresh weights: everything comes from the checkpoint
        t2, cb2, losses2, rows2, notes2 = fit(m2, root, stepgraph=sg, epochs=2, ckpt_path=ckpt, **kw)
        runs[sg] = dict(m=m, t=t, cb=cb, losses=losses, rows=rows, notes=notes + notes2, ckpt=torch.load(
            ckpt, weights_only=False), m2=m2, t2=t2, cb2=cb2, losses2=losses2, rows2=rows2)
    sg, ref = runs[True], runs[False]
    assert sg["notes"] == [], sg["notes"]
    assert len(sg["losses"]) == len(sg["losses2"]) == BATCHES
    assert sg["t2"].global_step == ref["t2"].global_step == BATCHES  # 20 optimizer steps in all
    assert_same_tensors(sg["losses"] + sg["losses2"], ref["losses"] + ref["losses2"], "loss per batch")
    assert sg["rows"] == ref["rows"] and sg["rows2"] == ref["rows2"]  # every logged metric, every step
    logged = {k for _, r in sg["rows"] + sg["rows2"] for k in r}
    assert {"train_loss_step", "train_loss_epoch", "lr", "val_loss"} <= logged, logged
    assert len({r["lr"] for _, r in sg["rows"] + sg["rows2"] if "lr" in r}) >= 4  # the schedule moved
    assert_same_state(sg["m"], ref["m"], sg["t"], ref["t"])
    assert_same_state(sg["m2"], ref["m2"], sg["t2"], ref["t2"])
    for k, v in ref["ckpt"]["state_dict"].items():
        assert torch.equal(sg["ckpt"]["state_dict"][k], v), k
    for cb in (sg["cb"], sg["cb2"]):  # captured and replayed, in both fits
        st = cb.stats
        assert st.eager_calls == 2 and st.failed_captures == 0, st  # one accumulation window of warm-up
        assert 2 <= st.captures <= 3, st  # first / last batch of a window (+ the first after an epoch start)
        assert st.replays == BATCHES - st.eager_calls - st.captures, st
        assert torch.bfloat16 in graph_dtypes(cb.step_function)  # autocast is inside the graphs


def test_manual_optimization(tmp_path):
    """Manual optimization: zero_grad, manual_backward, clip_gradients, opt.step() and a scheduler
    step inside training_step, 2 epochs (40 steps); the lr logged after the scheduler step."""
    runs = {}
    for sg in (True, False):
        m = new_model(manual=True)
        runs[sg] = (m,) + fit(m, tmp_path / str(sg), stepgraph=sg, epochs=2)
    (m1, t1, cb, l1, r1, n1), (m2, t2, _, l2, r2, _) = runs[True], runs[False]
    assert n1 == [], n1
    assert t1.global_step == t2.global_step == 2 * BATCHES  # the loop's counters advanced at replays
    assert_same_tensors(l1, l2, "loss per batch")
    assert r1 == r2
    assert_same_state(m1, m2, t1, t2)
    st = cb.stats  # (a second graph: after validation zeroes the grads, the first batch finds none)
    assert st.eager_calls == 1 and st.captures <= 2 and st.replays == 2 * BATCHES - 1 - st.captures, st


def test_16_mixed_grad_scaler_skips_inf_steps_like_eager(tmp_path):
    """``16-mixed`` with its GradScaler (the GPU configuration; on the CPU through the plugin,
    as Lightning's ``precision='16-mixed'`` switches to bf16 there). Batch 7 overflows in fp16:
    the scaler skips that optimizer step and backs off, as in eager; the found-inf read is a
    value guard of the graph."""
    data = TRAIN.tensors[0].clone()
    data[7 * B] = 1e6  # fp16 overflow in the forward of batch 7
    bad = torch.utils.data.TensorDataset(data, TRAIN.tensors[1])
    runs = {}
    for sg in (True, False):
        m = new_model()
        cb = StepGraphCallback() if sg else None
        losses = Losses()
        t = L.Trainer(max_epochs=1, callbacks=[losses] + ([cb] if cb else []), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      plugins=[MixedPrecision("16-mixed", "cpu")], gradient_clip_val=1.0, accelerator="cpu",
                      default_root_dir=tmp_path)
        t.fit(m, torch.utils.data.DataLoader(bad, batch_size=B))
        runs[sg] = (m, t, cb, losses.losses, t.precision_plugin.scaler.get_scale())
    (m1, t1, cb, l1, s1), (m2, t2, _, l2, s2) = runs[True], runs[False]
    assert s1 == s2 < 2.0 ** 16  # backed off at the overflow
    assert [bool(torch.isfinite(x)) for x in l1] == [bool(torch.isfinite(x)) for x in l2]
    assert_same_tensors([x.nan_to_num() for x in l1], [x.nan_to_num() for x in l2], "loss per batch")
    assert_same_state(m1, m2, t1, t2)
    st = cb.stats  # the overflow call missed the found-inf guard and was captured for that value
    assert sum(st.guard_misses.values()) == 1 and st.captures == 2 and st.replays == BATCHES - 3, st


class ReadsBatchIdx(Classifier):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return out["loss"] * (1.0 if batch_idx % 2 else 1.0)


class UpdatesMetric(Classifier):
    def __init__(self):
        super().__init__()
        import torchmetrics
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=C)

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, None)
        self.acc(self.net(batch[0]).argmax(-1), batch[1])
        return out


@pytest.mark.parametrize("cls, feature", [(ReadsBatchIdx, "batch_idx"), (UpdatesMetric, "MulticlassAccuracy")])
def test_uncapturable_feature_is_warned_once_and_runs_eagerly(tmp_path, cls, feature):
    """A training_step that reads batch_idx (a new value every batch), or updates a torchmetrics
    Metric (Python state): one warning naming it, and the training step runs as eager does."""
    runs = {}
    for sg in (True, False):
        torch.manual_seed(0)
        m = cls()
        runs[sg] = (m,) + fit(m, tmp_path / str(sg), stepgraph=sg, epochs=1)
    (m1, t1, cb, l1, r1, notes), (m2, t2, _, l2, r2, _) = runs[True], runs[False]
    assert len(notes) == 1 and feature in notes[0] and "eager" in notes[0], notes
    assert_same_tensors(l1, l2, "loss per batch")
    assert r1 == r2
    assert_same_state(m1, m2, t1, t2)
    assert cb.stats is None or cb.stats.captures == 0, cb.stats


def test_callback_hooks_and_logging_from_hooks_are_captured(tmp_path):
    """A user callback's on_before_optimizer_step logs the gradient norm through pl_module.log
    (the pattern of Lightning's grad_norm utility): captured, and logged at every step."""
    from lightning.pytorch.utilities import grad_norm

    class GradNorm(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pl_module.log_dict(grad_norm(pl_module, norm_type=2))

    runs = {}
    for sg in (True, False):
        m = new_model()
        losses, logger = Losses(), MemoryLogger()
        cb = StepGraphCallback() if sg else None
        t = L.Trainer(max_epochs=1, callbacks=[GradNorm(), losses] + ([cb] if cb else []), logger=logger,
                      log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
        t.fit(m, loaders()[0])
        runs[sg] = (m, t, cb, losses.losses, logger.rows)
    (m1, t1, cb, l1, r1), (m2, t2, _, l2, r2) = runs[True], runs[False]
    assert_same_tensors(l1, l2, "loss per batch")
    for (s1, a), (s2, b) in zip(r1, r2):
        assert s1 == s2 and a == b, (s1, s2, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
    assert len(r1) == len(r2) and any("grad_2.0_norm_total" in r for _, r in r1), r1[:2]
    assert_same_state(m1, m2, t1, t2)
    assert (cb.stats.eager_calls, cb.stats.captures, cb.stats.replays) == (1, 1, BATCHES - 2), cb.stats


def test_import_does_not_need_lightning():
    """``import stepgraph`` never imports Lightning (an optional extra)."""
    import subprocess
    import sys
    code = ("import sys, stepgraph, stepgraph.integrations; "
            "assert 'lightning' not in sys.modules and 'transformers' not in sys.modules")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


class ClipAnneal(L.Callback):
    """A callback changing the Trainer's clipping value every epoch."""

    def on_train_epoch_start(self, trainer, pl_module):
        trainer.gradient_clip_val = 0.5 / (1 + trainer.current_epoch)


@pytest.mark.parametrize("changer", ["accumulation", "clipping"])
def test_a_callback_changing_the_trainers_accumulation_or_clipping_mid_fit(tmp_path, changer):
    """GradientAccumulationScheduler (2, then 4 from epoch 2) or a callback annealing
    ``gradient_clip_val``: Lightning's own code reads them in the step (the loss divided by
    ``accumulate_grad_batches``; the clipping), code stepgraph does not scan: replays kept the
    captured values -- twice eager's loss and grads after the switch, silently (helper-92)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    runs = {}
    for sg in (True, False):
        m = new_model()
        kw = dict(callbacks=[GradientAccumulationScheduler({0: 2, 2: 4})]) if changer == "accumulation" \
            else dict(callbacks=[ClipAnneal()], gradient_clip_val=0.5)
        losses, cb = Losses(), StepGraphCallback() if sg else None
        trainer = L.Trainer(max_epochs=3, callbacks=[losses] + kw.pop("callbacks") + ([cb] if cb else []),
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path / str(sg),
                            accelerator="cpu", devices=1, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(m, loaders()[0])
        runs[sg] = (m, trainer, losses.losses, cb)
    (m1, t1, l1, cb), (m2, t2, l2, _) = runs[True], runs[False]
    assert_same_tensors(l1, l2, "loss per batch")
    assert_same_state(m1, m2, t1, t2)
    assert cb.stats.replays >= BATCHES, cb.stats



try:
    import torchmetrics
    L_MEAN, L_CAT, L_MAX = torchmetrics.MeanMetric(), torchmetrics.CatMetric(), torchmetrics.MaxMetric()
except ImportError:
    torchmetrics = None


class UpdatesGlobalMetrics(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        L_MEAN.update(loss.detach())
        L_CAT.update(loss.detach())
        L_MAX.update(loss.detach())
        return loss


@pytest.mark.skipif(torchmetrics is None, reason="torchmetrics")
def test_module_level_metrics_updated_in_training_step_count_every_replay(tmp_path):
    """torchmetrics kept in module-level globals, updated in training_step (code the step calls
    as a user function): they were not found as state, so only one metric's Python
    ``_update_count`` advanced at replays (CatMetric 2 where eager counts 20), silently (helper-92 F7)."""
    seen = {}
    for sg in (True, False):
        for m in (L_MEAN, L_CAT, L_MAX):
            m.reset()
        torch.manual_seed(0)
        _, cb, *_ = fit(UpdatesGlobalMetrics(), tmp_path / str(sg), stepgraph=sg, epochs=1)
        seen[sg] = [(m._update_count, m.compute().clone()) for m in (L_MEAN, L_CAT, L_MAX)]
        assert cb is None or cb.stats.replays == BATCHES - 2, cb.stats
    assert [c for c, _ in seen[True]] == [c for c, _ in seen[False]] == [BATCHES] * 3
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen[True], seen[False]))


def test_global_step_read_in_the_step_gets_a_fix_the_user_can_apply():
    """``beta = min(1.0, self.global_step / 100)`` in training_step: a graph per step, then eager
    (16.7 s against 0.8 s eager on helper-92's repro); the warning names the fix: compute it in
    on_train_batch_start and read that float (1 capture, 198 replays there)."""
    from stepgraph.capture.hints import recapture_hint
    hint = recapture_hint("self.global_step 8 -> 9 (read at model.py:20)")
    assert "on_train_batch_start" in hint and "floats are read live" in hint
    assert recapture_hint("self.trainer.global_step 1 -> 2") and not recapture_hint("self.steps 1 -> 2")


class WarmupInOptimizerStep(Classifier):
    """Lightning's docs: the lr set in optimizer_step before ``optimizer.step(closure)``; the
    training step (run by the closure) logs it."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True)
        return F.cross_entropy(self.net(x), y)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        for pg in optimizer.param_groups:
            pg["lr"] = min(1.0, (self.trainer.global_step + 1) / 4.0) * 0.01
        optimizer.step(closure=optimizer_closure)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_an_lr_set_in_optimizer_step_is_logged_as_eager_logs_it(tmp_path):
    """The logger got the lr from before the call (the previous step's), at every call, eager
    ones too: the logged value is now matched against the group's value before and after the
    step (helper-92 F3)."""
    runs = {sg: fit(WarmupInOptimizerStep(), tmp_path / str(sg), stepgraph=sg, epochs=1) for sg in (True, False)}
    rows = {sg: [r["lr"] for _, r in runs[sg][3] if "lr" in r] for sg in runs}
    assert rows[True] == rows[False] and len(set(rows[False])) == 4, rows
