"""timm (pytorch-image-models) train.py with ``--grad-checkpointing``: ``model.set_grad_checkpointing(
enable=True)`` on a VisionTransformer, whose ``forward_features`` then runs its blocks through
``checkpoint_seq(self.blocks, x)`` (one ``torch.utils.checkpoint.checkpoint`` per block,
``use_reentrant=False``: timm's default), with the dropouts a regularized ViT trains with
(``--drop 0.1 --drop-path 0.1`` and attention/projection dropout 0.1): dropout masks and
DropPath's per-sample draws inside each checkpointed block, which backward recomputes and must
draw identically (checkpoint saves and restores the RNG state around the recomputation).
``activation_checkpointing_reentrant`` runs the same with timm's reentrant flag set
(``set_reentrant_ckpt(True)``: ``use_reentrant=True``).

Loop: train.py ``train_one_epoch``'s per-batch body (non-distributed, accum_steps 1, no loss
scaler, no EMA): ``task(input, target)`` -> loss, ``loss.backward()``, ``optimizer.step()``,
``losses_m.update(loss.item(), batch_size)``, ``optimizer.zero_grad()``; the lr scheduler's
``step_update`` per update in the loop. Model and task: clients/timm_vit.py's vendored excerpts
(timm's checkpoint helpers restated in vendor/pytorch_image_models/checkpointing.py). Factories
replaced by what they build as in clients/timm_vit.py. Scaled down: img 32, patch 8, depth 3,
embed dim 32, 2 heads, 10 classes, batch 4, 3 batches an "epoch", 2 epochs, warmup 1 epoch.
"""
import time

import torch

from clients.vendor.pytorch_image_models import checkpointing
from clients.vendor.pytorch_image_models.classification import ClassificationTask
from clients.vendor.pytorch_image_models.cosine_lr import CosineLRScheduler
from clients.vendor.pytorch_image_models.metrics import AverageMeter
from clients.vendor.pytorch_image_models.param_groups import param_groups_weight_decay
from clients.vendor.pytorch_image_models.vision_transformer import VisionTransformer

SOURCE = "https://github.com/huggingface/pytorch-image-models/blob/aa4b5850/train.py"
LICENSE = "Apache-2.0"
TAGS = ("transformer", "vit", "activation-checkpointing", "dropout", "drop-path", "rng-replay", "adamw",
        "cosine-warmup", "per-step-lr", "item-in-step", "timm")

REENTRANT = False


class args:  # train.py flags named in the docstring, scaled down
    lr = 1e-3; weight_decay = 0.05; epochs = 2; warmup_epochs = 1; warmup_lr = 1e-5; min_lr = 0
    drop = 0.1; drop_path = 0.1; attn_drop = 0.1; batch_size = 4; grad_checkpointing = True


batches_per_epoch = 3
num_classes = 10


def main(sg, steps=8, device="cpu", amp=None, reentrant=None):
    checkpointing.set_reentrant_ckpt(REENTRANT if reentrant is None else reentrant)
    try:
        _main(sg, steps, torch.device(device), amp)
    finally:
        checkpointing.set_reentrant_ckpt(False)


def _main(sg, steps, device, amp):
    model = VisionTransformer(img_size=32, patch_size=8, num_classes=num_classes, embed_dim=32, depth=3,
                              num_heads=2, drop_rate=args.drop, proj_drop_rate=args.drop,
                              attn_drop_rate=args.attn_drop, drop_path_rate=args.drop_path)
    if args.grad_checkpointing:
        model.set_grad_checkpointing(enable=True)
    model.to(device=device)
    task = ClassificationTask(model=model, criterion=torch.nn.CrossEntropyLoss().to(device), device=device,
                              dtype=None, verbose=False)
    model = task.get_trainable_module()
    params = param_groups_weight_decay(model, weight_decay=args.weight_decay,
                                       no_weight_decay_list=model.no_weight_decay())
    optimizer = torch.optim.AdamW(params, weight_decay=0., lr=args.lr)
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * batches_per_epoch, lr_min=args.min_lr,
                                     t_in_epochs=False, warmup_lr_init=args.warmup_lr,
                                     warmup_t=args.warmup_epochs * batches_per_epoch)
    sg.track(model=model, opt=optimizer, sched=lr_scheduler)

    g = torch.Generator().manual_seed(1)
    n_epochs = -(-steps // batches_per_epoch)
    data = [[(torch.randn(args.batch_size, 3, 32, 32, generator=g),
              torch.randint(0, num_classes, (args.batch_size,), generator=g))
             for _ in range(min(batches_per_epoch, steps - e * batches_per_epoch))] for e in range(n_epochs)]
    state = {}

    @sg.compile
    def train_step(input, target):
        losses_m = state["losses_m"]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            loss = task(input, target)["loss"]
        loss.backward()
        optimizer.step()
        losses_m.update(loss.item(), input.shape[0])
        optimizer.zero_grad()
        return loss

    num_updates = 0
    for epoch in range(n_epochs):
        losses_m, update_time_m = AverageMeter(), AverageMeter()
        state["losses_m"] = losses_m
        task.get_trainable_module().train()
        start = time.time()
        for input, target in data[epoch]:
            input, target = input.to(device), target.to(device)
            loss = train_step(input, target)
            sg.log({"loss": loss, "avg": losses_m.avg, "count": losses_m.count})
            num_updates += 1
            update_time_m.update(time.time() - start)
            start = time.time()
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)
        lr_scheduler.step(epoch + 1, metric=None)
