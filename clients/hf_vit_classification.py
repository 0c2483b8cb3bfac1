"""transformers examples/pytorch/image-classification/run_image_classification_no_trainer.py:
image classification with ViTForImageClassification: AdamW over the script's two parameter groups
(``no_decay = ["bias", "LayerNorm.weight"]``), ``get_scheduler("linear")`` built with the
script's ``num_warmup_steps * gradient_accumulation_steps`` / ``max_train_steps *
gradient_accumulation_steps``, the training inner loop (``outputs = model(**batch); loss =
outputs.loss``; ``--with_tracking``'s ``total_loss += loss.detach().float()``; backward;
``optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()``; ``completed_steps += 1`` when
the accelerator synchronised the gradients), and the per-epoch evaluation (model.eval(), no_grad
forward, argmax predictions, accuracy) with its log of ``total_loss.item() / len(train_dataloader)``.

Model: the installed transformers' ViTForImageClassification (not vendored), built from a
ViTConfig (the script's from_pretrained config with num_labels / label2id / id2label /
finetuning_task, here from scratch: no hub access) with the library defaults except the sizes:
hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
patch_size=8, num_labels=4 (default attention implementation; the script's own ``i2label`` typo
is kept as the extra config kwarg it is). Loop: run_image_classification_no_trainer.py at
2774ec0, the epoch loop at the end of main() without accelerate: with the script's default
``--gradient_accumulation_steps 1`` ``accelerator.accumulate(model)`` syncs at every batch, so
``optimizer.step()`` / ``lr_scheduler.step()`` / ``zero_grad()`` run every batch and
``accelerator.sync_gradients`` is always True; ``accelerator.backward(loss)`` is
``loss.backward()``, ``accelerator.gather_for_metrics`` the identity; the ``evaluate`` accuracy
metric is computed by hand. No checkpointing / hub / progress bar.

Data: the script's train transforms (RandomResizedCrop, RandomHorizontalFlip, ToTensor,
Normalize with the ViT image processor's mean/std 0.5) run in the dataset, outside the step; here
synthetic 3x32x32 images in [0, 1] get a random horizontal flip and that Normalize, and
``collate_fn`` stacks ``pixel_values`` and makes ``labels`` as the script does. Scaled down:
16 train / 8 eval examples, batch 4, weight_decay 0.01 (script default 0.0, set so both groups
differ), learning_rate 5e-5, num_warmup_steps 0, max_train_steps ``steps``.

Restated after the source, not copied.
"""
import math

import torch
from torch.utils.data import DataLoader
from transformers import ViTConfig, ViTForImageClassification, get_scheduler

SOURCE = ("https://github.com/huggingface/transformers/blob/2774ec03290870685d54386e9bbb1cb6fa09d10b/"
          "examples/pytorch/image-classification/run_image_classification_no_trainer.py")
LICENSE = "Apache-2.0"
TAGS = ("transformer", "hf", "vit", "image-classification", "lr-scheduler", "adamw", "weight-decay-groups",
        "dict-batch", "eval-mode", "python-counter", "loss-accumulator", "sdpa")


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
    with_tracking = True


image_size = 32
labels = ["cat", "dog", "ship", "truck"]
image_mean = [0.5, 0.5, 0.5]
image_std = [0.5, 0.5, 0.5]


def synthetic_split(n, g, train):
    """Examples as the dataset's with_transform gives them: {"pixel_values": CHW tensor, "labels": int}."""
    mean = torch.tensor(image_mean).view(3, 1, 1)
    std = torch.tensor(image_std).view(3, 1, 1)
    out = []
    for _ in range(n):
        img = torch.rand(3, image_size, image_size, generator=g)      # ToTensor's [0, 1] range
        if train and bool(torch.rand(1, generator=g) < 0.5):          # RandomHorizontalFlip
            img = img.flip(-1)
        out.append({"pixel_values": (img - mean) / std,               # Normalize
                    "labels": int(torch.randint(0, len(labels), (1,), generator=g))})
    return out


def main(sg, steps=8, device="cpu", amp=None):
    device_type = device.split(":")[0]
    label2id = {label: str(i) for i, label in enumerate(labels)}
    id2label = {str(i): label for i, label in enumerate(labels)}
    config = ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=image_size, patch_size=8,
        num_labels=len(labels), i2label=id2label, label2id=label2id, finetuning_task="image-classification",
    )
    model = ViTForImageClassification(config).to(device)

    g = torch.Generator().manual_seed(1)
    train_dataset = synthetic_split(16, g, train=True)
    eval_dataset = synthetic_split(8, g, train=False)

    # DataLoaders creation:
    def collate_fn(examples):
        pixel_values = torch.stack([example["pixel_values"] for example in examples])
        labels = torch.tensor([example["labels"] for example in examples])
        return {"pixel_values": pixel_values, "labels": labels}

    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=collate_fn, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(eval_dataset, collate_fn=collate_fn, batch_size=args.per_device_eval_batch_size)

    # Optimizer: two groups, the second (biases and LayerNorm weights) without weight decay.
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
        num_warmup_steps=args.num_warmup_steps * args.gradient_accumulation_steps,
        num_training_steps=args.max_train_steps * args.gradient_accumulation_steps,
    )

    # The total number of steps again, and from it the number of epochs.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    sg.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    completed_steps = 0
    starting_epoch = 0
    total_loss = 0

    @sg.compile
    def train_step(batch):
        # (the body of ``with accelerator.accumulate(model):``)
        nonlocal total_loss
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            outputs = model(**batch)
        loss = outputs.loss
        # We keep track of the loss at each epoch
        if args.with_tracking:
            total_loss += loss.detach().float()
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        return loss

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if args.with_tracking:
            total_loss = 0
        active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = train_step(batch)
            sync_gradients = True  # gradient_accumulation_steps == 1: every batch syncs
            if sync_gradients:
                completed_steps += 1
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
