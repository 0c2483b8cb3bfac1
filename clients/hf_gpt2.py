"""transformers examples/pytorch/language-modeling/run_clm_no_trainer.py: causal-LM training of
GPT2LMHeadModel (built from a config, i.e. the script's ``--model_type gpt2`` from-scratch path)
with AdamW over the script's two parameter groups (``no_decay = ["bias", "LayerNorm.weight"]``),
``get_scheduler("linear", num_warmup_steps=2)`` stepped with the optimizer, and the script's
gradient accumulation: ``loss = loss / args.gradient_accumulation_steps``, backward every batch,
and ``optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()`` only when
``step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1`` (so the
first batch of every epoch updates alone), ``completed_steps += 1`` alongside; the per-epoch
evaluation (model.eval(), no_grad forward, perplexity from the mean loss).

Model: the installed transformers' GPT2LMHeadModel (not vendored), GPT2Config defaults except
n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64 (default attention
implementation). Loop: run_clm_no_trainer.py at 3c354ea, the end of main() (the epoch loop, the
training inner loop and the evaluation loop) without accelerate: ``accelerator.backward(loss)``
is ``loss.backward()``, ``accelerator.gather`` the identity; accelerate's mixed_precision="bf16"
is the ``torch.autocast`` around the forward when amp == "bf16". ``transformers.AdamW`` (gone in
transformers 5) is ``torch.optim.AdamW``; no tokenizer / datasets / progress bar.

Data: ``default_data_collator`` over synthetic features of block_size 16: random token ids, the
tail of some rows right-padded (attention_mask 0, labels -100 there; group_texts' labels are a
copy of input_ids otherwise). Scaled down: 16 train / 4 eval examples, batch 4,
--gradient_accumulation_steps 2, --num_warmup_steps 2, --weight_decay 0.01,
--max_train_steps ``steps`` (the loop is cut after ``steps`` calls of the step).
"""
import math

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

SOURCE = ("https://github.com/huggingface/transformers/blob/3c354ea20e347edb9413ada30911e9fdc242719d/"
          "examples/pytorch/language-modeling/run_clm_no_trainer.py")
LICENSE = "Apache-2.0"
TAGS = ("transformer", "hf", "gpt2", "lm", "grad-accum", "conditional-step", "lr-scheduler", "adamw",
        "weight-decay-groups", "padding-mask", "dict-batch", "dropout", "eval-mode", "python-counter")


class args:  # the script's argparse values, scaled down
    per_device_train_batch_size = 4
    per_device_eval_batch_size = 4
    learning_rate = 5e-5
    weight_decay = 0.01
    num_train_epochs = 3
    max_train_steps = None
    gradient_accumulation_steps = 2
    lr_scheduler_type = "linear"
    num_warmup_steps = 2
    block_size = 16


def synthetic_features(n, g, vocab=100):
    feats = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (args.block_size,), generator=g)
        length = int(torch.randint(args.block_size // 2, args.block_size + 1, (1,), generator=g))
        mask = (torch.arange(args.block_size) < length).long()
        ids = ids * mask  # pad id 0
        labels = ids.masked_fill(mask == 0, -100)
        feats.append({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})
    return feats


def main(sg, steps=8, device="cpu", amp=None):
    device_type = device.split(":")[0]
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = GPT2LMHeadModel(config).to(device)

    g = torch.Generator().manual_seed(1)
    train_dataset = synthetic_features(16, g)
    eval_dataset = synthetic_features(4, g)

    # DataLoaders creation:
    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(
        eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )

    # Optimizer
    # Split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    # Scheduler and math around the number of training steps.
    args.max_train_steps = steps
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    else:
        args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.max_train_steps,
    )
    sg.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    completed_steps = 0

    @sg.compile
    def train_step(batch, step):
        nonlocal completed_steps
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            outputs = model(**batch)
        loss = outputs.loss
        loss = loss / args.gradient_accumulation_steps
        loss.backward()
        if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            completed_steps += 1
        return loss

    calls = 0
    for epoch in range(args.num_train_epochs):
        if calls >= steps:
            break
        model.train()
        for step, batch in enumerate(train_dataloader):
            if calls >= steps:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = train_step(batch, step)
            calls += 1
            sg.log({"loss": loss, "completed_steps": completed_steps})

            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.no_grad():
                with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                    outputs = model(**batch)

            loss = outputs.loss
            losses.append(loss.repeat(args.per_device_eval_batch_size))

        losses = torch.cat(losses)
        losses = losses[: len(eval_dataset)]
        try:
            perplexity = math.exp(torch.mean(losses))
        except OverflowError:
            perplexity = float("inf")
        sg.log({"perplexity": perplexity})
