"""stepgraph inside Hugging Face: ``StepGraphTrainer`` (a drop-in ``transformers.Trainer``)
and ``accelerate_step`` (a plain Accelerate loop).

    pip install 'stepgraph[hf]'             # or: pip install transformers accelerate
    PYTHONPATH=. python examples/hf_trainer_example.py

A tiny GPT-2 built from ``GPT2Config`` (no download) is trained twice on the CPU -- with
``Trainer`` and with ``StepGraphTrainer`` -- with bf16, gradient accumulation, the default
AdamW / linear schedule / clipping and an evaluation; the log histories and parameters are
compared bit for bit. Then the same model trains in an Accelerate loop with ``accelerate_step``.
"""
import tempfile
import time

import torch
import transformers
from transformers import Trainer, TrainingArguments

from stepgraph.integrations.hf import StepGraphTrainer, accelerate_step

V, T = 128, 32


def dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, V, (T,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=T, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))


def run_trainer(cls, out):
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             max_steps=30, bf16=True, use_cpu=True, logging_steps=5, eval_strategy="steps",
                             eval_steps=15, save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    model = gpt2()
    trainer = cls(model=model, args=args, train_dataset=dataset(512, 1), eval_dataset=dataset(64, 2))
    t = time.perf_counter()
    trainer.train()
    return model, trainer, time.perf_counter() - t


def run_accelerate():
    from accelerate import Accelerator
    acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 100)
    loader = torch.utils.data.DataLoader(dataset(256, 3), batch_size=8, collate_fn=transformers.default_data_collator)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    @accelerate_step(acc)
    def train_step(batch):
        loss = model(**batch).loss
        acc.backward(loss)
        if acc.sync_gradients:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        return loss.detach()

    for batch in loader:
        with acc.accumulate(model):  # around the captured call
            loss = train_step(batch)
    print(f"accelerate_step: last loss {float(loss):.4f}; {train_step.stats}")


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        m_eager, t_eager, s_eager = run_trainer(Trainer, tmp + "/eager")
        m_sg, t_sg, s_sg = run_trainer(StepGraphTrainer, tmp + "/stepgraph")   # <- the one change

    def hist(t):
        return [{k: v for k, v in r.items() if "runtime" not in k and "per_second" not in k}
                for r in t.state.log_history]
    print("Trainer log:", [(r.get("step"), r.get("loss", r.get("eval_loss"))) for r in hist(t_eager)])
    print(f"log histories equal: {hist(t_sg) == hist(t_eager)}; parameters bit-for-bit equal: "
          f"{all(torch.equal(p, q) for p, q in zip(m_sg.parameters(), m_eager.parameters()))}; "
          f"train() {s_eager:.2f}s eager, {s_sg:.2f}s stepgraph (incl. capture)")
    print(f"StepGraphTrainer: {t_sg.stepgraph_stats}")
    run_accelerate()
