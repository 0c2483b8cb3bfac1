"""pytorch/vision ``references/classification/train.py`` ``train_one_epoch`` with the options of the
recent recipes turned on: ``--label-smoothing 0.1`` (``nn.CrossEntropyLoss(label_smoothing=...)``),
``--norm-weight-decay 0.0`` (``utils.set_weight_decay``: norm-layer parameters in a param group of
their own with weight decay 0), ``--opt sgd`` (``torch.optim.SGD(parameters, lr, momentum,
weight_decay, nesterov=False)``), ``--clip-grad-norm 1.0`` (``nn.utils.clip_grad_norm_`` after
``loss.backward()``), ``--model-ema`` (``utils.ExponentialMovingAverage``, an
``torch.optim.swa_utils.AveragedModel`` subclass with ``use_buffers=True`` and an ``ema_avg``
closure; ``model_ema.update_parameters(model)`` every ``--model-ema-steps`` iterations and, during
the lr warm-up epochs, ``model_ema.n_averaged.fill_(0)`` so the EMA keeps copying the weights),
``--lr-scheduler cosineannealinglr --lr-warmup-epochs 1 --lr-warmup-method linear``
(``SequentialLR(LinearLR, CosineAnnealingLR)`` stepped per epoch), and the MetricLogger meters of
the body: ``metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])``,
``metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)`` (and acc5, img/s). ``--amp``
(the harness's ``"bf16"``): ``scaler = torch.cuda.amp.GradScaler()``, which disables itself on a
machine without CUDA (so the body takes its ``scaler.scale(loss).backward()`` / ``unscale_`` /
``scaler.step`` / ``scaler.update()`` path with a disabled scaler), and the body's
``torch.cuda.amp.autocast(enabled=scaler is not None)`` (CUDA autocast: no effect on CPU tensors),
as the script runs on a CPU-only machine.

What a user of stepgraph changes: the per-batch body of ``train_one_epoch``'s ``for i, (image,
target) in enumerate(metric_logger.log_every(...))`` loop is the function ``train_batch(i, image,
target)`` decorated with ``sg.compile`` (= ``@stepgraph.compile``). ``train_one_epoch``'s other
names (``model``, ``criterion``, ``optimizer``, ``device``, ``epoch``, ``args``, ``model_ema``,
``scaler``, ``metric_logger``) are read from the enclosing scope, where ``train_one_epoch`` sets
``metric_logger`` and ``epoch`` each epoch (``nonlocal``), so one step function serves every epoch.
``log_every`` (the generator that times the loop and prints every ``print_freq``) stays the loop.

Source: https://github.com/pytorch/vision/blob/main/references/classification/train.py and
utils.py (``SmoothedValue``, ``MetricLogger``, ``ExponentialMovingAverage``, ``accuracy``,
``set_weight_decay``); no commit could be pinned from here (the snapshot of pytorch/vision was too
large to fetch). BSD-3-Clause. Restated after the source, not copied: same names, ops and order.
Deviations: torchvision is not installable here: the model is a small ResNet written in this file
after torchvision's ``resnet.py`` (BasicBlock, BatchNorm, kaiming fan_out init, two stages of one
block, widths 16 and 32); data are synthetic tensors in a ``TensorDataset`` read by a
``DataLoader`` with a ``RandomSampler``; no distributed, no checkpoint files, no evaluation of the EMA
model (``evaluate`` is kept for the plain model); argparse replaced by an ``args`` class. Scaled
down: 224x224 images -> 32x32, 1000 classes -> 10, batch 32 -> 8, 4 batches an epoch, epochs 600 ->
2, lr-warmup-epochs 5 -> 1, model-ema-steps 32 -> 2, print_freq 10 -> 2.
"""
import datetime
import time
from collections import defaultdict, deque
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, TensorDataset

SOURCE = "https://github.com/pytorch/vision/blob/main/references/classification/train.py"
LICENSE = "BSD-3-Clause"
TAGS = ("cnn", "resnet", "batchnorm", "sgd-momentum", "param-groups", "label-smoothing", "clip-grad-norm",
        "model-ema", "averaged-model", "tensor-branch-in-step", "sequential-lr", "item-in-step", "meters-in-step",
        "time-in-step", "inference-mode-in-step", "grad-scaler", "dataloader")


class args:  # train.py's argparse values for the recipe above, scaled down
    lr = 0.5; momentum = 0.9; weight_decay = 2e-5; norm_weight_decay = 0.0; bias_weight_decay = None
    transformer_embedding_decay = None; label_smoothing = 0.1; opt = "sgd"; clip_grad_norm = 1.0
    model_ema = True; model_ema_steps = 2; model_ema_decay = 0.99998; lr_scheduler = "cosineannealinglr"
    lr_warmup_epochs = 1; lr_warmup_method = "linear"; lr_warmup_decay = 0.01; lr_min = 0.0
    epochs = 2; start_epoch = 0; batch_size = 8; print_freq = 2; world_size = 1; amp = False; workers = 0


image_size = 32
num_classes = 10
batches_per_epoch = 4


# --- the model: a small torchvision-style ResNet ---

def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


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

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32), num_classes=1000):
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(widths[0])
        self.layer2 = self._make_layer(widths[1], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[1], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, kernel_size=1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layer = nn.Sequential(BasicBlock(self.inplanes, planes, stride, downsample))
        self.inplanes = planes
        return layer

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# --- references/classification/utils.py ---

class SmoothedValue:
    """Track a series of values and provide access to smoothed values over a
    window or the global series average.
    """

    def __init__(self, window_size=20, fmt=None):
        if fmt is None:
            fmt = "{median:.4f} ({global_avg:.4f})"
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = fmt

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    @property
    def median(self):
        d = torch.tensor(list(self.deque))
        return d.median().item()

    @property
    def avg(self):
        d = torch.tensor(list(self.deque), dtype=torch.float32)
        return d.mean().item()

    @property
    def global_avg(self):
        return self.total / self.count

    @property
    def max(self):
        return max(self.deque)

    @property
    def value(self):
        return self.deque[-1]

    def __str__(self):
        return self.fmt.format(
            median=self.median, avg=self.avg, global_avg=self.global_avg, max=self.max, value=self.value
        )


class MetricLogger:
    def __init__(self, delimiter="\t"):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            assert isinstance(v, (float, int))
            self.meters[k].update(v)

    def __getattr__(self, attr):
        if attr in self.meters:
            return self.meters[attr]
        if attr in self.__dict__:
            return self.__dict__[attr]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{attr}'")

    def __str__(self):
        loss_str = []
        for name, meter in self.meters.items():
            loss_str.append(f"{name}: {str(meter)}")
        return self.delimiter.join(loss_str)

    def add_meter(self, name, meter):
        self.meters[name] = meter

    def log_every(self, iterable, print_freq, header=None):
        i = 0
        if not header:
            header = ""
        start_time = time.time()
        end = time.time()
        iter_time = SmoothedValue(fmt="{avg:.4f}")
        data_time = SmoothedValue(fmt="{avg:.4f}")
        space_fmt = ":" + str(len(str(len(iterable)))) + "d"
        log_msg = self.delimiter.join(
            [header, "[{0" + space_fmt + "}/{1}]", "eta: {eta}", "{meters}", "time: {time}", "data: {data}"]
        )
        for obj in iterable:
            data_time.update(time.time() - end)
            yield obj
            iter_time.update(time.time() - end)
            if i % print_freq == 0 or i == len(iterable) - 1:
                eta_seconds = iter_time.global_avg * (len(iterable) - i)
                eta_string = str(datetime.timedelta(seconds=int(eta_seconds)))
                print(log_msg.format(i, len(iterable), eta=eta_string, meters=str(self),
                                     time=str(iter_time), data=str(data_time)))
            i += 1
            end = time.time()
        total_time = time.time() - start_time
        total_time_str = str(datetime.timedelta(seconds=int(total_time)))
        print(f"{header} Total time: {total_time_str}")


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """Maintains moving averages of model parameters using an exponential decay.
    ``ema_avg = decay * avg_model_param + (1 - decay) * model_param``
    `torch.optim.swa_utils.AveragedModel <https://pytorch.org/docs/stable/optim.html#custom-averaging-strategies>`_
    is used to compute the EMA.
    """

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.inference_mode():
        maxk = max(topk)
        batch_size = target.size(0)
        if target.ndim == 2:
            target = target.max(dim=1)[1]

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target[None])

        res = []
        for k in topk:
            correct_k = correct[:k].flatten().sum(dtype=torch.float32)
            res.append(correct_k * (100.0 / batch_size))
        return res


def set_weight_decay(
    model: torch.nn.Module,
    weight_decay: float,
    norm_weight_decay: Optional[float] = None,
    norm_classes: Optional[List[type]] = None,
    custom_keys_weight_decay: Optional[List[Tuple[str, float]]] = None,
):
    if not norm_classes:
        norm_classes = [
            torch.nn.modules.batchnorm._BatchNorm,
            torch.nn.LayerNorm,
            torch.nn.GroupNorm,
            torch.nn.modules.instancenorm._InstanceNorm,
            torch.nn.LocalResponseNorm,
        ]
    norm_classes = tuple(norm_classes)

    params = {"other": [], "norm": []}
    params_weight_decay = {"other": weight_decay, "norm": norm_weight_decay}
    custom_keys = []
    if custom_keys_weight_decay is not None:
        for key, weight_decay in custom_keys_weight_decay:
            params[key] = []
            params_weight_decay[key] = weight_decay
            custom_keys.append(key)

    def _add_params(module, prefix=""):
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_custom_key = False
            for key in custom_keys:
                target_name = f"{prefix}.{name}" if prefix != "" and "." in key else name
                if key == target_name:
                    params[key].append(p)
                    is_custom_key = True
                    break
            if not is_custom_key:
                if norm_weight_decay is not None and isinstance(module, norm_classes):
                    params["norm"].append(p)
                else:
                    params["other"].append(p)

        for child_name, child_module in module.named_children():
            child_prefix = f"{prefix}.{child_name}" if prefix != "" else child_name
            _add_params(child_module, prefix=child_prefix)

    _add_params(model)

    param_groups = []
    for key in params:
        if len(params[key]) > 0:
            param_groups.append({"params": params[key], "weight_decay": params_weight_decay[key]})
    return param_groups


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    if amp is not None:
        args.amp = True            # the script's --amp
    model = ResNet(num_classes=num_classes)
    model.to(device)

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    custom_keys_weight_decay = []
    if args.bias_weight_decay is not None:
        custom_keys_weight_decay.append(("bias", args.bias_weight_decay))
    if args.transformer_embedding_decay is not None:
        for key in ["class_token", "position_embedding", "relative_position_bias_table"]:
            custom_keys_weight_decay.append((key, args.transformer_embedding_decay))
    parameters = set_weight_decay(
        model,
        args.weight_decay,
        norm_weight_decay=args.norm_weight_decay,
        custom_keys_weight_decay=custom_keys_weight_decay if len(custom_keys_weight_decay) > 0 else None,
    )

    opt_name = args.opt.lower()
    if opt_name.startswith("sgd"):
        optimizer = torch.optim.SGD(
            parameters,
            lr=args.lr,
            momentum=args.momentum,
            weight_decay=args.weight_decay,
            nesterov="nesterov" in opt_name,
        )
    elif opt_name == "rmsprop":
        optimizer = torch.optim.RMSprop(
            parameters, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay, eps=0.0316, alpha=0.9
        )
    elif opt_name == "adamw":
        optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=args.weight_decay)
    else:
        raise RuntimeError(f"Invalid optimizer {args.opt}. Only SGD, RMSprop and AdamW are supported.")

    scaler = torch.cuda.amp.GradScaler() if args.amp else None

    args.lr_scheduler = args.lr_scheduler.lower()
    if args.lr_scheduler == "cosineannealinglr":
        main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=args.epochs - args.lr_warmup_epochs, eta_min=args.lr_min
        )
    else:
        raise RuntimeError(f"Invalid lr scheduler '{args.lr_scheduler}' (only cosineannealinglr is restated).")

    if args.lr_warmup_epochs > 0:
        if args.lr_warmup_method == "linear":
            warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(
                optimizer, start_factor=args.lr_warmup_decay, total_iters=args.lr_warmup_epochs
            )
        elif args.lr_warmup_method == "constant":
            warmup_lr_scheduler = torch.optim.lr_scheduler.ConstantLR(
                optimizer, factor=args.lr_warmup_decay, total_iters=args.lr_warmup_epochs
            )
        else:
            raise RuntimeError(f"Invalid warmup lr method '{args.lr_warmup_method}'.")
        lr_scheduler = torch.optim.lr_scheduler.SequentialLR(
            optimizer, schedulers=[warmup_lr_scheduler, main_lr_scheduler], milestones=[args.lr_warmup_epochs]
        )
    else:
        lr_scheduler = main_lr_scheduler

    model_without_ddp = model
    model_ema = None
    if args.model_ema:
        # Decay adjustment that aims to keep the decay independent of other hyper-parameters
        # (pycls): adjust = n_GPUs * batch_size_per_gpu * EMA_steps / epochs
        adjust = args.world_size * args.batch_size * args.model_ema_steps / args.epochs
        alpha = 1.0 - args.model_ema_decay
        alpha = min(1.0, alpha * adjust)
        model_ema = ExponentialMovingAverage(model_without_ddp, device=device, decay=1.0 - alpha)

    sg.track(model=model, opt=optimizer, sched=lr_scheduler, ema=model_ema)
    if scaler is not None:
        sg.track(scaler=scaler)

    g = torch.Generator().manual_seed(1)
    n = batches_per_epoch * args.batch_size
    dataset = TensorDataset(torch.randn(n, 3, image_size, image_size, generator=g),
                            torch.randint(0, num_classes, (n,), generator=g))
    dataset_test = TensorDataset(torch.randn(args.batch_size, 3, image_size, image_size, generator=g),
                                 torch.randint(0, num_classes, (args.batch_size,), generator=g))
    data_loader = DataLoader(dataset, batch_size=args.batch_size, sampler=RandomSampler(dataset),
                             num_workers=args.workers)
    data_loader_test = DataLoader(dataset_test, batch_size=args.batch_size,
                                  sampler=SequentialSampler(dataset_test), num_workers=args.workers)

    # train_one_epoch's per-epoch names, set by it below (so the step is defined once)
    metric_logger = None
    epoch = 0

    @sg.compile
    def train_batch(i, image, target):
        start_time = time.time()
        image, target = image.to(device), target.to(device)
        with torch.cuda.amp.autocast(enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            if args.clip_grad_norm is not None:
                # we should unscale the gradients of optimizer's assigned params if do gradient clipping
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if args.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()

        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                # Reset ema buffer to keep copying weights during warmup period
                model_ema.n_averaged.fill_(0)

        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        batch_size = image.shape[0]
        metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
        metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
        metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)
        metric_logger.meters["img/s"].update(batch_size / (time.time() - start_time))
        return loss

    done = 0

    def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch_, args, model_ema=None, scaler=None):
        nonlocal metric_logger, epoch, done
        epoch = epoch_
        model.train()
        metric_logger = MetricLogger(delimiter="  ")
        metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value}"))
        metric_logger.add_meter("img/s", SmoothedValue(window_size=10, fmt="{value}"))

        header = f"Epoch: [{epoch}]"
        for i, (image, target) in enumerate(metric_logger.log_every(data_loader, args.print_freq, header)):
            if done == steps:
                break
            loss = train_batch(i, image, target)
            done += 1
            # (what the harness compares: the loss and the meters the body updated)
            m = metric_logger.meters
            sg.log((loss, m["loss"].total, m["loss"].count, list(m["loss"].deque), m["lr"].value,
                    m["acc1"].total, m["acc1"].count, m["acc5"].total, m["img/s"].count, model_ema.n_averaged))

    def evaluate(model, criterion, data_loader, device, print_freq=100, log_suffix=""):
        model.eval()
        metric_logger = MetricLogger(delimiter="  ")
        header = f"Test: {log_suffix}"
        num_processed_samples = 0
        with torch.inference_mode():
            for image, target in metric_logger.log_every(data_loader, print_freq, header):
                image = image.to(device, non_blocking=True)
                target = target.to(device, non_blocking=True)
                output = model(image)
                loss = criterion(output, target)

                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                batch_size = image.shape[0]
                metric_logger.update(loss=loss.item())
                metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
                metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)
                num_processed_samples += batch_size
        print(f"{header} Acc@1 {metric_logger.acc1.global_avg:.3f} Acc@5 {metric_logger.acc5.global_avg:.3f}")
        return metric_logger.acc1.global_avg

    for ep in range(args.start_epoch, args.epochs):
        if done == steps:
            break
        train_one_epoch(model, criterion, optimizer, data_loader, device, ep, args, model_ema, scaler)
        lr_scheduler.step()
        acc1 = evaluate(model, criterion, data_loader_test, device=device)
        sg.log((acc1, optimizer.param_groups[0]["lr"]))
