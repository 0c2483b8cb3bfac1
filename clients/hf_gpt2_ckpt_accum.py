"""transformers examples/pytorch/language-modeling/run_clm_no_trainer.py, the training loop of a
from-scratch GPT2LMHeadModel with activation checkpointing and gradient clipping: the script's
causal-LM loop (two AdamW parameter groups, ``no_decay = ["bias", "LayerNorm.weight"]``; the
linear warmup/decay schedule ``get_linear_schedule_with_warmup`` -- what the script's
``get_scheduler("linear", ...)`` returns -- stepped with the optimizer; ``loss = loss /
gradient_accumulation_steps`` and backward per micro-batch; ``total_loss += loss.detach().float()``
as ``--with_tracking`` does), with what users of the script add from the Trainer's recipe:
``model.gradient_checkpointing_enable()`` (transformers' default kwargs: ``use_reentrant=False``,
plus ``enable_input_require_grads``; GPT-2's dropouts 0.1 run inside each checkpointed block and are
redrawn on the recomputation) and ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``
before ``optimizer.step()``.

What a user of stepgraph changes: the accumulation window -- the two micro-batches of one
optimizer update, their forward/backward, the clip, ``optimizer.step()``, ``lr_scheduler.step()``,
``optimizer.zero_grad()`` and ``completed_steps += 1`` -- is one function decorated with
``sg.compile`` (= ``@stepgraph.compile``); the script's ``accelerator.accumulate(model)`` /
``sync_gradients`` bookkeeping is this explicit loop over 2 micro-batches (accelerate left out:
``accelerator.backward(loss)`` is ``loss.backward()``, ``accelerator.clip_grad_norm_`` is
``torch.nn.utils.clip_grad_norm_``; mixed_precision="bf16" is ``torch.autocast("cpu", bf16)``
around the forward when amp == "bf16"). The per-epoch evaluation (model.eval(), no_grad,
perplexity) is kept outside the step as the script writes it.

Model: the installed transformers' GPT2LMHeadModel, GPT2Config defaults except n_layer=2, n_embd=32,
n_head=2, vocab_size=100, n_positions=64. Data: ``default_data_collator`` over synthetic features of
block_size 16 (random ids; labels = input_ids as group_texts makes them). Scaled down: 32 train / 4
eval examples, batch 4, --gradient_accumulation_steps 2, --num_warmup_steps 2, --weight_decay 0.01,
--learning_rate 5e-4, --max_train_steps ``steps`` (each step = one optimizer update).

Source: https://github.com/huggingface/transformers/blob/3c354ea20e347edb9413ada30911e9fdc242719d/examples/pytorch/language-modeling/run_clm_no_trainer.py
(Apache-2.0). Restated after the source, not copied.
"""
import math

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_linear_schedule_with_warmup

SOURCE = ("https://github.com/huggingface/transformers/blob/3c354ea20e347edb9413ada30911e9fdc242719d/"
          "examples/pytorch/language-modeling/run_clm_no_trainer.py")
LICENSE = "Apache-2.0"
DEVICES = ("cpu", "cuda")
TAGS = ("transformer", "hf", "gpt2", "lm", "activation-checkpointing", "dropout", "rng-replay", "grad-accum",
        "micro-batch-loop-in-step", "clip-grad-norm", "lr-scheduler", "per-step-lr", "adamw",
        "weight-decay-groups", "eval-mode", "python-counter")


class args:  # the script's argparse values, scaled down
    per_device_train_batch_size = 4
    per_device_eval_batch_size = 4
    learning_rate = 5e-4
    weight_decay = 0.01
    num_train_epochs = 3
    max_train_steps = None
    gradient_accumulation_steps = 2
    num_warmup_steps = 2
    block_size = 16
    max_grad_norm = 1.0
    with_tracking = True


def synthetic_features(n, g, vocab=100):
    feats = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (args.block_size,), generator=g).tolist()
        feats.append({"input_ids": ids, "attention_mask": [1] * args.block_size, "labels": list(ids)})
    return feats


def main(sg, steps=8, device="cpu", amp=None):
    device_type = device.split(":")[0]
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = GPT2LMHeadModel(config).to(device)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False

    g = torch.Generator().manual_seed(1)
    train_dataset = synthetic_features(32, g)
    eval_dataset = synthetic_features(4, g)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    args.max_train_steps = steps
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=args.num_warmup_steps,
                                                   num_training_steps=args.max_train_steps)
    sg.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    completed_steps = 0
    total_loss = 0

    @sg.compile
    def train_step(micro_batches):
        nonlocal completed_steps, total_loss
        for batch in micro_batches:
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                outputs = model(**batch)
            loss = outputs.loss
            if args.with_tracking:
                total_loss += loss.detach().float()
            loss = loss / args.gradient_accumulation_steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        completed_steps += 1
        return loss

    for epoch in range(args.num_train_epochs):
        model.train()
        total_loss = 0
        window = []
        for step, batch in enumerate(train_dataloader):
            window.append({k: v.to(device) for k, v in batch.items()})
            if len(window) < args.gradient_accumulation_steps:
                continue
            loss = train_step(window)
            window = []
            sg.log({"loss": loss, "completed_steps": completed_steps, "lr": lr_scheduler.get_last_lr()[0]})
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.no_grad():
                outputs = model(**batch)
            losses.append(outputs.loss.repeat(args.per_device_eval_batch_size))
        losses = torch.cat(losses)[: len(eval_dataset)]
        try:
            perplexity = math.exp(torch.mean(losses))
        except OverflowError:
            perplexity = float("inf")
        sg.log({"perplexity": perplexity, "train_loss": total_loss / len(train_dataloader)})
        if completed_steps >= args.max_train_steps:
            break
