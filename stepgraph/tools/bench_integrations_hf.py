"""The Hugging Face suites of :mod:`stepgraph.tools.bench_integrations`: ``transformers.Trainer``
fine-tuning a small GPT-2 (causal LM) and a small BERT sequence classifier, eager, with
``TrainingArguments(torch_compile=True[, torch_compile_mode="reduce-overhead"])`` and as
``StepGraphTrainer``. Configs are built from ``transformers`` config classes (no downloads)."""
from __future__ import annotations

import dataclasses
import os
import warnings

import torch

from .bench_integrations import Skip


def walk_tokens(n: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """``n`` sequences of a random walk over the vocabulary (next = previous + 1..8, mod vocab):
    learnable, so the loss falls during a short fine-tune (its floor is log 8)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    steps = torch.randint(1, 9, (n, seq - 1), generator=g)
    return torch.cat([start, start + steps.cumsum(1)], 1) % vocab


def _gpt2_data(s, n):
    ids = walk_tokens(n, s["seq"], s["vocab"], seed=1)
    # an explicit attention mask, as tokenized batches carry
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()} for x in ids]


def _bert_data(s, n):
    ids = walk_tokens(n, s["cls_seq"], s["vocab"], seed=2)
    labels = (ids[:, 1] < s["vocab"] // 2).long()  # a function of one token: learnable
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": y} for x, y in zip(ids, labels)]


def _gpt2(s):
    import transformers
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=s["vocab"], n_positions=s["seq"], n_embd=s["d"], n_layer=s["layers"], n_head=s["heads"],
        bos_token_id=0, eos_token_id=0))


def _bert(s):
    import transformers
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=s["vocab"], hidden_size=s["d"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        intermediate_size=4 * s["d"], max_position_embeddings=s["cls_seq"], num_labels=2,
        # set, as a saved fine-tuned config has it: left None, the first forward sets it and
        # torch.compile recompiles at step 2 on that guard
        problem_type="single_label_classification"))


def describe_gpt2(ctx) -> str:
    s = ctx.size
    return (f"transformers.Trainer, GPT2LMHeadModel (n_layer={s['layers']}, n_embd={s['d']}, n_head={s['heads']}, "
            f"vocab={s['vocab']}, seq={s['seq']}), batch {s['batch']}, lr 1e-3 linear, {_params(_gpt2, s)} parameters")


def describe_bert(ctx) -> str:
    s = ctx.size
    return (f"transformers.Trainer, BertForSequenceClassification (layers={s['layers']}, hidden={s['d']}, "
            f"heads={s['heads']}, intermediate={4 * s['d']}, vocab={s['vocab']}, seq={s['cls_seq']}, 2 labels), "
            f"batch {s['cls_batch']}, lr 1e-3 linear, {_params(_bert, s)} parameters")


def _params(make, s) -> str:
    import transformers
    transformers.logging.set_verbosity_error()
    n = sum(p.numel() for p in make(s).parameters())
    return f"{n / 1e6:.2f}M"


def run_gpt2(variant, ctx, timer):
    return _fit(variant, ctx, timer, _gpt2, _gpt2_data, ctx.size["batch"])


def run_bert(variant, ctx, timer):
    return _fit(variant, ctx, timer, _bert, _bert_data, ctx.size["cls_batch"])


def _reset_accelerate():
    # Accelerate's process-wide state (its dynamo plugin among it) must not leak between variants.
    try:
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    except (ImportError, AttributeError):
        pass


def _fit(variant, ctx, timer, make_model, make_data, batch):
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    transformers.logging.set_verbosity_error()
    cuda = ctx.dev.type == "cuda"
    if variant == "reduce-overhead" and not cuda:
        raise Skip("reduce-overhead records CUDA graphs: CUDA only")

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timer.begin()

        def on_step_end(self, args, state, control, **kw):
            timer.end()

    kw = dict(output_dir=os.path.join(ctx.workdir, "hf"), max_steps=ctx.total, per_device_train_batch_size=batch,
              learning_rate=1e-3, warmup_steps=min(10, ctx.total // 4), weight_decay=0.01,
              logging_strategy="steps", logging_steps=ctx.log_every, eval_strategy="no", save_strategy="no",
              report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0, bf16=ctx.bf16,
              use_cpu=not cuda)
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "train_sampling_strategy" in fields:
        kw["train_sampling_strategy"] = "sequential"
    if variant in ("compile", "reduce-overhead"):
        kw.update(torch_compile=True, torch_compile_backend=ctx.compile_backend)
        if variant == "reduce-overhead":
            kw["torch_compile_mode"] = "reduce-overhead"
    _reset_accelerate()
    torch.manual_seed(0)
    model = make_model(ctx.size)
    data = make_data(ctx.size, ctx.total * batch)
    if variant == "stepgraph":
        from stepgraph.integrations.hf import StepGraphTrainer as cls
    else:
        cls = Trainer
    trainer = cls(model=model, args=TrainingArguments(**kw), train_dataset=data, callbacks=[Timing()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    notes = sorted({str(w.message).splitlines()[0][:200] for w in caught if "stepgraph" in str(w.message)})
    losses = [(row["step"], float(row["loss"])) for row in trainer.state.log_history if "loss" in row]
    if variant == "stepgraph":
        st = trainer.stepgraph_stats
        notes.insert(0, f"eager_calls={st.eager_calls} captures={st.captures} replays={st.replays}"
                     if st is not None else f"not captured: {trainer.stepgraph_eager_reason}")
        if st is not None and not st.replays:
            notes.insert(0, "NO REPLAYS (ran eagerly)")
    _reset_accelerate()
    return losses, "; ".join(notes)
