"""torchvision references/segmentation/train.py: ``fcn_resnet50(aux_loss=True)`` trained with SGD
(momentum 0.9, weight decay 1e-4) over three parameter groups (backbone, classifier, and the aux
classifier at 10x the lr), the poly schedule ``LambdaLR(lambda x: (1 - x / iters) ** 0.9)`` stepped
after every batch, the ``criterion`` that sums ``cross_entropy(x, target, ignore_index=255)`` over
the model's output dict (``out`` + 0.5 * ``aux``), and ``metric_logger.update(loss=loss.item(),
lr=optimizer.param_groups[0]["lr"])`` in the per-batch body (``SmoothedValue`` meters: a deque of
the last ``window_size`` values plus a running total/count). ``evaluate`` (a ConfusionMatrix over
``output["out"].argmax(1)``) runs between epochs.

The step is ``train_one_epoch``'s loop body as the script writes it (later versions: autocast and
``GradScaler`` when ``--amp``; ``torchvision_segmentation_amp`` runs that branch): forward under
``autocast(enabled=scaler is not None)``, ``criterion``, ``zero_grad``, backward, ``step``,
``lr_scheduler.step()``, ``metric_logger.update(...)``. The loop is ``metric_logger.log_every``.

Restated after the source, not copied: the lookup service this was written with does not allow
committing its text. Restated here: ``criterion``, ``train_one_epoch``, ``evaluate`` and main's
optimizer / scheduler set-up (train.py); ``SmoothedValue``, ``MetricLogger``, ``ConfusionMatrix``
(references/segmentation/utils.py, printing and distributed parts kept minimal);
``IntermediateLayerGetter`` (torchvision/models/_utils.py), ``_SimpleSegmentationModel``, ``FCN``,
``FCNHead`` and the fcn_resnet50 builder (torchvision/models/segmentation/). The backbone is the
vendored torchvision ResNet (vendor/pytorch_vision/resnet.py) with Bottleneck blocks and
``replace_stride_with_dilation=[False, True, True]`` as fcn_resnet50 builds it. Scaled down:
one Bottleneck per stage (3, 4, 6, 3), width_per_group 16 (64), 5 classes (21), 32x32 crops with
255-labelled borders (collate_fn's padding), batch 2, 4 batches an "epoch", print_freq 2.
"""
import datetime
import time
from collections import OrderedDict, defaultdict, deque

import torch
import torch.nn.functional as F
from torch import nn

from clients.vendor.pytorch_vision.resnet import Bottleneck, ResNet

SOURCE = ("https://github.com/pytorch/vision/blob/e8dd7c6c5c1e21b9acdec623b63d5d5559d9e0d7/"
          "references/segmentation/train.py")
LICENSE = "BSD-3-Clause"
TAGS = ("cnn", "segmentation", "fcn", "dilated-resnet", "aux-loss", "dict-output", "ignore-index", "batchnorm",
        "dropout", "sgd-momentum", "param-groups", "poly-lr", "lambdalr", "per-step-lr", "item-in-step",
        "lr-read-in-step", "deque-meter", "torchvision")


class args:  # the script's argparse defaults, scaled down
    lr = 0.01; momentum = 0.9; weight_decay = 1e-4; batch_size = 2; epochs = 2; print_freq = 2
    aux_loss = True; amp = False


batches_per_epoch = 4
num_classes = 5
crop = 32


# ---- torchvision's segmentation model (restated) ---------------------------------------------
class IntermediateLayerGetter(nn.ModuleDict):
    """Runs the children of ``model`` in order up to the last one named in ``return_layers`` and
    returns their outputs under the new names."""

    def __init__(self, model, return_layers):
        wanted = dict(return_layers)
        layers = OrderedDict()
        for name, module in model.named_children():
            layers[name] = module
            wanted.pop(name, None)
            if not wanted:
                break
        super().__init__(layers)
        self.return_layers = dict(return_layers)

    def forward(self, x):
        out = OrderedDict()
        for name, module in self.items():
            x = module(x)
            if name in self.return_layers:
                out[self.return_layers[name]] = x
        return out


class _SimpleSegmentationModel(nn.Module):
    def __init__(self, backbone, classifier, aux_classifier=None):
        super().__init__()
        self.backbone = backbone
        self.classifier = classifier
        self.aux_classifier = aux_classifier

    def forward(self, x):
        input_shape = x.shape[-2:]
        features = self.backbone(x)
        result = OrderedDict()
        y = self.classifier(features["out"])
        result["out"] = F.interpolate(y, size=input_shape, mode="bilinear", align_corners=False)
        if self.aux_classifier is not None:
            y = self.aux_classifier(features["aux"])
            result["aux"] = F.interpolate(y, size=input_shape, mode="bilinear", align_corners=False)
        return result


class FCN(_SimpleSegmentationModel):
    pass


class FCNHead(nn.Sequential):
    def __init__(self, in_channels, channels):
        inter_channels = in_channels // 4
        super().__init__(
            nn.Conv2d(in_channels, inter_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(inter_channels),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Conv2d(inter_channels, channels, 1),
        )


def fcn_resnet50(num_classes, aux_loss):
    backbone = ResNet(Bottleneck, [1, 1, 1, 1], width_per_group=16,
                      replace_stride_with_dilation=[False, True, True])
    return_layers = {"layer4": "out"}
    if aux_loss:
        return_layers["layer3"] = "aux"
    backbone = IntermediateLayerGetter(backbone, return_layers=return_layers)
    aux_classifier = FCNHead(1024, num_classes) if aux_loss else None
    return FCN(backbone, FCNHead(2048, num_classes), aux_classifier)


# ---- references/segmentation/utils.py (restated) ---------------------------------------------
class SmoothedValue:
    """The last ``window_size`` values (a deque) and the running total / count of all of them."""

    def __init__(self, window_size=20, fmt=None):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = "{median:.4f} ({global_avg:.4f})" if fmt is None else fmt

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    @property
    def median(self):
        return torch.tensor(list(self.deque)).median().item()

    @property
    def avg(self):
        return torch.tensor(list(self.deque), dtype=torch.float32).mean().item()

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
        return self.fmt.format(median=self.median, avg=self.avg, global_avg=self.global_avg,
                               max=self.max, value=self.value)


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
        return self.delimiter.join(f"{name}: {meter}" for name, meter in self.meters.items())

    def add_meter(self, name, meter):
        self.meters[name] = meter

    def log_every(self, iterable, print_freq, header=""):
        start = end = time.time()
        iter_time, data_time = SmoothedValue(fmt="{avg:.4f}"), SmoothedValue(fmt="{avg:.4f}")
        for i, obj in enumerate(iterable):
            data_time.update(time.time() - end)
            yield obj
            iter_time.update(time.time() - end)
            if i % print_freq == 0:
                eta = datetime.timedelta(seconds=int(iter_time.global_avg * (len(iterable) - i)))
                print(self.delimiter.join([header, f"[{i}/{len(iterable)}]", f"eta: {eta}", str(self),
                                           f"time: {iter_time}", f"data: {data_time}"]))
            end = time.time()
        print(f"{header} Total time: {datetime.timedelta(seconds=int(time.time() - start))}")


class ConfusionMatrix:
    def __init__(self, num_classes):
        self.num_classes = num_classes
        self.mat = None

    def update(self, a, b):
        n = self.num_classes
        if self.mat is None:
            self.mat = torch.zeros((n, n), dtype=torch.int64, device=a.device)
        with torch.inference_mode():
            k = (a >= 0) & (a < n)
            inds = n * a[k].to(torch.int64) + b[k]
            self.mat += torch.bincount(inds, minlength=n ** 2).reshape(n, n)

    def compute(self):
        h = self.mat.float()
        acc_global = torch.diag(h).sum() / h.sum()
        acc = torch.diag(h) / h.sum(1)
        iu = torch.diag(h) / (h.sum(1) + h.sum(0) - torch.diag(h))
        return acc_global, acc, iu


# ---- train.py (restated) ---------------------------------------------------------------------
def criterion(inputs, target):
    losses = {}
    for name, x in inputs.items():
        losses[name] = nn.functional.cross_entropy(x, target, ignore_index=255)
    if len(losses) == 1:
        return losses["out"]
    return losses["out"] + 0.5 * losses["aux"]


def evaluate(model, data_loader, device, num_classes):
    model.eval()
    confmat = ConfusionMatrix(num_classes)
    metric_logger = MetricLogger(delimiter="  ")
    with torch.no_grad():
        for image, target in metric_logger.log_every(data_loader, 100, "Test:"):
            image, target = image.to(device), target.to(device)
            output = model(image)["out"]
            confmat.update(target.flatten(), output.argmax(1).flatten())
    return confmat


def synthetic_batches(n, g):
    out = []
    for _ in range(n):
        image = torch.randn(args.batch_size, 3, crop, crop, generator=g)
        target = torch.randint(0, num_classes, (args.batch_size, crop, crop), generator=g)
        # collate_fn pads each batch to its largest image with 255 (ignored by the loss)
        h, w = torch.randint(crop // 2, crop + 1, (2,), generator=g).tolist()
        target[:, h:, :] = 255
        target[:, :, w:] = 255
        out.append((image, target))
    return out


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    model = fcn_resnet50(num_classes=num_classes, aux_loss=args.aux_loss)
    model.to(device)
    model_without_ddp = model

    params_to_optimize = [
        {"params": [p for p in model_without_ddp.backbone.parameters() if p.requires_grad]},
        {"params": [p for p in model_without_ddp.classifier.parameters() if p.requires_grad]},
    ]
    if args.aux_loss:
        params = [p for p in model_without_ddp.aux_classifier.parameters() if p.requires_grad]
        params_to_optimize.append({"params": params, "lr": args.lr * 10})
    optimizer = torch.optim.SGD(params_to_optimize, lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)

    scaler = torch.amp.GradScaler(device.type) if args.amp else None

    g = torch.Generator().manual_seed(1)
    n_epochs = -(-steps // batches_per_epoch)
    data = [synthetic_batches(min(batches_per_epoch, steps - e * batches_per_epoch), g) for e in range(n_epochs)]
    data_loader_test = synthetic_batches(1, g)
    iters_per_epoch = batches_per_epoch
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda x: (1 - x / (iters_per_epoch * n_epochs)) ** 0.9)
    sg.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
             **({"scaler": scaler} if scaler is not None else {}))

    # --amp is fp16 autocast on CUDA; bf16 is the harness's autocast on this device
    autocast_dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    metric_logger = None

    @sg.compile
    def train_step(image, target):
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=scaler is not None or amp == "bf16"):
            output = model(image)
            loss = criterion(output, target)

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()

        lr_scheduler.step()

        metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
        return loss

    def train_one_epoch(epoch, data_loader):
        nonlocal metric_logger
        model.train()
        metric_logger = MetricLogger(delimiter="  ")
        metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value}"))
        header = f"Epoch: [{epoch}]"
        for image, target in metric_logger.log_every(data_loader, args.print_freq, header):
            image, target = image.to(device), target.to(device)
            loss = train_step(image, target)
            sg.log({"loss": loss, "meter_loss": list(metric_logger.loss.deque), "loss_total":
                    metric_logger.loss.total, "loss_count": metric_logger.loss.count,
                    "meter_lr": list(metric_logger.lr.deque)})

    for epoch in range(n_epochs):
        train_one_epoch(epoch, data[epoch])
        confmat = evaluate(model, data_loader_test, device=device, num_classes=num_classes)
        acc_global, acc, iu = confmat.compute()
        sg.log({"confmat": confmat.mat.clone(), "acc_global": acc_global})
