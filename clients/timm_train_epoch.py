"""timm (pytorch-image-models) train.py ``train_one_epoch`` with the features a timm user turns on:
``--mixup 0.8 --cutmix 1.0`` (``Mixup``, mode 'batch', label smoothing 0.1 folded into the soft
targets; its ``lam`` and cutmix box drawn from ``numpy.random``), ``SoftTargetCrossEntropy`` (what
train.py picks when mixup is active), ``--model-ema --model-ema-warmup`` (``task.setup_ema`` ->
``ModelEmaV3``, updated by ``task.update_ema(step=num_updates)`` after ``optimizer.zero_grad()``: a
foreach lerp over the state dict, BatchNorm buffers included, ``num_batches_tracked`` copied),
``--clip-grad 1.0`` (mode 'norm', through the ``loss_scaler(...)`` call), AdamW and a cosine schedule
stepped per update (``--sched-on-updates``: ``lr_scheduler.step_update(num_updates=..., metric=
losses_m.avg)``), ``losses_m.update(loss.item() * accum_steps, batch_size)`` in the body.

The step is the per-batch body of ``train_one_epoch`` (train.py lines 1283-1395: ``input.to``, the
``mixup_fn`` call where train.py has it (the non-prefetcher path), ``_forward``/``_backward``, the
meter, ``optimizer.zero_grad()``, ``task.update_ema``); the loop keeps the timing, logging and
``step_update`` (lines 1396-1431). Loss scaler: train.py makes ``NativeScaler`` only for CUDA float16
AMP; here it is made on every device (``NativeScaler(device=device.type)``: GradScaler on the CPU,
fp32, scale 65536) so its ``scale(loss).backward()``, ``unscale_``, ``dispatch_clip_grad``,
``step``, ``update`` path runs -- the one deviation. Vendored: vendor/timm_train/ (mixup.py,
model_ema.py, cuda.py, agc.py, classification.py verbatim; clip_grad.py and task.py with their timm
imports made relative; model.py an excerpt) and, from vendor/pytorch_image_models/ (same commit),
SoftTargetCrossEntropy, CosineLRScheduler, AverageMeter, param_groups_weight_decay. Factories
replaced by what they build: ``create_optimizer_v2(opt='adamw')`` and ``create_scheduler_v2(
sched='cosine')`` as in clients/timm_vit.py. The model is a small BatchNorm CNN written here (not a
timm model: timm's model files import torchvision). Scaled down: 16x16 images, 10 classes, batch 8,
4 batches an "epoch", 2 epochs, warmup 1 epoch, EMA decay 0.9998 with warmup.
"""
import logging
import time
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn

from clients.vendor.pytorch_image_models.cosine_lr import CosineLRScheduler
from clients.vendor.pytorch_image_models.cross_entropy import SoftTargetCrossEntropy
from clients.vendor.pytorch_image_models.metrics import AverageMeter
from clients.vendor.pytorch_image_models.param_groups import param_groups_weight_decay
from clients.vendor.timm_train.classification import ClassificationTask
from clients.vendor.timm_train.cuda import NativeScaler
from clients.vendor.timm_train.mixup import Mixup

SOURCE = "https://github.com/huggingface/pytorch-image-models/blob/aa4b5850c1543fa488abf260f18390eda46cf85d/train.py"
LICENSE = "Apache-2.0"
TAGS = ("cnn", "batchnorm", "mixup", "cutmix", "numpy-random", "soft-target", "ema", "grad-scaler", "clip-grad",
        "adamw", "cosine-warmup", "per-step-lr", "item-in-step", "timm")

_logger = logging.getLogger('train')


class args:  # train.py defaults and the flags named in the docstring, scaled down
    opt = 'adamw'; weight_decay = 0.05; lr = 1e-3; sched = 'cosine'; sched_on_updates = True; epochs = 2
    warmup_epochs = 1; warmup_lr = 1e-5; min_lr = 0; smoothing = 0.1; mixup = 0.8; cutmix = 1.0
    cutmix_minmax = None; mixup_prob = 1.0; mixup_switch_prob = 0.5; mixup_mode = 'batch'; mixup_off_epoch = 0
    model_ema = True; model_ema_decay = 0.9998; model_ema_warmup = True; model_ema_force_cpu = False
    clip_grad = 1.0; clip_mode = 'norm'; grad_accum_steps = 1; log_interval = 50; batch_size = 8
    distributed = False; world_size = 1; prefetcher = False; channels_last = False; synchronize_step = False
    num_classes = 10


class SmallNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True))
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


batches_per_epoch = 4
image_size = 16   # (clients/_zoo.py sets it for the timm models it trains with this program)


def main(sg, steps=8, device="cpu", amp=None, mixup_in_step=True):
    device = torch.device(device)
    model = SmallNet(num_classes=args.num_classes)
    model.to(device=device)

    amp_autocast = suppress  # do nothing
    loss_scaler = NativeScaler(device=device.type)   # (train.py: CUDA float16 AMP only; see docstring)
    if amp == "bf16":
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)

    mixup_fn = None
    mixup_active = args.mixup > 0 or args.cutmix > 0. or args.cutmix_minmax is not None
    if mixup_active:
        mixup_args = dict(
            mixup_alpha=args.mixup,
            cutmix_alpha=args.cutmix,
            cutmix_minmax=args.cutmix_minmax,
            prob=args.mixup_prob,
            switch_prob=args.mixup_switch_prob,
            mode=args.mixup_mode,
            label_smoothing=args.smoothing,
            num_classes=args.num_classes
        )
        mixup_fn = Mixup(**mixup_args)

    # smoothing is handled with mixup target transform which outputs sparse, soft targets
    train_loss_fn = SoftTargetCrossEntropy()
    train_loss_fn = train_loss_fn.to(device=device)

    task = ClassificationTask(model=model, criterion=train_loss_fn, device=device, dtype=None, verbose=False)
    model = task.get_trainable_module()

    # create_optimizer_v2(model, opt='adamw', lr=args.lr, weight_decay=args.weight_decay):
    no_weight_decay = getattr(model, 'no_weight_decay', lambda: set())()
    params = param_groups_weight_decay(model, weight_decay=args.weight_decay, no_weight_decay_list=no_weight_decay)
    optimizer = torch.optim.AdamW(params, weight_decay=0., lr=args.lr)

    if args.model_ema:
        # Important to create EMA model after cuda(), DP wrapper, and AMP but before DDP wrapper
        task.setup_ema(
            decay=args.model_ema_decay,
            use_warmup=args.model_ema_warmup,
            device='cpu' if args.model_ema_force_cpu else None,
        )

    updates_per_epoch = (batches_per_epoch + args.grad_accum_steps - 1) // args.grad_accum_steps
    step_on_epochs = not args.sched_on_updates
    t_initial, warmup_t = args.epochs, args.warmup_epochs
    if not step_on_epochs:
        t_initial, warmup_t = t_initial * updates_per_epoch, warmup_t * updates_per_epoch
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=t_initial, lr_min=args.min_lr, t_in_epochs=step_on_epochs,
                                     warmup_lr_init=args.warmup_lr, warmup_t=warmup_t)
    sg.track(model=model, ema=task.get_trainable_module(ema=True), opt=optimizer, sched=lr_scheduler,
             scaler=loss_scaler._scaler)

    g = torch.Generator().manual_seed(1)
    n_epochs = min(args.epochs, -(-steps // batches_per_epoch))
    data = [[(torch.randn(args.batch_size, 3, image_size, image_size, generator=g),
              torch.randint(0, args.num_classes, (args.batch_size,), generator=g))
             for _ in range(min(batches_per_epoch, steps - e * batches_per_epoch))] for e in range(n_epochs)]
    second_order = hasattr(optimizer, 'is_second_order') and optimizer.is_second_order
    model_dtype = None
    state = {}

    @sg.compile
    def train_batch(input, target):
        accum_steps, need_update, losses_m = state['accum_steps'], state['need_update'], state['losses_m']
        if not args.prefetcher:
            input, target = input.to(device=device, dtype=model_dtype), target.to(device=device)
            if mixup_fn is not None and mixup_in_step:
                input, target = mixup_fn(input, target)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)

        def _forward():
            with amp_autocast():
                # Task handles the complete forward pass and loss computation
                result = task(input, target)
                _loss = result['loss']

            if accum_steps > 1:
                _loss /= accum_steps
            return _loss, result

        def _backward(_loss):
            clip_parameters = None
            if args.clip_grad is not None:
                clip_parameters = task.get_clip_parameters(exclude_head='agc' in args.clip_mode)
            if loss_scaler is not None:
                loss_scaler(
                    _loss,
                    optimizer,
                    clip_grad=args.clip_grad,
                    clip_mode=args.clip_mode,
                    parameters=clip_parameters,
                    create_graph=second_order,
                    need_update=need_update,
                )
            else:
                _loss.backward(create_graph=second_order)
                if need_update:
                    optimizer.step()

        batch_size = input.shape[0]
        loss, result = _forward()
        _backward(loss)

        losses_m.update(loss.item() * accum_steps, batch_size)
        if need_update:
            num_updates = state['num_updates'] + 1
            optimizer.zero_grad()
            task.update_ema(step=num_updates)
        return loss

    def train_one_epoch(epoch, loader):
        if args.mixup_off_epoch and epoch >= args.mixup_off_epoch:
            if mixup_fn is not None:
                mixup_fn.mixup_enabled = False
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

            if mixup_fn is not None and not mixup_in_step:   # (timm_train_epoch_mixup_outside)
                input, target = mixup_fn(input, target)
            data_time_m.update(accum_steps * (time.time() - data_start_time))
            state.update(accum_steps=accum_steps, need_update=need_update, losses_m=losses_m,
                         num_updates=num_updates)
            loss = train_batch(input, target)
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
                    f'LR: {lr:.3e}  '
                )

            if lr_scheduler is not None:
                lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)

            update_sample_count = 0
            data_start_time = time.time()
        return {'loss': losses_m.avg}

    for epoch in range(0, n_epochs):
        train_one_epoch(epoch, data[epoch])
        if lr_scheduler is not None:
            lr_scheduler.step(epoch + 1, metric=None)
