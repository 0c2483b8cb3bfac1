"""Hugging Face accelerate, examples/by_feature/gradient_accumulation.py: BERT sentence-pair
classification (GLUE MRPC) fine-tuned through ``Accelerator(gradient_accumulation_steps=N)`` with
the ``accelerator.accumulate(model)`` context manager.

The program: ``Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
gradient_accumulation_steps=...)``; ``set_seed(seed)``; train/eval ``DataLoader``s (train
``shuffle=True``, a ``collate_fn`` that pads with ``tokenizer.pad(padding="longest",
return_tensors="pt")``, giving a ``BatchEncoding``); ``AutoModelForSequenceClassification``
moved to ``accelerator.device``; ``torch.optim.AdamW(params=model.parameters(), lr=lr)``;
``get_linear_schedule_with_warmup(optimizer, num_warmup_steps=100,
num_training_steps=len(train_dataloader) * num_epochs)``; ``accelerator.prepare(model, optimizer,
train_dataloader, eval_dataloader, lr_scheduler)`` (the optimizer becomes an
``AcceleratedOptimizer``, the scheduler an ``AcceleratedScheduler``, the loaders
``DataLoaderShard``s that tell the gradient state where the epoch ends). Per epoch: ``model.train()``;
per batch ``batch.to(accelerator.device)`` and, inside ``with accelerator.accumulate(model):``,
``output = model(**batch)``, ``loss = output.loss``, ``accelerator.backward(loss)`` (which divides
the loss by the accumulation steps), ``optimizer.step()``, ``lr_scheduler.step()``,
``optimizer.zero_grad()`` -- accelerate's wrappers skip the last three except at every N-th batch
and at the end of the dataloader (``accelerator.step``, a Python counter, and
``gradient_state.sync_gradients`` decide, inside ``accumulate``); then ``model.eval()``, the eval
loop under ``torch.no_grad()`` with ``argmax`` predictions and ``accelerator.gather_for_metrics``,
the metric, and ``accelerator.print``.

What is compiled: the per-batch body of the training loop, ``batch.to(...)`` and the whole
``with accelerator.accumulate(model):`` block, as ``train_step(batch)``: where a user puts
``@stepgraph.compile`` on the loop body. The loop, the epoch's ``model.train()``/``model.eval()``
and the evaluation stay as the program writes them.

Source: https://github.com/huggingface/accelerate/blob/5bc1ffb851333734fc4a422697c7f91c9e3c330d/examples/by_feature/gradient_accumulation.py
Apache-2.0. Restated after the source, not copied. The installed accelerate runs the loop
(Accelerator, prepare, accumulate, backward, gather_for_metrics are the library's own).
Deviations: no ``bert-base-cased`` download: ``BertForSequenceClassification`` from a tiny
``BertConfig`` (vocab 100, hidden 32, 2 layers, 2 heads, intermediate 64, 64 positions, 2 labels);
no tokenizer / datasets / ``evaluate``: synthetic tokenized pairs ([CLS] a [SEP] b [SEP],
token_type_ids, attention_mask, labels) of 16 tokens each, padded by a collate_fn that builds the
``BatchEncoding`` as ``tokenizer.pad(padding="longest")`` does (the pairs all have 16 tokens, so
every batch has one shape); the MRPC accuracy/F1 computed by hand. ``--cpu`` on,
``--mixed_precision`` "no" (``"bf16"`` when amp == "bf16"), ``--gradient_accumulation_steps 2``.
Accelerate's process-wide state (``AcceleratorState``/``GradientState`` are shared singletons) is
reset at the start of ``main`` so the eager run and the stepgraph run each start fresh. Scaled
down: 16 train / 8 eval examples, batch_size 16 -> 4 (EVAL_BATCH_SIZE 32 -> 4), num_epochs 3 (the
loop is cut after ``steps`` calls of the step).
"""
import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import BatchEncoding, BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

SOURCE = ("https://github.com/huggingface/accelerate/blob/5bc1ffb851333734fc4a422697c7f91c9e3c330d/"
          "examples/by_feature/gradient_accumulation.py")
LICENSE = "Apache-2.0"
TAGS = ("transformer", "hf", "bert", "accelerate", "grad-accum", "accumulate-context", "lr-scheduler",
        "adamw", "batch-encoding", "python-counter", "conditional-step", "eval-mode")
DEVICES = ("cpu",)   # --cpu (accelerate picks the device itself otherwise)

MAX_GPU_BATCH_SIZE = 4
EVAL_BATCH_SIZE = 4
SEQ = 16


class args:  # the script's argparse values
    mixed_precision = None
    gradient_accumulation_steps = 2
    cpu = True


config = {"lr": 2e-5, "num_epochs": 3, "seed": 42, "batch_size": 4}


def synthetic_pairs(n, g, vocab=100, cls=2, sep=3):
    out = []
    for _ in range(n):
        la = int(torch.randint(2, SEQ - 4, (1,), generator=g))
        lb = SEQ - 3 - la
        a = torch.randint(5, vocab, (la,), generator=g).tolist()
        b = torch.randint(5, vocab, (lb,), generator=g).tolist()
        out.append({"input_ids": [cls] + a + [sep] + b + [sep],
                    "token_type_ids": [0] * (la + 2) + [1] * (lb + 1),
                    "attention_mask": [1] * SEQ,
                    "label": int(torch.randint(0, 2, (1,), generator=g))})
    return out


def get_dataloaders(accelerator, batch_size=16):
    g = torch.Generator().manual_seed(0)
    train = synthetic_pairs(16, g)
    validation = synthetic_pairs(8, g)

    def collate_fn(examples):
        # tokenizer.pad(examples, padding="longest", return_tensors="pt"), the "label" column
        # renamed "labels" as the program's rename_column does
        longest = max(len(e["input_ids"]) for e in examples)
        feats = {k: [e[k] + [0] * (longest - len(e[k])) for e in examples]
                 for k in ("input_ids", "token_type_ids", "attention_mask")}
        feats["labels"] = [e["label"] for e in examples]
        return BatchEncoding(feats, tensor_type="pt")

    train_dataloader = DataLoader(train, shuffle=True, collate_fn=collate_fn, batch_size=batch_size)
    eval_dataloader = DataLoader(validation, shuffle=False, collate_fn=collate_fn, batch_size=EVAL_BATCH_SIZE)
    return train_dataloader, eval_dataloader


def _fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def main(sg, steps=8, device="cpu", amp=None):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    _fresh_accelerate_state()
    gradient_accumulation_steps = int(args.gradient_accumulation_steps)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision="bf16" if amp == "bf16" else args.mixed_precision,
                              gradient_accumulation_steps=gradient_accumulation_steps)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=2))
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=100, num_training_steps=(len(train_dataloader) * num_epochs))
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    sg.track(model=model, optimizer=optimizer.optimizer, lr_scheduler=lr_scheduler.scheduler)

    @sg.compile
    def train_step(batch):
        batch.to(accelerator.device)
        with accelerator.accumulate(model):
            output = model(**batch)
            loss = output.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        return loss

    done = 0
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            if done == steps:
                break
            loss = train_step(batch)
            done += 1
            sg.log((loss, accelerator.step, accelerator.sync_gradients, optimizer.optimizer.param_groups[0]["lr"]))
        if done == steps and step < len(train_dataloader) - 1:
            break

        model.eval()
        all_pred, all_ref = [], []
        for step, batch in enumerate(eval_dataloader):
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            all_pred.append(predictions)
            all_ref.append(references)
        p, r = torch.cat(all_pred), torch.cat(all_ref)
        tp = ((p == 1) & (r == 1)).sum().item()
        f1 = 2 * tp / max(1, (p == 1).sum().item() + (r == 1).sum().item())
        eval_metric = {"accuracy": (p == r).float().mean().item(), "f1": f1}
        sg.log(eval_metric["accuracy"])
        accelerator.print(f"epoch {epoch}:", eval_metric)
