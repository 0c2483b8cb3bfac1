"""pytorch/examples imagenet loop on torchvision's MobileNetV2, with AdamW: the per-batch body of
imagenet/main.py ``train()`` (forward, CrossEntropyLoss, top-1/top-5 ``accuracy`` recorded in
AverageMeters with ``loss.item()`` inside the body, ``optimizer.zero_grad(); loss.backward();
optimizer.step()``), StepLR per epoch, ``validate`` between epochs.

Model: vendor/pytorch_vision/mobilenetv2.py (torchvision/models/mobilenetv2.py, verbatim but for its
one torchvision-internal import), ``mobilenet_v2()`` with default settings (width 1.0, BatchNorm,
Dropout 0.2 in the classifier), num_classes=10. Loop: imagenet/main.py lines 309-355 (``train``),
281-291 (epoch loop), 434-526 (AverageMeter / ProgressMeter / accuracy; ``all_reduce`` left out).
Changed from the program: the optimizer is ``torch.optim.AdamW(lr=1e-3, weight_decay=1e-4)``
instead of main.py's SGD (``--arch mobilenet_v2`` with an AdamW optimizer, as a user swapping it in
would write it). Scaled down: 32x32 synthetic images, batch 8, 4 batches an "epoch", one validation
batch, StepLR step_size 30 -> 1 epoch, print_freq 10, no checkpoint files.
"""
import time
from enum import Enum

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import StepLR

from clients.vendor.pytorch_vision.mobilenetv2 import mobilenet_v2

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/imagenet/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("cnn", "mobilenet", "depthwise-conv", "batchnorm", "dropout", "adamw", "steplr", "topk-accuracy", "item-in-step", "torchvision")


class args:  # argparse defaults of imagenet/main.py, scaled down
    arch = "mobilenet_v2"; lr = 1e-3; momentum = 0.9; weight_decay = 1e-4; batch_size = 8
    print_freq = 10; epochs = 90; start_epoch = 0


batches_per_epoch = 4
image_size = 32
num_classes = 10


class Summary(Enum):
    NONE = 0
    AVERAGE = 1
    SUM = 2
    COUNT = 3


class AverageMeter(object):
    """Computes and stores the average and current value"""
    def __init__(self, name, use_accel, fmt=':f', summary_type=Summary.AVERAGE):
        self.name = name
        self.use_accel = use_accel
        self.fmt = fmt
        self.summary_type = summary_type
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        fmtstr = '{name} {val' + self.fmt + '} ({avg' + self.fmt + '})'
        return fmtstr.format(**self.__dict__)


class ProgressMeter(object):
    def __init__(self, num_batches, meters, prefix=""):
        self.batch_fmtstr = self._get_batch_fmtstr(num_batches)
        self.meters = meters
        self.prefix = prefix

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch)]
        entries += [str(meter) for meter in self.meters]
        print('\t'.join(entries))

    def _get_batch_fmtstr(self, num_batches):
        num_digits = len(str(num_batches // 1))
        fmt = '{:' + str(num_digits) + 'd}'
        return '[' + fmt + '/' + fmt.format(num_batches) + ']'


def accuracy(output, target, topk=(1,)):
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
    use_accel = device != "cpu"
    model = mobilenet_v2(num_classes=num_classes).to(device)
    # define loss function (criterion), optimizer, and learning rate scheduler
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), args.lr,
                                  weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.1)  # step_size=30 epochs, scaled to 1
    sg.track(model=model, opt=optimizer, sched=scheduler)

    g = torch.Generator().manual_seed(1)
    n_epochs = -(-steps // batches_per_epoch)
    train_images = torch.randn(n_epochs, batches_per_epoch, args.batch_size, 3, image_size, image_size, generator=g)
    train_target = torch.randint(0, num_classes, (n_epochs, batches_per_epoch, args.batch_size), generator=g)
    val_images = torch.randn(args.batch_size, 3, image_size, image_size, generator=g)
    val_target = torch.randint(0, num_classes, (args.batch_size,), generator=g)

    meters = {}

    @sg.compile
    def train_step(images, target):
        losses, top1, top5 = meters["losses"], meters["top1"], meters["top5"]
        # compute output
        output = model(images)
        loss = criterion(output, target)

        # measure accuracy and record loss
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))

        # compute gradient and do SGD step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    def train(epoch, n_batches):
        batch_time = AverageMeter('Time', use_accel, ':6.3f', Summary.NONE)
        data_time = AverageMeter('Data', use_accel, ':6.3f', Summary.NONE)
        losses = AverageMeter('Loss', use_accel, ':.4e', Summary.NONE)
        top1 = AverageMeter('Acc@1', use_accel, ':6.2f', Summary.NONE)
        top5 = AverageMeter('Acc@5', use_accel, ':6.2f', Summary.NONE)
        meters.update(losses=losses, top1=top1, top5=top5)
        progress = ProgressMeter(
            batches_per_epoch,
            [batch_time, data_time, losses, top1, top5],
            prefix="Epoch: [{}]".format(epoch))

        # switch to train mode
        model.train()

        end = time.time()
        for i in range(n_batches):
            images, target = train_images[epoch, i], train_target[epoch, i]
            # measure data loading time
            data_time.update(time.time() - end)

            # move data to the same device as model
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)

            loss = train_step(images, target)
            sg.log(loss)

            # measure elapsed time
            batch_time.update(time.time() - end)
            end = time.time()

            if i % args.print_freq == 0:
                progress.display(i + 1)

    def validate():
        losses = AverageMeter('Loss', use_accel, ':.4e', Summary.NONE)
        top1 = AverageMeter('Acc@1', use_accel, ':6.2f', Summary.AVERAGE)
        top5 = AverageMeter('Acc@5', use_accel, ':6.2f', Summary.AVERAGE)
        # switch to evaluate mode
        model.eval()
        with torch.no_grad():
            images = val_images.to(device, non_blocking=True)
            target = val_target.to(device, non_blocking=True)
            # compute output
            output = model(images)
            loss = criterion(output, target)
            # measure accuracy and record loss
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses.update(loss.item(), images.size(0))
            top1.update(acc1[0], images.size(0))
            top5.update(acc5[0], images.size(0))
        return top1.avg

    best_acc1 = 0
    done = 0
    for epoch in range(args.start_epoch, n_epochs):
        n = min(batches_per_epoch, steps - done)
        # train for one epoch
        train(epoch, n)
        done += n
        # evaluate on validation set
        acc1 = validate()

        scheduler.step()

        # remember best acc@1 (save_checkpoint left out: no files)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
