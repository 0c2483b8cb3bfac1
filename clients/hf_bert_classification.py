"""transformers examples/pytorch/text-classification/run_glue_no_trainer.py: sentence-pair
classification (an MRPC-like task) with BertForSequenceClassification: AdamW over the script's
two parameter groups (``no_decay = ["bias", "LayerNorm.weight"]``), ``get_scheduler("linear")``,
the script's accumulation form (``loss = loss / args.gradient_accumulation_steps``; backward;
``optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()`` when
``step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1``,
``completed_steps += 1`` alongside), ``--with_tracking``'s ``total_loss += loss.detach().float()``
inside the step and its per-epoch log of ``total_loss.item() / len(train_dataloader)``, and the
per-epoch evaluation (model.eval(), argmax predictions, accuracy).

Model: the installed transformers' BertForSequenceClassification (not vendored), BertConfig
defaults except vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
intermediate_size=64, max_position_embeddings=64, num_labels=2 (default attention
implementation). Loop: run_glue_no_trainer.py at a22a437, the epoch loop at the end of main()
(training inner loop and evaluation loop) without accelerate: ``accelerator.backward(loss)`` is
``loss.backward()``, ``accelerator.gather`` the identity, batches moved with ``.to(device)``;
accelerate's mixed_precision="bf16" is the ``torch.autocast`` around the forward when
amp == "bf16". No checkpointing / hub / tokenizer; the ``evaluate`` accuracy metric is computed
by hand.

Data: the script's ``--pad_to_max_length`` path (``default_data_collator``) over synthetic
tokenized pairs of max_length 16: [CLS] a [SEP] b [SEP], token_type_ids 0/1, right padding
(attention_mask 0, pad id 0), labels 0/1. Scaled down: 16 train / 8 eval examples, batch 4,
gradient_accumulation_steps 1 (the default), weight_decay 0.01, learning_rate 5e-5,
num_warmup_steps 0, max_train_steps ``steps``.
"""
import math

import torch
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, default_data_collator, get_scheduler

SOURCE = ("https://github.com/huggingface/transformers/blob/a22a4378d97d06b7a1d9abad6e0086d30fdea199/"
          "examples/pytorch/text-classification/run_glue_no_trainer.py")
LICENSE = "Apache-2.0"
TAGS = ("transformer", "hf", "bert", "classification", "conditional-step", "lr-scheduler", "adamw",
        "weight-decay-groups", "padding-mask", "token-type-ids", "dict-batch", "dropout", "eval-mode",
        "python-counter", "loss-accumulator")


class args:  # the script's argparse values, scaled down
    per_device_train_batch_size = 4
    per_device_eval_batch_size = 4
    learning_rate = 5e-5
    weight_decay = 0.01
    num_train_epochs = 3
    max_train_steps = None
    gradient_accumulation_steps = 1
    lr_scheduler_type = "linear"
    num_warmup_steps = 0
    max_length = 16
    with_tracking = True


def synthetic_pairs(n, g, vocab=100, cls=2, sep=3):
    feats = []
    for _ in range(n):
        la = int(torch.randint(2, 6, (1,), generator=g))
        lb = int(torch.randint(2, 6, (1,), generator=g))
        a = torch.randint(5, vocab, (la,), generator=g).tolist()
        b = torch.randint(5, vocab, (lb,), generator=g).tolist()
        ids = [cls] + a + [sep] + b + [sep]
        tt = [0] * (la + 2) + [1] * (lb + 1)
        pad = args.max_length - len(ids)
        feats.append({"input_ids": ids + [0] * pad, "token_type_ids": tt + [0] * pad,
                      "attention_mask": [1] * len(ids) + [0] * pad,
                      "labels": int(torch.randint(0, 2, (1,), generator=g))})
    return feats


def main(sg, steps=8, device="cpu", amp=None):
    device_type = device.split(":")[0]
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(config).to(device)

    g = torch.Generator().manual_seed(1)
    train_dataset = synthetic_pairs(16, g)
    eval_dataset = synthetic_pairs(8, g)

    # If padding was already done ot max length, we use the default data collator that will just convert everything
    # to tensors.
    data_collator = default_data_collator

    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(eval_dataset, collate_fn=data_collator, batch_size=args.per_device_eval_batch_size)

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
    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True

    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.max_train_steps,
    )

    # We need to recalculate our total training steps as the size of the training dataloader may have changed
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    # Afterwards we recalculate our number of training epochs
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    sg.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    completed_steps = 0
    starting_epoch = 0
    total_loss = 0

    @sg.compile
    def train_step(batch, step):
        nonlocal completed_steps, total_loss
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            outputs = model(**batch)
        loss = outputs.loss
        # We keep track of the loss at each epoch
        if args.with_tracking:
            total_loss += loss.detach().float()
        loss = loss / args.gradient_accumulation_steps
        loss.backward()
        if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            completed_steps += 1
        return loss

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if args.with_tracking:
            total_loss = 0
        active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = train_step(batch, step)
            sg.log({"loss": loss, "completed_steps": completed_steps})

            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        correct = seen = 0
        for step, batch in enumerate(eval_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.no_grad():
                with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                    outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = predictions, batch["labels"]
            correct += int((predictions == references).sum())
            seen += references.numel()

        eval_metric = {"accuracy": correct / seen}

        if args.with_tracking:
            sg.log({
                "accuracy": eval_metric,
                "train_loss": total_loss.item() / len(train_dataloader),
                "epoch": epoch,
                "step": completed_steps,
            })
