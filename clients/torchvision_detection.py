"""torchvision references/detection: ``fasterrcnn_mobilenet_v3_large_320_fpn`` trained with
engine.py's ``train_one_epoch``: per batch ``loss_dict = model(images, targets)``, ``losses =
sum(loss for loss in loss_dict.values())``, ``utils.reduce_dict`` (the identity on one process)
and ``losses_reduced.item()`` checked with ``math.isfinite`` (print and ``sys.exit(1)`` when not),
``optimizer.zero_grad(); losses.backward(); optimizer.step()``, the first epoch's warm-up
``torch.optim.lr_scheduler.LinearLR(start_factor=1/1000, total_iters=min(1000,
len(data_loader) - 1))`` stepped after every batch, and ``metric_logger.update(loss=...,
**loss_dict_reduced)`` / ``update(lr=optimizer.param_groups[0]["lr"])`` (SmoothedValue meters:
``.item()`` of each tensor, a deque and a running total). train.py: SGD over the parameters that
require grad (lr 0.02, momentum 0.9, weight decay 1e-4), MultiStepLR stepped per epoch.

The detection model's training forward is data-dependent by construction: the transform
resizes each image by its own size, the RPN keeps the top-k anchors per level and runs
``batched_nms`` (the number of proposals kept depends on the scores), the RoI heads match
proposals to ground truth and sample positives / negatives with ``torch.randperm`` over
``torch.where`` of the matches (shapes from values), and the box loss indexes the sampled
positives. So stepgraph is expected to refuse the step; what this client checks is that the
refusal names the line and a fix, and leaves the state equal to eager's.

Model: the installed torchvision's builder (not vendored) with ``weights=None,
weights_backbone=None, num_classes=3`` (so every backbone layer trains and uses BatchNorm2d,
not FrozenBatchNorm2d), its defaults otherwise (min_size 320, max_size 640, ...). Restated after
the source, not copied: ``train_one_epoch`` (engine.py), ``SmoothedValue``, ``MetricLogger``
(printing kept minimal), ``reduce_dict``, ``collate_fn`` (utils.py) and main's optimizer /
scheduler / epoch loop (train.py), all at 15fc26c. ``evaluate`` needs pycocotools: replaced by
an eval-mode forward of one test batch whose detections are logged. The ``.to(device)`` of the
batch runs in the loop, before the step. Scaled down: synthetic 3x128x128 images in [0, 1],
each with 1-3 random boxes (labels 1..2, plus the COCO dataset's image_id / area / iscrowd
fields), batch 2, 4 batches an "epoch", MultiStepLR milestones [16, 22] of 26 epochs -> [1],
print_freq 2.
"""
import datetime
import math
import sys
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist

try:   # (the harness SKIPs this client where torchvision is missing or its C++ ops do not load)
    import torchvision
    import torchvision.models.detection
except RuntimeError as e:   # a torchvision built for another torch (e.g. a CUDA wheel on CPU torch)
    raise ImportError(f"torchvision does not load: {e}", name="torchvision") from e

SOURCE = ("https://github.com/pytorch/vision/blob/15fc26c7008e792893b7dba1581e4cf080933f73/"
          "references/detection/engine.py")
LICENSE = "BSD-3-Clause"
TAGS = ("cnn", "detection", "faster-rcnn", "mobilenet-v3", "fpn", "nms", "data-dependent-shapes", "batchnorm",
        "sgd-momentum", "linearlr-warmup", "multisteplr", "per-step-lr", "item-in-step", "isfinite-check",
        "list-of-dicts-batch", "dict-output", "torchvision")


class args:  # train.py's argparse defaults, scaled down
    lr = 0.02; momentum = 0.9; weight_decay = 1e-4; batch_size = 2; epochs = 26; lr_steps = [16, 22]
    lr_gamma = 0.1; print_freq = 2; start_epoch = 0


batches_per_epoch = 4
num_classes = 3
image_size = 128


# ---- references/detection/utils.py (restated) ------------------------------------------------
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


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def reduce_dict(input_dict, average=True):
    """Average (or sum) the dict's tensors over the processes; the dict itself on one process."""
    world_size = get_world_size()
    if world_size < 2:
        return input_dict
    with torch.no_grad():
        names = sorted(input_dict.keys())
        values = torch.stack([input_dict[k] for k in names], dim=0)
        dist.all_reduce(values)
        if average:
            values /= world_size
        return {k: v for k, v in zip(names, values)}


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
            if i % print_freq == 0 or i == len(iterable) - 1:
                eta = datetime.timedelta(seconds=int(iter_time.global_avg * (len(iterable) - i)))
                print(self.delimiter.join([header, f"[{i}/{len(iterable)}]", f"eta: {eta}", str(self),
                                           f"time: {iter_time}", f"data: {data_time}"]))
            end = time.time()
        total = time.time() - start
        print(f"{header} Total time: {datetime.timedelta(seconds=int(total))} ({total / len(iterable):.4f} s / it)")


def collate_fn(batch):
    return tuple(zip(*batch))


# ---- synthetic COCO-like data ------------------------------------------------------------------
def synthetic_dataset(n, g, first_id=0):
    out = []
    for i in range(n):
        image = torch.rand(3, image_size, image_size, generator=g)
        k = int(torch.randint(1, 4, (1,), generator=g))
        xy = torch.rand(k, 2, generator=g) * (image_size - 40)
        wh = 8 + torch.rand(k, 2, generator=g) * 32
        boxes = torch.cat([xy, xy + wh], dim=1)
        target = {
            "boxes": boxes,
            "labels": torch.randint(1, num_classes, (k,), generator=g),
            "image_id": torch.tensor([first_id + i]),
            "area": (boxes[:, 3] - boxes[:, 1]) * (boxes[:, 2] - boxes[:, 0]),
            "iscrowd": torch.zeros(k, dtype=torch.int64),
        }
        out.append((image, target))
    return out


def batches(dataset, g):
    order = torch.randperm(len(dataset), generator=g).tolist()   # RandomSampler + BatchSampler
    return [collate_fn([dataset[j] for j in order[i:i + args.batch_size]])
            for i in range(0, len(order) - args.batch_size + 1, args.batch_size)]


# ---- train.py / engine.py (restated) -----------------------------------------------------------
def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=num_classes)
    model.to(device)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1], gamma=args.lr_gamma)

    g = torch.Generator().manual_seed(1)
    dataset = synthetic_dataset(batches_per_epoch * args.batch_size, g)
    dataset_test = synthetic_dataset(args.batch_size, g, first_id=100)
    n_epochs = -(-steps // batches_per_epoch)
    sg.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    warmup_scheduler = None
    metric_logger = None

    @sg.compile
    def train_step(images, targets):
        loss_dict = model(images, targets)

        losses = sum(loss for loss in loss_dict.values())

        # reduce losses over all GPUs for logging purposes
        loss_dict_reduced = reduce_dict(loss_dict)
        losses_reduced = sum(loss for loss in loss_dict_reduced.values())

        loss_value = losses_reduced.item()

        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            print(loss_dict_reduced)
            sys.exit(1)

        optimizer.zero_grad()
        losses.backward()
        optimizer.step()

        if warmup_scheduler is not None:
            warmup_scheduler.step()

        metric_logger.update(loss=losses_reduced, **loss_dict_reduced)
        metric_logger.update(lr=optimizer.param_groups[0]["lr"])
        return losses

    def train_one_epoch(epoch, data_loader, print_freq, n_batches):
        nonlocal warmup_scheduler, metric_logger
        model.train()
        metric_logger = MetricLogger(delimiter="  ")
        metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value:.6f}"))
        header = f"Epoch: [{epoch}]"

        warmup_scheduler = None
        if epoch == 0:
            warmup_factor = 1.0 / 1000
            warmup_iters = min(1000, len(data_loader) - 1)
            warmup_scheduler = torch.optim.lr_scheduler.LinearLR(
                optimizer, start_factor=warmup_factor, total_iters=warmup_iters)

        for images, targets in metric_logger.log_every(data_loader[:n_batches], print_freq, header):
            images = list(image.to(device) for image in images)
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            losses = train_step(images, targets)
            sg.log({"losses": losses, "meters": {k: list(m.deque) for k, m in metric_logger.meters.items()}})
        return metric_logger

    for epoch in range(args.start_epoch, n_epochs):
        data_loader = batches(dataset, g)
        train_one_epoch(epoch, data_loader, args.print_freq, min(batches_per_epoch, steps - epoch * batches_per_epoch))
        lr_scheduler.step()

        # evaluate after every epoch (the COCO evaluator replaced by the detections themselves)
        model.eval()
        with torch.no_grad():
            images, _ = collate_fn(dataset_test)
            outputs = model([img.to(device) for img in images])
        sg.log({"detections": [{k: v.cpu() for k, v in o.items()} for o in outputs]})
