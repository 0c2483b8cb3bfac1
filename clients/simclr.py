"""sthalles/SimCLR: contrastive pre-training. A torchvision ResNet-18 whose ``fc`` becomes an MLP
projection head; two augmented views of each image concatenated into one batch; the InfoNCE loss
(``info_nce_loss``: labels from ``torch.arange`` equality, ``F.normalize``, the similarity matrix with
its diagonal removed by boolean-mask indexing, positives and negatives selected by masks,
``torch.cat`` into logits over ``temperature``) with ``CrossEntropyLoss``; Adam (lr 3e-4,
weight_decay 1e-4) through ``torch.cuda.amp.GradScaler(enabled=fp16_precision)`` and
``autocast(enabled=fp16_precision)``: ``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``,
``scaler.update()``; a CosineAnnealingLR stepped per epoch after 10 warmup epochs.

Model and loss: vendor/simclr/ (ResNetSimCLR, SimCLR.__init__ and info_nce_loss, verbatim; the
ResNet from vendor/pytorch_vision). Loop: simclr.py ``SimCLR.train`` (lines 58-89): the step function is
the per-batch body from ``images = torch.cat(images, dim=0)`` to ``scaler.update()``, with ``self``
the SimCLR object; the ``accuracy`` (utils.py, verbatim below) and tensorboard logging every
``log_every_n_steps`` run in the loop on the returned logits (``scheduler.get_lr()`` read as
``get_last_lr()``, the value it logs outside a scheduler step). fp32 by default (run.py's default, no
``--fp16-precision``); with ``amp`` set on CUDA the program's ``--fp16-precision`` path runs (fp16
autocast and a live GradScaler), as written. Scaled down: 4 images of 3x32x32 (the cifar10 option;
synthetic views, seeded) instead of 256, 4 batches an epoch, log_every_n_steps 2.
"""
import types

import torch
from torch.cuda.amp import GradScaler, autocast

from clients.vendor.simclr.resnet_simclr import ResNetSimCLR
from clients.vendor.simclr.simclr import SimCLR

SOURCE = "https://github.com/sthalles/SimCLR/blob/1848fc9/simclr.py"
LICENSE = "MIT"
TAGS = ("contrastive", "info-nce", "resnet", "boolean-mask-indexing", "grad-scaler", "autocast", "adam",
        "projection-head", "method-step")


def accuracy(output, target, topk=(1,)):  # utils.py lines 21-35, verbatim
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))

        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


def main(sg, steps=8, device="cpu", amp=None):
    args = types.SimpleNamespace(  # run.py's argparse defaults, scaled down
        arch='resnet18', epochs=2, batch_size=4, lr=0.0003, weight_decay=1e-4, fp16_precision=amp is not None,
        out_dim=128, log_every_n_steps=2, temperature=0.07, n_views=2, device=torch.device(device))
    per_epoch = 4
    args.epochs = (steps + per_epoch - 1) // per_epoch
    g = torch.Generator().manual_seed(1)
    # (ContrastiveLearningViewGenerator: n_views augmented views of each image)
    train_loader = [([torch.rand(args.batch_size, 3, 32, 32, generator=g) for _ in range(args.n_views)], None)
                    for _ in range(steps)]

    model = ResNetSimCLR(base_model=args.arch, out_dim=args.out_dim)

    optimizer = torch.optim.Adam(model.parameters(), args.lr, weight_decay=args.weight_decay)

    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(train_loader), eta_min=0,
                                                           last_epoch=-1)
    self = SimCLR(model=model, optimizer=optimizer, scheduler=scheduler, args=args)
    sg.track(model=model, optimizer=optimizer, scheduler=scheduler)

    scaler = GradScaler(enabled=self.args.fp16_precision)
    sg.track(scaler=scaler)

    @sg.compile
    def train_step(images):
        images = torch.cat(images, dim=0)

        images = images.to(self.args.device)

        with autocast(enabled=self.args.fp16_precision):
            features = self.model(images)
            logits, labels = self.info_nce_loss(features)
            loss = self.criterion(logits, labels)

        self.optimizer.zero_grad()

        scaler.scale(loss).backward()

        scaler.step(self.optimizer)
        scaler.update()
        return logits, labels, loss

    n_iter = 0
    for epoch_counter in range(self.args.epochs):
        for images, _ in train_loader[epoch_counter * per_epoch:(epoch_counter + 1) * per_epoch]:
            logits, labels, loss = train_step(images)
            sg.log(loss)

            if n_iter % self.args.log_every_n_steps == 0:
                top1, top5 = accuracy(logits, labels, topk=(1, 5))
                sg.log((loss, top1[0], top5[0], self.scheduler.get_last_lr()[0], n_iter))

            n_iter += 1

        # warmup for the first 10 epochs
        if epoch_counter >= 10:
            self.scheduler.step()
