"""timm (pytorch-image-models) train.py: a VisionTransformer (default settings: class token, learned
position embedding, pre-norm blocks with fused SDPA attention, LayerNorm, GELU Mlp, 'token' pooling)
trained through timm's ClassificationTask with LabelSmoothingCrossEntropy(0.1) (mixup off), AdamW
from ``create_optimizer_v2`` (no weight decay on 1-d params / pos_embed / cls_token), a cosine
schedule with warmup updated per step (``lr_scheduler.step_update(num_updates=...)``), and
``losses_m.update(loss.item() * accum_steps, batch_size)`` inside the per-batch body. bf16: train.py's
``amp_autocast = partial(torch.autocast, device_type=..., dtype=bfloat16)`` (no loss scaler for bf16).

timm cannot be imported here: timm/layers/create_norm.py imports torchvision at module level, so
timm is vendored as excerpts (vendor/pytorch_image_models/: vision_transformer.py, layers.py,
task.py, classification.py, cross_entropy.py, scheduler.py, cosine_lr.py, param_groups.py,
metrics.py; each file's header lists its lines and replaced imports). Loop: train.py
``train_one_epoch`` (lines 1231-1453; the non-distributed, non-naflex path with accum_steps 1,
no loss scaler, no clip_grad, no EMA), the epoch loop of ``main`` (1108-1143: ``lr_scheduler.step``
per epoch). Factories replaced by what they build for these arguments: ``create_optimizer_v2(model,
opt='adamw', lr, weight_decay)`` = ``param_groups_weight_decay`` + ``torch.optim.AdamW(groups, lr,
weight_decay=0.)`` (_optim_factory.py lines 270-343), ``create_scheduler_v2(sched='cosine', ...)`` =
``CosineLRScheduler(t_initial, lr_min, t_in_epochs, warmup_lr_init, warmup_t)`` (scheduler_factory.py
lines 88-143). Scaled down: img 32, patch 4, depth 2, embed dim 32, 2 heads, 10 classes, batch 8,
4 batches an "epoch", epochs 300 -> 2, warmup 5 -> 1 epoch; ``--opt adamw --sched-on-updates``
(so ``step_update`` changes the lr every step); lr from train.py's lr_base rule (0.1 x sqrt(8/256)).
"""
import logging
import math
import time
from contextlib import suppress
from functools import partial

import torch

from clients.vendor.pytorch_image_models.classification import ClassificationTask
from clients.vendor.pytorch_image_models.cosine_lr import CosineLRScheduler
from clients.vendor.pytorch_image_models.cross_entropy import LabelSmoothingCrossEntropy
from clients.vendor.pytorch_image_models.metrics import AverageMeter
from clients.vendor.pytorch_image_models.param_groups import param_groups_weight_decay
from clients.vendor.pytorch_image_models.vision_transformer import VisionTransformer

SOURCE = "https://github.com/huggingface/pytorch-image-models/blob/aa4b5850/train.py"
LICENSE = "Apache-2.0"
TAGS = ("transformer", "vit", "sdpa", "layernorm", "label-smoothing", "adamw", "param-groups", "cosine-warmup",
        "per-step-lr", "item-in-step", "autocast-bf16", "timm")

_logger = logging.getLogger('train')


class args:  # train.py defaults (and the flags named in the docstring), scaled down
    opt = 'adamw'; weight_decay = 0.05; lr = None; lr_base = 0.1; lr_base_size = 256; lr_base_scale = ''
    sched = 'cosine'; sched_on_updates = True; epochs = 2; warmup_epochs = 1; warmup_lr = 1e-5; min_lr = 0
    smoothing = 0.1; mixup = 0.; cutmix = 0.; grad_accum_steps = 1; log_interval = 50; clip_grad = None
    batch_size = 8; distributed = False; world_size = 1; prefetcher = False; channels_last = False


batches_per_epoch = 4
num_classes = 10


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    model = VisionTransformer(img_size=32, patch_size=4, num_classes=num_classes, embed_dim=32, depth=2,
                              num_heads=2)
    model.to(device=device)

    # setup automatic mixed-precision (AMP) loss scaling and op casting
    amp_autocast = suppress  # do nothing
    loss_scaler = None
    if amp == "bf16":
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)

    global_batch_size = args.batch_size * args.world_size * args.grad_accum_steps
    if args.lr is None:
        batch_ratio = global_batch_size / args.lr_base_size
        if not args.lr_base_scale:
            on = args.opt.lower()
            args.lr_base_scale = 'sqrt' if any([o in on for o in ('ada', 'lamb')]) else 'linear'
        if args.lr_base_scale == 'sqrt':
            batch_ratio = batch_ratio ** 0.5
        args.lr = args.lr_base * batch_ratio

    # setup loss function (mixup off, smoothing on)
    train_loss_fn = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    train_loss_fn = train_loss_fn.to(device=device)

    task = ClassificationTask(model=model, criterion=train_loss_fn, device=device, dtype=None, verbose=False)
    model = task.get_trainable_module()

    # create_optimizer_v2(model, opt='adamw', lr=args.lr, weight_decay=args.weight_decay):
    no_weight_decay = getattr(model, 'no_weight_decay', lambda: set())()
    params = param_groups_weight_decay(model, weight_decay=args.weight_decay, no_weight_decay_list=no_weight_decay)
    optimizer = torch.optim.AdamW(params, weight_decay=0., lr=args.lr)

    updates_per_epoch = (batches_per_epoch + args.grad_accum_steps - 1) // args.grad_accum_steps
    # create_scheduler_v2(optimizer, sched='cosine', ..., updates_per_epoch=updates_per_epoch):
    step_on_epochs = not args.sched_on_updates
    t_initial, warmup_t = args.epochs, args.warmup_epochs
    if not step_on_epochs:
        t_initial, warmup_t = t_initial * updates_per_epoch, warmup_t * updates_per_epoch
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=t_initial, lr_min=args.min_lr, t_in_epochs=step_on_epochs,
                                     warmup_lr_init=args.warmup_lr, warmup_t=warmup_t)
    num_epochs = args.epochs
    sg.track(model=model, opt=optimizer, sched=lr_scheduler)

    g = torch.Generator().manual_seed(1)
    n_epochs = min(num_epochs, -(-steps // batches_per_epoch))
    data = [[(torch.randn(args.batch_size, 3, 32, 32, generator=g),
              torch.randint(0, num_classes, (args.batch_size,), generator=g))
             for _ in range(min(batches_per_epoch, steps - e * batches_per_epoch))] for e in range(n_epochs)]

    state = {}

    @sg.compile
    def train_step(input, target):
        accum_steps, need_update, losses_m = state['accum_steps'], state['need_update'], state['losses_m']

        def _forward():
            with amp_autocast():
                # Task handles the complete forward pass and loss computation
                result = task(input, target)
                _loss = result['loss']

            if accum_steps > 1:
                _loss /= accum_steps
            return _loss, result

        def _backward(_loss):
            _loss.backward()
            if need_update:
                optimizer.step()

        batch_size = input.shape[0]
        loss, result = _forward()
        _backward(loss)

        losses_m.update(loss.item() * accum_steps, batch_size)
        if need_update:
            optimizer.zero_grad()
            task.update_ema(step=state['num_updates'] + 1)
        return loss

    def train_one_epoch(epoch, loader):
        update_time_m = AverageMeter()
        data_time_m = AverageMeter()
        losses_m = AverageMeter()

        trainable_module = task.get_trainable_module()
        trainable_module.train()

        accum_steps = args.grad_accum_steps
        last_accum_steps = len(loader) % accum_steps
        updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
        num_updates = epoch * updates_per_epoch
        last_batch_idx = len(loader) - 1
        last_batch_idx_to_accum = len(loader) - last_accum_steps

        data_start_time = update_start_time = time.time()
        optimizer.zero_grad()
        update_sample_count = 0
        for batch_idx, (input, target) in enumerate(loader):
            last_batch = batch_idx == last_batch_idx
            need_update = last_batch or (batch_idx + 1) % accum_steps == 0
            update_idx = batch_idx // accum_steps
            if batch_idx >= last_batch_idx_to_accum:
                accum_steps = last_accum_steps

            input, target = input.to(device=device, dtype=None), target.to(device=device)
            # multiply by accum steps to get equivalent for full update
            data_time_m.update(accum_steps * (time.time() - data_start_time))

            state.update(accum_steps=accum_steps, need_update=need_update, losses_m=losses_m,
                         num_updates=num_updates)
            loss = train_step(input, target)
            sg.log(loss)
            update_sample_count += input.shape[0] * args.world_size

            if not need_update:
                data_start_time = time.time()
                continue

            num_updates += 1
            time_now = time.time()
            update_time_m.update(time.time() - update_start_time)
            update_start_time = time_now

            if update_idx % args.log_interval == 0 or last_batch:
                lrl = [param_group['lr'] for param_group in optimizer.param_groups]
                lr = sum(lrl) / len(lrl)
                loss_avg, loss_now = losses_m.avg, losses_m.val
                _logger.info(
                    f'Train: {epoch} [{update_idx:>4d}/{updates_per_epoch} '
                    f'({100. * (update_idx + 1) / updates_per_epoch:>3.0f}%)]  '
                    f'Loss: {loss_now:#.3g} ({loss_avg:#.3g})  '
                    f'Time: {update_time_m.val:.3f}s, {update_sample_count / update_time_m.val:>7.2f}/s  '
                    f'({update_time_m.avg:.3f}s, {update_sample_count / update_time_m.avg:>7.2f}/s)  '
                    f'LR: {lr:.3e}  '
                    f'Data: {data_time_m.val:.3f} ({data_time_m.avg:.3f})'
                )

            if lr_scheduler is not None:
                lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)

            update_sample_count = 0
            data_start_time = time.time()
        return {'loss': losses_m.avg}

    for epoch in range(0, n_epochs):
        train_metrics = train_one_epoch(epoch, data[epoch])
        epoch_p_1 = epoch + 1
        if lr_scheduler is not None:
            # step LR for next epoch, take care when using metric dependent lr_scheduler
            lr_scheduler.step(epoch_p_1, metric=None)
