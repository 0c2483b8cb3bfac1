"""sthalles/SimCLR: contrastive pre-training with the NT-Xent (InfoNCE) loss. ResNetSimCLR (a
torchvision ResNet-18 whose ``fc`` becomes an MLP projection head), Adam (lr 3e-4, weight_decay 1e-4),
CosineAnnealingLR(T_max=len(train_loader)) stepped once per epoch after the warm-up epochs, and
the program's GradScaler/autocast path (``torch.cuda.amp``; ``enabled=args.fp16_precision``).
Each batch: ``torch.cat`` of the two views, the model on them, ``info_nce_loss`` (labels from
``torch.cat([torch.arange(batch_size) for i in range(n_views)])``, ``labels.unsqueeze(0) ==
labels.unsqueeze(1)``, the similarity matrix, ``torch.eye(...).bool()`` diagonal mask and
boolean-mask indexing ``similarity_matrix[~mask].view(...)``, positives ``[labels.bool()]`` and
negatives ``[~labels.bool()]``), CrossEntropyLoss, ``optimizer.zero_grad()``,
``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``, ``scaler.update()``.

Model and loss: vendor/simclr/ (simclr.py ``SimCLR.__init__`` and ``info_nce_loss``,
models/resnet_simclr.py, utils.py ``accuracy``, restated: same modules, names and ops, not a
copy). Loop: ``SimCLR.train`` (simclr.py lines 57-99), reproduced with the per-batch body as the
step function (the list of views passed in). Every ``log_every_n_steps`` the program computes
``accuracy(logits, labels, topk=(1, 5))`` and writes loss, accuracies and
``scheduler.get_lr()[0]`` to TensorBoard: done outside the step on its returned tensors (the
writer: an in-memory stand-in). ``fp16_precision`` is on where the harness asks for amp (the
program's flag; its autocast is CUDA fp16 with the GradScaler). The ``logging.basicConfig`` of
``SimCLR.__init__`` (root logger at DEBUG into the run directory) is undone after construction: a
process-wide switch. Data: instead of STL10 with two random augmentations, two synthetic views per
image. Scaled down: 96x96 -> 32x32, batch 256 -> 4, out_dim 128 -> 16, warm-up epochs 10 -> 1, 2
batches an epoch, log_every_n_steps 100 -> 2; no checkpoint saving.
"""
import logging

import torch
from torch.cuda.amp import GradScaler, autocast

from clients.vendor.simclr.resnet_simclr import ResNetSimCLR
from clients.vendor.simclr.simclr import SimCLR
from clients.vendor.simclr.utils import accuracy

SOURCE = "https://github.com/sthalles/SimCLR/blob/1848fc934ad844ae630e6c452300433fe99acfd9/simclr.py"
LICENSE = "MIT"
TAGS = ("self-supervised", "contrastive", "nt-xent", "resnet", "batchnorm", "boolean-mask-index", "eye-mask",
        "gradscaler", "autocast", "adam", "cosine-per-epoch", "list-of-views")

warmup_epochs = 1


class args:  # argparse defaults of run.py, scaled down
    arch = "resnet18"; epochs = 200; batch_size = 4; lr = 0.0003; weight_decay = 1e-4
    fp16_precision = False; out_dim = 16; log_every_n_steps = 2; temperature = 0.07; n_views = 2


def train(self, train_loader, sg, steps):
    """SimCLR.train with the per-batch body under sg.compile."""
    scaler = GradScaler(enabled=self.args.fp16_precision)

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
        return loss, logits, labels

    n_iter = 0
    for epoch_counter in range(self.args.epochs):
        for images, _ in train_loader:
            loss, logits, labels = train_step(images)
            sg.log(loss)

            if n_iter % self.args.log_every_n_steps == 0:
                top1, top5 = accuracy(logits, labels, topk=(1, 5))
                self.writer.add_scalar('loss', loss, global_step=n_iter)
                self.writer.add_scalar('acc/top1', top1[0], global_step=n_iter)
                self.writer.add_scalar('acc/top5', top5[0], global_step=n_iter)
                self.writer.add_scalar('learning_rate', self.scheduler.get_lr()[0], global_step=n_iter)

            n_iter += 1
            if n_iter >= steps:
                return

        # warmup for the first 10 epochs
        if epoch_counter >= warmup_epochs:
            self.scheduler.step()


def main(sg, steps=8, device="cpu", amp=None):
    args.device = torch.device(device)
    args.fp16_precision = amp is not None
    g = torch.Generator().manual_seed(1)
    per_epoch = 2
    train_loader = [([torch.rand(args.batch_size, 3, 32, 32, generator=g) for _ in range(args.n_views)],
                     torch.zeros(args.batch_size, dtype=torch.long)) for _ in range(per_epoch)]

    model = ResNetSimCLR(base_model=args.arch, out_dim=args.out_dim)

    optimizer = torch.optim.Adam(model.parameters(), args.lr, weight_decay=args.weight_decay)

    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(train_loader), eta_min=0,
                                                           last_epoch=-1)

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    simclr = SimCLR(model=model, optimizer=optimizer, scheduler=scheduler, args=args)
    for h in root.handlers[len(handlers):]:
        root.removeHandler(h)
        h.close()
    root.setLevel(level)
    sg.track(model=model, optimizer=optimizer)
    train(simclr, train_loader, sg, steps)
