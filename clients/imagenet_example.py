"""pytorch/examples imagenet, with the whole per-batch body of ``train()`` compiled: the program's
timing meters, ``end = time.time()`` and the ``progress.display(i + 1)`` every ``print_freq``
batches inside the step, as a user wrapping the loop body of ``train()`` would leave them. (The
corpus's torchvision_resnet runs the same program with timing and display kept outside the step
and torchvision's resnet18; this client keeps them in, and writes its model itself.)

The program: ``main_worker`` builds the model, ``nn.CrossEntropyLoss().to(device)``,
``torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
weight_decay=args.weight_decay)`` and ``StepLR(optimizer, step_size=30, gamma=0.1)``; per epoch
``train(...)``, ``validate(...)``, ``scheduler.step()`` and ``best_acc1``. ``train()`` makes five
``AverageMeter``s (Time, Data, Loss, Acc@1, Acc@5; ``Summary.NONE``) and a ``ProgressMeter``,
``model.train()``, ``end = time.time()``, then per batch: ``data_time.update(time.time() - end)``,
``images.to(device, non_blocking=True)`` (and target), ``output = model(images)``, ``loss =
criterion(output, target)``, ``acc1, acc5 = accuracy(output, target, topk=(1, 5))`` (``topk``,
``t()``, ``eq`` against the expanded target, ``correct[:k].reshape(-1).float().sum(0,
keepdim=True)``, ``mul_(100.0 / batch_size)``, under ``torch.no_grad()``),
``losses.update(loss.item(), images.size(0))``, ``top1.update(acc1[0], images.size(0))`` (a 0-dim
tensor: the meter's ``sum`` and ``avg`` become tensors), ``top5`` likewise,
``optimizer.zero_grad()``, ``loss.backward()``, ``optimizer.step()``,
``batch_time.update(time.time() - end)``, ``end = time.time()``, and ``if i % args.print_freq ==
0: progress.display(i + 1)`` (``str`` of every meter: ``'{val:6.2f}'`` formats the tensor ``val``).
``validate()`` runs ``run_validate`` under ``torch.no_grad()`` in eval mode with its own meters and
``progress.display_summary()`` and returns ``top1.avg``.

What is compiled: the body of ``train()``'s ``for i, (images, target) in enumerate(train_loader)``
loop, as ``train_batch(i, images, target)``. Its names are ``train()``'s locals in the program; here
the step is defined once in ``main`` (so one step function serves every epoch), the meters, the
``ProgressMeter`` and ``end`` live in ``main``'s scope, ``train()`` creates them each epoch as the
program does (``nonlocal``), and the step rebinds ``end`` (``nonlocal end``). Everything else as
the program writes it.

Source: https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/imagenet/main.py
BSD-3-Clause. Restated after the source, not copied: same classes, names, ops and order.
Deviations: torchvision is not used (it may not be installable here): the model is a small
ResNet written in this file after torchvision's ``resnet.py`` (``BasicBlock`` with 3x3 convs without
bias, BatchNorm, ``ReLU(inplace=True)``, a 1x1-conv + BatchNorm downsample; the 7x7 stride-2 stem
and 3x3 max-pool; ``AdaptiveAvgPool2d((1, 1))``, ``fc``; kaiming_normal_ fan_out init of the convs,
BatchNorm weight 1 and bias 0) with two stages of one block, widths 16 and 32, instead of
``models.__dict__[args.arch]()``; the ImageFolder data (or ``--dummy`` FakeData) are synthetic
tensors in a ``TensorDataset`` read by ``DataLoader(shuffle=True)`` (``workers`` 0, no pin_memory);
no DataParallel/DDP, no ``save_checkpoint`` files; argparse replaced by an ``args`` class. Scaled
down: 224x224 images -> 32x32, 1000 classes -> 10, batch 256 -> 8, 32 training images (4 batches
an epoch), 8 validation images, epochs 90 -> 2, StepLR step_size 30 -> 1, print_freq 10 -> 3 (so a
progress line at batches 1 and 4 of each epoch).
"""
import time
from enum import Enum

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/imagenet/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("cnn", "resnet", "batchnorm", "sgd-momentum", "steplr", "topk-accuracy", "item-in-step", "meters-in-step",
        "time-in-step", "print-in-step", "nonlocal-rebound-float", "print-freq-branch", "dataloader")


class args:  # imagenet/main.py's argparse defaults, scaled down
    arch = "resnet_small"; workers = 0; epochs = 2; start_epoch = 0; batch_size = 8; lr = 0.1; momentum = 0.9
    weight_decay = 1e-4; print_freq = 3; evaluate = False; no_accel = True; distributed = False; gpu = None


image_size = 32
num_classes = 10
n_train, n_val = 32, 8


# --- the model: a small torchvision-style ResNet (see the docstring) ---

def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, block, layers, widths=(16, 32), num_classes=1000):
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, widths[0], layers[0])
        self.layer2 = self._make_layer(block, widths[1], layers[1], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[1] * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# --- main.py's helpers ---

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

    def summary(self):
        if self.summary_type is Summary.NONE:
            fmtstr = ''
        elif self.summary_type is Summary.AVERAGE:
            fmtstr = '{name} {avg:.3f}'
        elif self.summary_type is Summary.SUM:
            fmtstr = '{name} {sum:.3f}'
        elif self.summary_type is Summary.COUNT:
            fmtstr = '{name} {count:.3f}'
        else:
            raise ValueError('invalid summary type %r' % self.summary_type)
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

    def display_summary(self):
        entries = [" *"]
        entries += [meter.summary() for meter in self.meters]
        print(' '.join(entries))

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
    device = torch.device(device)
    use_accel = device.type != "cpu"
    model = ResNet(BasicBlock, [1, 1], num_classes=num_classes)
    model.to(device)

    # define loss function (criterion), optimizer, and learning rate scheduler
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr,
                                momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.1)   # step_size=30 epochs, scaled to 1
    sg.track(model=model, opt=optimizer, sched=scheduler)

    g = torch.Generator().manual_seed(1)
    train_dataset = TensorDataset(torch.randn(n_train, 3, image_size, image_size, generator=g),
                                  torch.randint(0, num_classes, (n_train,), generator=g))
    val_dataset = TensorDataset(torch.randn(n_val, 3, image_size, image_size, generator=g),
                                torch.randint(0, num_classes, (n_val,), generator=g))
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers)

    # train()'s locals, moved to this scope so that the step below is defined once
    batch_time = data_time = losses = top1 = top5 = progress = None
    end = 0.0

    @sg.compile
    def train_batch(i, images, target):
        nonlocal end
        # measure data loading time
        data_time.update(time.time() - end)

        # move data to the same device as model
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)

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

        # measure elapsed time
        batch_time.update(time.time() - end)
        end = time.time()

        if i % args.print_freq == 0:
            progress.display(i + 1)
        return loss

    done = 0

    def train(train_loader, model, criterion, optimizer, epoch, device, args):
        nonlocal batch_time, data_time, losses, top1, top5, progress, end, done
        batch_time = AverageMeter('Time', use_accel, ':6.3f', Summary.NONE)
        data_time = AverageMeter('Data', use_accel, ':6.3f', Summary.NONE)
        losses = AverageMeter('Loss', use_accel, ':.4e', Summary.NONE)
        top1 = AverageMeter('Acc@1', use_accel, ':6.2f', Summary.NONE)
        top5 = AverageMeter('Acc@5', use_accel, ':6.2f', Summary.NONE)
        progress = ProgressMeter(
            len(train_loader),
            [batch_time, data_time, losses, top1, top5],
            prefix="Epoch: [{}]".format(epoch))

        # switch to train mode
        model.train()

        end = time.time()
        for i, (images, target) in enumerate(train_loader):
            if done == steps:
                break
            loss = train_batch(i, images, target)
            done += 1
            # (what the harness compares: the loss and the meters the body updated)
            sg.log((loss, losses.val, losses.sum, losses.count, losses.avg, top1.val, top1.sum, top1.avg,
                    top5.avg, batch_time.count, data_time.count))

    def validate(val_loader, model, criterion, args):
        def run_validate(loader, base_progress=0):
            with torch.no_grad():
                end = time.time()
                for i, (images, target) in enumerate(loader):
                    i = base_progress + i
                    images = images.to(device)
                    target = target.to(device)

                    # compute output
                    output = model(images)
                    loss = criterion(output, target)

                    # measure accuracy and record loss
                    acc1, acc5 = accuracy(output, target, topk=(1, 5))
                    losses.update(loss.item(), images.size(0))
                    top1.update(acc1[0], images.size(0))
                    top5.update(acc5[0], images.size(0))

                    # measure elapsed time
                    batch_time.update(time.time() - end)
                    end = time.time()

                    if i % args.print_freq == 0:
                        progress.display(i + 1)

        batch_time = AverageMeter('Time', use_accel, ':6.3f', Summary.NONE)
        losses = AverageMeter('Loss', use_accel, ':.4e', Summary.NONE)
        top1 = AverageMeter('Acc@1', use_accel, ':6.2f', Summary.AVERAGE)
        top5 = AverageMeter('Acc@5', use_accel, ':6.2f', Summary.AVERAGE)
        progress = ProgressMeter(
            len(val_loader),
            [batch_time, losses, top1, top5],
            prefix='Test: ')

        # switch to evaluate mode
        model.eval()
        run_validate(val_loader)
        progress.display_summary()
        return top1.avg

    best_acc1 = 0
    for epoch in range(args.start_epoch, args.epochs):
        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch, device, args)

        # evaluate on validation set
        acc1 = validate(val_loader, model, criterion, args)

        scheduler.step()

        # remember best acc@1 (save_checkpoint left out: no files)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        sg.log((acc1, is_best))
