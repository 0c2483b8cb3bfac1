"""Issue 18 on the GPU: the integration tests' longest runs (tests/test_integrations_hf.py and
tests/test_integrations_lightning.py) with the framework on CUDA, against the same run without
stepgraph. Skipped without CUDA, transformers or lightning.

On the CPU these runs are bitwise. On CUDA stepgraph switches AdamW to PyTorch's capturable form
(the lr a device tensor) for its CUDA graph while the run without stepgraph keeps the default
form, so the two drift apart by rounding (docs/optimizer_drift.md): compared within a tolerance
here, the largest differences printed. The learning rates, the step counts and what was
captured and replayed are compared exactly.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = 2e-2   # relative, after 20 optimizer steps in bf16 autocast


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a).double().cpu(), torch.as_tensor(b).double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _state_rel(params1, params2) -> float:
    return max(_rel(p.detach(), q.detach()) for p, q in zip(params1, params2))


@pytest.fixture
def fresh_accelerate_state():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_hf_trainer_gpt2_bf16_accumulation_eval_checkpoint_resume_on_cuda(tmp_path, fresh_accelerate_state):
    from transformers import Trainer
    import test_integrations_hf as hf
    from stepgraph.integrations.hf import StepGraphTrainer
    kw = dict(bf16=True, gradient_accumulation_steps=2, max_steps=20, eval_strategy="steps", eval_steps=5,
              save_strategy="steps", save_steps=10, warmup_steps=3, use_cpu=False)
    runs = {}
    for cls in (StepGraphTrainer, Trainer):
        root = tmp_path / cls.__name__
        m = hf.gpt2()
        t, notes = hf.train(cls, m, root, **kw)
        m2 = hf.gpt2()
        t2, notes2 = hf.train(cls, m2, root / "resumed", resume=str(root / "checkpoint-10"), **kw)
        runs[cls] = (m, t, m2, t2, notes + notes2)
    (m1, t1, r1, u1, notes), (m2, t2, r2, u2, _) = runs[StepGraphTrainer], runs[Trainer]
    assert notes == [], notes
    assert next(m1.parameters()).is_cuda
    worst = {}
    for ta, tb in ((t1, t2), (u1, u2)):
        h1, h2 = hf.history(ta), hf.history(tb)
        assert [sorted(r) for r in h1] == [sorted(r) for r in h2]
        for r1_, r2_ in zip(h1, h2):
            for k in ("loss", "grad_norm", "eval_loss"):
                if k in r1_:
                    worst[k] = max(worst.get(k, 0.0), abs(r1_[k] - r2_[k]) / max(abs(r2_[k]), 1e-12))
            # (the Trainer's default fused AdamW holds its lr as a float32 device tensor under
            # stepgraph: the scheduler reports it float32-rounded; README, "differences")
            lr1, lr2 = r1_.get("learning_rate"), r2_.get("learning_rate")
            assert (lr1 is None) == (lr2 is None) and (lr1 is None or abs(lr1 - lr2) <= 1e-7 * abs(lr2)), (lr1, lr2)
    worst["parameters"] = _state_rel(m1.parameters(), m2.parameters())
    worst["resumed parameters"] = _state_rel(r1.parameters(), r2.parameters())
    print(f"\nHF Trainer GPT-2 on CUDA, stepgraph vs without: largest relative differences {worst}")
    assert max(worst.values()) <= TOL, worst
    for t, micro in ((t1, 40), (u1, 20)):
        st = t.stepgraph_stats
        assert st.eager_calls == 2 and st.captures == 2 and st.failed_captures == 0, st
        assert st.replays == micro - 4, st
        assert t.stepgraph_step.captures[0].backend == "cudagraph", t.stepgraph_step.explain()


def test_lightning_bf16_accumulation_clipping_scheduler_eval_checkpoint_resume_on_cuda(tmp_path):
    pytest.importorskip("lightning")
    import test_integrations_lightning as pl
    kw = dict(precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.5, val_check_interval=0.5,
              accelerator="gpu")
    runs = {}
    for sg in (True, False):
        root = tmp_path / ("sg" if sg else "eager")
        m = pl.new_model()
        t, cb, losses, rows, notes = pl.fit(m, root, stepgraph=sg, epochs=1, **kw)
        ckpt = root / "epoch1.ckpt"
        t.save_checkpoint(ckpt)
        m2 = pl.new_model()
        t2, cb2, losses2, rows2, notes2 = pl.fit(m2, root, stepgraph=sg, epochs=2, ckpt_path=ckpt, **kw)
        runs[sg] = dict(m=m, t=t, cb=cb, losses=losses + losses2, rows=rows + rows2, notes=notes + notes2,
                        m2=m2, t2=t2, cb2=cb2)
    sg, ref = runs[True], runs[False]
    assert sg["notes"] == [], sg["notes"]
    # (Lightning moves the module back to the CPU when fit ends: its graphs say where it ran)
    assert [c.backend for c in sg["cb"].step_function.captures] == ["cudagraph"] * sg["cb"].stats.captures
    assert len(sg["losses"]) == 2 * pl.BATCHES and sg["t2"].global_step == ref["t2"].global_step == pl.BATCHES
    worst = {"loss per batch": max(_rel(a, b) for a, b in zip(sg["losses"], ref["losses"]))}
    assert [(s, sorted(r)) for s, r in sg["rows"]] == [(s, sorted(r)) for s, r in ref["rows"]]
    for (_, a), (_, b) in zip(sg["rows"], ref["rows"]):
        # (the lr the module logs is stepgraph's float64 device tensor: logged exactly, where the
        # run without stepgraph logs the float as float32; README, "differences")
        assert (a.get("lr") is None) == (b.get("lr") is None)
        assert a.get("lr") is None or abs(a["lr"] - b["lr"]) <= 1e-7 * abs(b["lr"]), (a, b)
        for k in a:
            if k != "lr":
                worst[k] = max(worst.get(k, 0.0), _rel(a[k], b[k]))
    worst["parameters"] = _state_rel(sg["m2"].parameters(), ref["m2"].parameters())
    print(f"\nLightning on CUDA, stepgraph vs without: largest relative differences {worst}")
    assert max(worst.values()) <= TOL, worst
    for cb in (sg["cb"], sg["cb2"]):
        st = cb.stats
        assert st.eager_calls == 2 and st.failed_captures == 0 and 2 <= st.captures <= 3, st
        assert st.replays == pl.BATCHES - st.eager_calls - st.captures, st
