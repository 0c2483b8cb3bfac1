"""facebookresearch/dino: self-distillation with an EMA teacher. Student and teacher are ViTs
wrapped in ``MultiCropWrapper`` (one backbone pass per crop resolution, found on the host with
``torch.unique_consecutive`` of the crops' sizes) with a ``DINOHead``; the student in
``DistributedDataParallel`` (the program always is: here a one-process gloo group); AdamW on
``get_params_groups`` (no decay on biases and norms). Each batch (``train_one_epoch``): the lr and
weight decay of the param groups set from numpy cosine schedules indexed by the global iteration
(``param_group["lr"] = lr_schedule[it]``), teacher on the 2 global crops, student on all,
``DINOLoss`` (teacher centering and sharpening; ``update_center`` rebinds the ``center`` buffer
after a ``dist.all_reduce``), the ``math.isfinite(loss.item())`` check, ``clip_gradients`` (per
parameter: ``.item()`` of each norm and ``if clip_coef < 1``), ``cancel_gradients_last_layer`` (the
head's last layer's grads set to None during the first ``freeze_last_layer`` epochs), and the EMA
update of the teacher, ``param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)`` with ``m =
momentum_schedule[it]`` (a cosine schedule toward 1).

Model and loss: vendor/dino/ (vision_transformer.py, utils.py and main_dino.py's ``DINOLoss``,
restated: same modules, names, init draws and ops, not a copy). Loop: main_dino.py
``train_one_epoch`` (lines 301-360): the per-batch body is the step function (the crops, the batch
index and the epoch passed in). The MetricLogger's ``loss.item()`` and the lr / wd reads are taken
outside, on the step's returned loss; ``torch.cuda.synchronize()`` dropped (CPU). ``use_fp16`` is
on where the harness asks for amp (the program's default; its path is CUDA fp16 with a
GradScaler). Data: instead of ImageNet with DataAugmentationDINO, synthetic crops. Scaled down:
vit_small -> vit_tiny, global crops 224 -> 32, local crops 96 -> 16 (patch 16), local_crops_number
8 -> 2, out_dim 65536 -> 64, batch 64 -> 2, epochs 100 -> 4 with warmup_epochs 10 -> 1, 2 batches
an epoch.
"""
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import clients.vendor.dino.utils as utils
import clients.vendor.dino.vision_transformer as vits
from clients.vendor.dino.main_dino import DINOLoss
from clients.vendor.dino.vision_transformer import DINOHead

SOURCE = "https://github.com/facebookresearch/dino/blob/7c446df5b9f45747937fb0d72314eb9f7b66930a/main_dino.py"
LICENSE = "Apache-2.0"
TAGS = ("self-supervised", "ema-teacher", "vit", "ddp", "all_reduce", "numpy-schedule-in-step", "multi-crop",
        "host-reads", "clip-per-param", "grad-set-to-none", "buffer-rebind", "adamw", "param-groups")


class args:  # argparse defaults of main_dino.py, scaled down
    arch = "vit_tiny"; patch_size = 16; out_dim = 64; norm_last_layer = True; momentum_teacher = 0.996
    use_bn_in_head = False; warmup_teacher_temp = 0.04; teacher_temp = 0.04; warmup_teacher_temp_epochs = 0
    use_fp16 = False; weight_decay = 0.04; weight_decay_end = 0.4; clip_grad = 3.0; batch_size_per_gpu = 2
    epochs = 4; freeze_last_layer = 1; lr = 0.0005; warmup_epochs = 1; min_lr = 1e-6; optimizer = "adamw"
    drop_path_rate = 0.1; local_crops_number = 2; gpu = None


def _crops(g, n):
    return ([torch.rand(args.batch_size_per_gpu, 3, 32, 32, generator=g) for _ in range(2)]
            + [torch.rand(args.batch_size_per_gpu, 3, 16, 16, generator=g) for _ in range(args.local_crops_number)])


def main(sg, steps=8, device="cpu", amp=None):
    own_group = not dist.is_initialized()
    if own_group:   # (utils.init_distributed_mode: a one-process group)
        dist.init_process_group("nccl" if device == "cuda" else "gloo",   # (the program's backend on GPUs)
                                init_method=f"file://{tempfile.mktemp(prefix='dino_pg_')}",
                                world_size=1, rank=0)
    try:
        _train(sg, steps, device, amp)
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(sg, steps, device, amp):
    args.use_fp16 = amp is not None
    g = torch.Generator().manual_seed(1)
    data_loader = [(_crops(g, i), torch.zeros(args.batch_size_per_gpu, dtype=torch.long)) for i in range(2)]

    student = vits.__dict__[args.arch](
        patch_size=args.patch_size,
        drop_path_rate=args.drop_path_rate,  # stochastic depth
    )
    teacher = vits.__dict__[args.arch](patch_size=args.patch_size)
    embed_dim = student.embed_dim
    student = utils.MultiCropWrapper(student, DINOHead(
        embed_dim,
        args.out_dim,
        use_bn=args.use_bn_in_head,
        norm_last_layer=args.norm_last_layer,
    ))
    teacher = utils.MultiCropWrapper(
        teacher,
        DINOHead(embed_dim, args.out_dim, args.use_bn_in_head),
    )
    student, teacher = student.to(device), teacher.to(device)
    teacher_without_ddp = teacher
    student = nn.parallel.DistributedDataParallel(student, device_ids=args.gpu)
    teacher_without_ddp.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(
        args.out_dim,
        args.local_crops_number + 2,
        args.warmup_teacher_temp,
        args.teacher_temp,
        args.warmup_teacher_temp_epochs,
        args.epochs,
    ).to(device)

    params_groups = utils.get_params_groups(student)
    optimizer = torch.optim.AdamW(params_groups)  # to use with ViTs
    fp16_scaler = None
    if args.use_fp16:
        fp16_scaler = torch.cuda.amp.GradScaler()

    lr_schedule = utils.cosine_scheduler(
        args.lr * (args.batch_size_per_gpu * utils.get_world_size()) / 256.,  # linear scaling rule
        args.min_lr,
        args.epochs, len(data_loader),
        warmup_epochs=args.warmup_epochs,
    )
    wd_schedule = utils.cosine_scheduler(
        args.weight_decay,
        args.weight_decay_end,
        args.epochs, len(data_loader),
    )
    momentum_schedule = utils.cosine_scheduler(args.momentum_teacher, 1,
                                               args.epochs, len(data_loader))
    sg.track(student=student.module, teacher=teacher, dino_loss=dino_loss, optimizer=optimizer)

    @sg.compile
    def train_step(images, it, epoch):
        # update weight decay and learning rate according to their schedule
        it = len(data_loader) * epoch + it  # global training iteration
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["lr"] = lr_schedule[it]
            if i == 0:  # only the first group is regularized
                param_group["weight_decay"] = wd_schedule[it]

        # move images to gpu
        images = [im.to(device, non_blocking=True) for im in images]
        # teacher and student forward passes + compute dino loss
        with torch.cuda.amp.autocast(fp16_scaler is not None):
            teacher_output = teacher(images[:2])  # only the 2 global views pass through the teacher
            student_output = student(images)
            loss = dino_loss(student_output, teacher_output, epoch)

        if not math.isfinite(loss.item()):
            print("Loss is {}, stopping training".format(loss.item()), force=True)
            sys.exit(1)

        # student update
        optimizer.zero_grad()
        param_norms = None
        if fp16_scaler is None:
            loss.backward()
            if args.clip_grad:
                param_norms = utils.clip_gradients(student, args.clip_grad)
            utils.cancel_gradients_last_layer(epoch, student,
                                              args.freeze_last_layer)
            optimizer.step()
        else:
            fp16_scaler.scale(loss).backward()
            if args.clip_grad:
                fp16_scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
                param_norms = utils.clip_gradients(student, args.clip_grad)
            utils.cancel_gradients_last_layer(epoch, student,
                                              args.freeze_last_layer)
            fp16_scaler.step(optimizer)
            fp16_scaler.update()

        # EMA update for the teacher
        with torch.no_grad():
            m = momentum_schedule[it]  # momentum parameter
            for param_q, param_k in zip(student.module.parameters(), teacher_without_ddp.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
        return loss

    n = 0
    for epoch in range(0, args.epochs):
        for it, (images, _) in enumerate(data_loader):
            loss = train_step(images, it, epoch)
            sg.log(loss)
            # logging (MetricLogger)
            loss.item(), optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]
            n += 1
            if n >= steps:
                return
