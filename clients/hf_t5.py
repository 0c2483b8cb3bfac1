"""transformers examples/pytorch/translation/run_translation_no_trainer.py: seq2seq training of
T5ForConditionalGeneration (labels padded with -100, ``label_pad_token_id = -100`` as
``--ignore_pad_token_for_loss`` sets it; the decoder inputs come from the model shifting the
labels right), AdamW over the script's groups (``no_decay = ["bias", "LayerNorm.weight",
"layer_norm.weight"]``), ``get_scheduler("linear")``, the script's accumulation form
(``loss = loss / args.gradient_accumulation_steps``; backward; ``optimizer.step();
lr_scheduler.step(); optimizer.zero_grad()`` when ``step % args.gradient_accumulation_steps == 0
or step == len(train_dataloader) - 1``, ``completed_steps += 1`` alongside),
``--with_tracking``'s ``total_loss += loss.detach().float()`` in the step, and per-epoch
evaluation by ``model.generate`` (greedy, max_length 8) in eval mode.

Model: the installed transformers' T5ForConditionalGeneration (not vendored), T5Config defaults
except vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2 and
decoder_start_token_id=0 (what the t5-* checkpoints' configs hold; transformers 5's T5Config
has no default for it). Loop: run_translation_no_trainer.py at 6566fb3, the epoch loop at the
end of main() (training inner loop, generate-based evaluation) without accelerate:
``accelerator.backward(loss)`` is ``loss.backward()``, gather / pad_across_processes /
unwrap_model the identity, batches moved with ``.to(device)``; accelerate's
mixed_precision="bf16" is the ``torch.autocast`` around the forward when amp == "bf16". The
sacrebleu metric and token decoding are left out (no tokenizer).

Data: the script's ``--pad_to_max_length`` path (``default_data_collator``) over synthetic
source/target token ids: sources right-padded to 12 (attention_mask 0, pad id 0), targets ending
in eos (1) padded to 8 with -100. Scaled down: 16 train / 4 eval examples, batch 4,
gradient_accumulation_steps 1 (the default), weight_decay 0.01, learning_rate 5e-5,
max_train_steps ``steps``.
"""
import math

import torch
from torch.utils.data import DataLoader
from transformers import T5Config, T5ForConditionalGeneration, default_data_collator, get_scheduler

SOURCE = ("https://github.com/huggingface/transformers/blob/6566fb3c830ab25c0cde2e0dab093b13036a53c8/"
          "examples/pytorch/translation/run_translation_no_trainer.py")
LICENSE = "Apache-2.0"
TAGS = ("transformer", "hf", "t5", "seq2seq", "encoder-decoder", "conditional-step", "lr-scheduler",
        "adamw", "weight-decay-groups", "padding-mask", "ignore-index", "dict-batch", "dropout",
        "eval-mode", "generate", "python-counter", "loss-accumulator")


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
    max_source_length = 12
    max_target_length = 8
    val_max_target_length = None
    num_beams = 1  # --num_beams 1 (the default None breaks generate() in transformers 5)
    ignore_pad_token_for_loss = True
    pad_to_max_length = True
    with_tracking = True


def synthetic_pairs(n, g, vocab=100, pad=0, eos=1):
    label_pad_token_id = -100 if args.ignore_pad_token_for_loss else pad
    feats = []
    for _ in range(n):
        ls = int(torch.randint(4, args.max_source_length, (1,), generator=g))
        lt = int(torch.randint(2, args.max_target_length, (1,), generator=g))
        src = torch.randint(2, vocab, (ls,), generator=g).tolist() + [eos]
        tgt = torch.randint(2, vocab, (lt,), generator=g).tolist() + [eos]
        feats.append({
            "input_ids": src + [pad] * (args.max_source_length - len(src)),
            "attention_mask": [1] * len(src) + [0] * (args.max_source_length - len(src)),
            "labels": tgt + [label_pad_token_id] * (args.max_target_length - len(tgt)),
        })
    return feats


def main(sg, steps=8, device="cpu", amp=None):
    device_type = device.split(":")[0]
    config = T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                      decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).to(device)

    g = torch.Generator().manual_seed(1)
    train_dataset = synthetic_pairs(16, g)
    eval_dataset = synthetic_pairs(4, g)

    # If padding was already done ot max length, we use the default data collator that will just convert everything
    # to tensors.
    data_collator = default_data_collator

    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(eval_dataset, collate_fn=data_collator, batch_size=args.per_device_eval_batch_size)

    # Optimizer
    # Split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "LayerNorm.weight", "layer_norm.weight"]
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

    # We need to recalculate our total training steps as the size of the training dataloader may have changed.
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

        if args.val_max_target_length is None:
            args.val_max_target_length = args.max_target_length

        gen_kwargs = {
            "max_length": args.val_max_target_length if args is not None else config.max_length,
            "num_beams": args.num_beams,
        }
        generated = []
        for step, batch in enumerate(eval_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.no_grad():
                generated_tokens = model.generate(
                    batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    **gen_kwargs,
                )
                generated.append(generated_tokens.cpu())

        if args.with_tracking:
            sg.log({
                "generated": generated,
                "train_loss": total_loss.item() / len(train_dataloader),
                "epoch": epoch,
                "step": completed_steps,
            })
