"""Issue 18, Hugging Face: ``StepGraphTrainer`` and ``accelerate_step`` against the same run
without stepgraph.

Tiny models built from ``transformers`` config classes with their default settings (dropout on,
the Trainer's default AdamW, linear schedule, ``max_grad_norm=1``), no downloads. Every test
runs the same seed and batches with and without stepgraph and compares, bitwise on the CPU: the
Trainer's log history (loss, grad_norm, learning_rate, eval_loss at every logging step), the
parameters and the optimizer state; checkpoints are saved and resumed. The stats assert the
step was captured and replayed (a silent eager fallback fails them). Skipped without
transformers / accelerate.
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from stepgraph.integrations.hf import StepGraphTrainer, accelerate_step  # noqa: E402

V, T, B = 64, 12, 4
transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def lm_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, V, (T,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def mlm_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, V, (T,), generator=g)
        pick = torch.rand(T, generator=g) < 0.3
        pick[0] = True
        out.append({"input_ids": torch.where(pick, 1, ids), "labels": torch.where(pick, ids, -100)})
    return out


TRAIN, EVAL = lm_data(24 * B, 1), lm_data(4 * B, 2)  # 24 micro-batches an epoch


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))


def bert():
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=T))


def args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=B, per_device_eval_batch_size=B, logging_steps=1,
                use_cpu=True, report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0, save_strategy="no")
    return TrainingArguments(**dict(base, **kw))


def history(trainer):
    return [{k: v for k, v in row.items() if "runtime" not in k and "per_second" not in k}
            for row in trainer.state.log_history]


def train(cls, model, out, resume=None, data=TRAIN, callbacks=(), **kw):
    t = cls(model=model, args=args(out, **kw), train_dataset=data, eval_dataset=EVAL, callbacks=list(callbacks))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.train(resume_from_checkpoint=resume)
    # every warning of the run (stepgraph's, and any it would cause in the Trainer or torch)
    return t, [str(w.message) for w in caught if "stepgraph" in str(w.message) or cls is not Trainer]


def assert_same_state(m1, m2, t1, t2):
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), f"parameter {n} differs from eager"
    s1, s2 = t1.optimizer.state_dict()["state"], t2.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for i in s1:
        for k in s1[i]:
            assert torch.equal(torch.as_tensor(s1[i][k]), torch.as_tensor(s2[i][k])), (i, k)


def graph_dtypes(step):
    return {n.meta["val"].dtype for g in step.graphs for n in g.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


def test_trainer_gpt2_bf16_accumulation_eval_checkpoint_resume(tmp_path):
    """GPT-2, bf16 autocast, gradient accumulation 2, 20 optimizer steps over two epochs, the
    linear schedule, clipping, evaluation every 5 steps, a checkpoint at step 10; then a new
    Trainer with a new model resumes from that checkpoint to step 20."""
    kw = dict(bf16=True, gradient_accumulation_steps=2, max_steps=20, eval_strategy="steps", eval_steps=5,
              save_strategy="steps", save_steps=10, warmup_steps=3)
    runs = {}
    for cls in (StepGraphTrainer, Trainer):
        root = tmp_path / cls.__name__
        m = gpt2()
        t, notes = train(cls, m, root, **kw)
        m2 = gpt2()
        t2, notes2 = train(cls, m2, root / "resumed", resume=str(root / "checkpoint-10"), **kw)
        runs[cls] = (m, t, m2, t2, notes + notes2)
    (m1, t1, r1, u1, notes), (m2, t2, r2, u2, _) = runs[StepGraphTrainer], runs[Trainer]
    assert notes == [], notes
    h1, h2 = history(t1), history(t2)
    assert h1 == h2  # loss, grad_norm, learning_rate, epoch at each of the 20 steps; eval_loss
    assert sum("loss" in r for r in h1) == 20 and sum("eval_loss" in r for r in h1) == 4
    assert len({r["learning_rate"] for r in h1 if "learning_rate" in r}) > 10  # the schedule moved
    assert_same_state(m1, m2, t1, t2)
    assert history(u1) == history(u2)
    assert_same_state(r1, r2, u1, u2)
    for p, q in zip(r1.parameters(), m2.parameters()):  # resuming lands where the uninterrupted run did
        assert torch.equal(p, q)
    for t, micro in ((t1, 40), (u1, 20)):
        st = t.stepgraph_stats
        assert st.eager_calls == 2 and st.captures == 2 and st.failed_captures == 0, st
        assert st.replays == micro - 4, st
        assert torch.bfloat16 in graph_dtypes(t.stepgraph_step)  # Accelerate's autocast is in the graph


def test_trainer_bert_default_config(tmp_path):
    """BERT masked LM with its default config (fp32, no accumulation), 20 steps."""
    data = mlm_data(20 * B, 3)
    runs = {}
    for cls in (StepGraphTrainer, Trainer):
        m = bert()
        runs[cls] = (m,) + train(cls, m, tmp_path / cls.__name__, data=data, max_steps=20)
    (m1, t1, notes), (m2, t2, _) = runs[StepGraphTrainer], runs[Trainer]
    assert notes == [], notes
    assert history(t1) == history(t2)
    assert_same_state(m1, m2, t1, t2)
    st = t1.stepgraph_stats
    assert (st.eager_calls, st.captures, st.replays) == (1, 1, 18), st


class Scaled:
    """A user's compute_loss override that reads ``self.scale``, changed mid-training."""
    scale = 1.0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * self.scale


class ScaledLoss(Scaled, StepGraphTrainer):
    pass


class EagerScaledLoss(Scaled, Trainer):
    pass


class SetScale(TrainerCallback):
    def __init__(self):
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 6:
            self.trainer.scale = 0.5


def test_user_compute_loss_values_are_guarded(tmp_path):
    """A Python value the user's ``compute_loss`` override reads is seen like a step's own (the
    Trainer's loop is library code: stepgraph is told which user code it calls): the float
    scaling the loss is read live (one graph, no recapture when the callback changes it), and
    training stays equal to eager."""
    runs = {}
    for cls in (ScaledLoss, EagerScaledLoss):
        m = gpt2()
        cb = SetScale()
        t = cls(model=m, args=args(tmp_path / cls.__name__, max_steps=12), train_dataset=TRAIN, callbacks=[cb])
        cb.trainer = t
        t.train()
        runs[cls] = (m, t)
    (m1, t1), (m2, t2) = runs[ScaledLoss], runs[EagerScaledLoss]
    assert history(t1) == history(t2)
    assert_same_state(m1, m2, t1, t2)
    st = t1.stepgraph_stats
    assert st.captures == 1 and not st.recaptures, st


class Anneal(TrainerCallback):
    """Label smoothing switched off and the clipping norm changed half way (a callback)."""
    def __init__(self):
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 6:
            self.trainer.label_smoother.epsilon = 0.0
            args.max_grad_norm = 0.5


def test_settings_the_trainers_own_code_reads_are_keyed(tmp_path):
    """``trainer.label_smoother.epsilon`` and ``args.max_grad_norm`` are read by transformers'
    code (compute_loss, the clipping), which stepgraph does not scan: changed by a callback, the
    graph kept the captured values, silently (helper-89). The Trainer passes them as a key now."""
    runs = {}
    for cls in (StepGraphTrainer, Trainer):
        m = gpt2()
        cb = Anneal()
        t = cls(model=m, args=args(tmp_path / cls.__name__, max_steps=10, label_smoothing_factor=0.1),
                train_dataset=TRAIN, callbacks=[cb])
        cb.trainer = t
        t.train()
        runs[cls] = (m, t)
    (m1, t1), (m2, t2) = runs[StepGraphTrainer], runs[Trainer]
    assert history(t1) == history(t2)
    assert_same_state(m1, m2, t1, t2)
    assert any("label_smoother.epsilon=0.1" in r for r in t1.stepgraph_stats.recaptures), t1.stepgraph_stats


class GradWatcher(TrainerCallback):
    """Runs between backward and the optimizer step: reads the gradients."""

    def __init__(self):
        self.norms = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append(sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None))


def test_callback_between_backward_and_optimizer_keeps_that_part_eager(tmp_path):
    """A callback with on_pre_optimizer_step: warned once by name; clipping and the optimizer
    step run eagerly, forward and backward stay captured, results equal eager."""
    runs = {}
    for cls in (StepGraphTrainer, Trainer):
        m, cb = gpt2(), GradWatcher()
        runs[cls] = (m, cb) + train(cls, m, tmp_path / cls.__name__, callbacks=[cb], max_steps=10,
                                    gradient_accumulation_steps=2)
    (m1, c1, t1, notes), (m2, c2, t2, _) = runs[StepGraphTrainer], runs[Trainer]
    assert len(notes) == 1 and "GradWatcher.on_pre_optimizer_step" in notes[0] and "eager" in notes[0], notes
    assert c1.norms == c2.norms and len(c1.norms) == 10
    assert history(t1) == history(t2)
    assert_same_state(m1, m2, t1, t2)
    st = t1.stepgraph_stats
    assert st.captures == 2 and st.replays == 20 - 2 - 2, st


def test_accelerate_step_bf16_accumulation_scheduler(tmp_path):
    """A plain Accelerate loop: accumulate(model) around the call, bf16, clipping when syncing,
    AcceleratedScheduler stepped inside the step (run as Python after it), 40 micro-batches."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    data = torch.utils.data.DataLoader(TRAIN, batch_size=B, collate_fn=transformers.default_data_collator)
    runs = {}
    for captured in (True, False):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
        model = gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=40)
        model, opt, dl, sched = acc.prepare(model, opt, data, sched)

        def train_step(batch):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            return loss.detach()
        step = accelerate_step(acc, train_step) if captured else train_step
        losses, lrs = [], []
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                for batch in dl:
                    with acc.accumulate(model):
                        losses.append(step(batch))
                    lrs.append(sched.get_last_lr()[0])
        runs[captured] = (model, opt, losses, lrs, step, [str(w.message) for w in caught if "stepgraph" in str(w.message)])
    (m1, o1, l1, lr1, step, notes), (m2, o2, l2, lr2, _, _) = runs[True], runs[False]
    assert notes == [], notes
    assert len(l1) == 48 and all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert lr1 == lr2 and len(set(lr1)) > 10
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    for s1, s2 in zip(o1.state.values(), o2.state.values()):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
    st = step.stats
    assert st.eager_calls == 2 and st.captures == 2 and st.replays == 48 - 4, st


def test_accelerate_accumulate_inside_the_step_is_warned_and_runs_eagerly():
    """``with accelerator.accumulate(model):`` inside the step advances Accelerate's Python
    counter, which a replay cannot: one warning naming it, then eager calls equal to eager."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    runs = {}
    for captured in (True, False):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)

        def train_step(x):
            with acc.accumulate(model):
                loss = model(x).square().mean()
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            return loss.detach()
        step = accelerate_step(acc, train_step) if captured else train_step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = [step(torch.randn(4, 8, generator=torch.Generator().manual_seed(k))) for k in range(8)]
        runs[captured] = (model, losses, [str(w.message) for w in caught if "stepgraph" in str(w.message)])
    (m1, l1, notes), (m2, l2, _) = runs[True], runs[False]
    assert len(notes) == 1 and "accelerator.accumulate" in notes[0], notes
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


def test_import_does_not_need_transformers():
    import os
    import subprocess
    import sys
    code = ("import sys, stepgraph, stepgraph.integrations; "
            "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_accumulate_inside_a_plainly_compiled_step_is_refused_naming_the_counter():
    """accelerate's gradient_accumulation.py with the body of ``with accelerator.accumulate(model):``
    compiled by plain stepgraph.compile: the counter (``accelerator.step``) and
    ``sync_gradients`` change in accelerate's code, and replays kept the capture's: with 3
    accumulation steps the optimizer never stepped again, silently. Refused (capture/libstate.py),
    naming the attribute and accelerate_step; the refused call ran eagerly."""
    import pytest as _pytest
    accelerate = _pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState
    import stepgraph as sgm

    def run(compiled):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)

        def train_step(x, y):
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            return loss.detach()
        f = sgm.compile(train_step) if compiled else train_step
        g = torch.Generator().manual_seed(1)
        err = None
        for _ in range(2):
            try:
                f(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g))
            except sgm.CaptureError as e:
                err = str(e)
        return model.weight.detach().clone(), acc.step, err
    (we, se, _), (ws, ss, err) = run(False), run(True)
    assert err is not None and "accelerator." in err and "accelerate_step" in err, err
    assert torch.equal(we, ws) and se == ss


@pytest.mark.parametrize("wrap", ["compile", "accelerate_step"])
def test_an_accelerated_scheduler_stepped_in_the_step_follows_eager(wrap):
    """Accelerate's prepared optimizer wraps the user's, and the two share their param groups:
    each put a live lr in the same group, and putting them back wrote the capture's lr after each
    replay over the scheduler's -- the lr froze from the first replay on, silently (plain
    ``stepgraph.compile``). ``accelerate_step`` deferred the scheduler to after the step: what
    the step read after ``sched.step()`` was a schedule step behind."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    import stepgraph
    runs = []
    for captured in (False, True):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        torch.manual_seed(0)
        acc = Accelerator(cpu=True)
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        model, opt, sched = acc.prepare(model, opt, sched)

        def train_step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            return loss.detach(), sched.get_last_lr()[0]
        step = train_step if not captured else stepgraph.compile(train_step) if wrap == "compile" \
            else accelerate_step(acc, train_step)
        g, out = torch.Generator().manual_seed(1), []
        for _ in range(6):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
            with acc.accumulate(model):
                loss, lr = step(x, y)
            out.append((loss, lr, opt.param_groups[0]["lr"], model.weight.detach().clone()))
        runs.append((out, step))
    (want, _), (got, step) = runs
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a[0], b[0]) and a[1:3] == b[1:3] and torch.equal(a[3], b[3]), i
    assert step.stats.replays >= 3, step.stats
