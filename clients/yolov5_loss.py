"""ultralytics/yolov5 train.py with utils/loss.py's ``ComputeLoss``: YOLOv5 detection training.

``ComputeLoss`` (loss.py): ``build_targets`` replicates the targets per anchor, keeps the
anchor matches whose wh ratio is within ``anchor_t`` (a boolean mask ``t[j]``: a data-dependent
number of matches), adds the neighbouring-cell offsets (``((gxy % 1 < g) & (gxy > 1)).T``, the
5-way ``t.repeat((5, 1, 1))[j]``), and returns class, box, (image, anchor, gj, gi) indices and
anchors per layer; the loss gathers the matched predictions ``pi[b, a, gj, gi]`` (``if n :=
b.shape[0]``), the CIoU of ``bbox_iou`` (``metrics.py``, its ``alpha`` under ``torch.no_grad()``),
the objectness target ``tobj[b, a, gj, gi] = iou.detach().clamp(0)`` (``gr`` = 1.0), the class
BCE with ``t[range(n), tcls[i]] = self.cp``, the objectness BCE weighted by ``self.balance =
[4.0, 1.0, 0.4]`` (``autobalance`` off), the hyp gains, ``* bs`` and ``torch.cat((lbox, lobj,
lcls)).detach()``. The model: yolov5's ``Conv`` (Conv2d without bias + BatchNorm2d + SiLU) and
``Detect`` (a 1x1 conv per level, ``view(bs, na, no, ny, nx).permute(0, 1, 3, 4, 2)``, anchors as
a buffer divided by the strides the model measures with a 256x256 forward, ``_initialize_biases``,
``initialize_weights``: BN eps 1e-3 / momentum 0.03, SiLU inplace). train.py: ``smart_optimizer``
(SGD, momentum 0.937, ``nesterov=True``; biases / BN weights / other weights in three groups, weight
decay scaled by ``batch_size * accumulate / nbs``), the linear ``lf`` LambdaLR stepped per epoch,
``ModelEMA``, ``torch.cuda.amp.GradScaler(enabled=amp)`` with ``amp`` False on the CPU
(``check_amp`` returns False off CUDA), and the per-batch body: ``ni = i + nb * epoch``, imgs
``/ 255``, the warmup (``np.interp`` of ``accumulate``, each group's ``lr`` and ``momentum``),
``with smart_amp_autocast(amp):`` forward and ``compute_loss``, ``scaler.scale(loss).backward()``,
``if ni - last_opt_step >= accumulate:`` unscale, ``clip_grad_norm_(max_norm=10.0)``,
``scaler.step``, ``scaler.update``, ``zero_grad``, ``ema.update(model)``, ``last_opt_step = ni``;
then the running mean ``mloss = (mloss * i + loss_items) / (i + 1)``.

What a user of stepgraph changes: the per-batch body (from ``ni = ...`` to the ``mloss`` update) is
a function decorated with ``sg.compile`` taking ``(i, imgs, targets)``, the loop's locals it
updates (``last_opt_step``, ``accumulate``, ``mloss``) declared ``nonlocal``; the progress-bar
description is ``sg.log``. (The warmup block is written as a nested ``warmup(ni)`` that the step
calls, so clients/yolov5_loss_warmup_outside.py can call it from the loop instead.) amp == "bf16" (a variant, not train.py's CPU path) runs the forward
and loss under ``torch.autocast("cpu", bfloat16)``, the scaler still disabled.

Scaled down / replaced: no yaml / dataset: a restated tiny model (Conv 6x6/2, three 3x3/2 Convs
to strides 8/16/32 with 16/32/32/64 channels, Detect with yolov5s's P3-P5 anchors, nc=3), 64x64
synthetic uint8 images, 1-3 boxes per image as the collate_fn lays them out ``(image, class, x, y,
w, h)`` normalised; batch_size 2 (nbs 64, so the warmup's accumulate grows 1 -> 3 over the first
8 batches), 4 batches an epoch, 2 epochs, hyp.scratch-low.yaml's values; no callbacks, plots,
validation or checkpoints.

Source: https://github.com/ultralytics/yolov5/blob/6a048c5fa5bbde3f077f0a0fa0662582cdf29d32/utils/loss.py
(train.py, utils/metrics.py, utils/torch_utils.py, models/yolo.py, models/common.py at the same
commit). AGPL-3.0. Restated after the source, not copied.
"""
import math
from copy import deepcopy

import numpy as np
import torch
from torch import nn

SOURCE = "https://github.com/ultralytics/yolov5/blob/6a048c5fa5bbde3f077f0a0fa0662582cdf29d32/utils/loss.py"
LICENSE = "AGPL-3.0"
DEVICES = ("cpu",)
TAGS = ("detection", "yolo", "cnn", "batchnorm", "data-dependent-shape", "boolean-mask", "anchor-matching",
        "ciou", "no-grad-in-loss", "grad-scaler-disabled", "sgd-nesterov", "param-groups", "grad-accum",
        "conditional-step", "numpy-interp-lr", "warmup-momentum", "clip-grad-norm", "ema", "python-counter",
        "variable-target-count")

WARMUP_IN_STEP = True   # clients/yolov5_loss_warmup_outside.py: False

HYP = {"lr0": 0.01, "lrf": 0.01, "momentum": 0.937, "weight_decay": 0.0005, "warmup_epochs": 3.0,
       "warmup_momentum": 0.8, "warmup_bias_lr": 0.1, "box": 0.05, "cls": 0.5, "cls_pw": 1.0, "obj": 1.0,
       "obj_pw": 1.0, "iou_t": 0.20, "anchor_t": 4.0, "fl_gamma": 0.0}
ANCHORS = [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]]
NC, IMGSZ, BATCH, NB, EPOCHS = 3, 64, 2, 4, 2


# ---- models/common.py -------------------------------------------------------------------------
def autopad(k, p=None, d=1):
    if d > 1:
        k = d * (k - 1) + 1 if isinstance(k, int) else [d * (x - 1) + 1 for x in k]
    if p is None:
        p = k // 2 if isinstance(k, int) else [x // 2 for x in k]
    return p


class Conv(nn.Module):
    default_act = nn.SiLU()

    def __init__(self, c1, c2, k=1, s=1, p=None, g=1, d=1, act=True):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, autopad(k, p, d), groups=g, dilation=d, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = self.default_act if act is True else act if isinstance(act, nn.Module) else nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


# ---- models/yolo.py ---------------------------------------------------------------------------
class Detect(nn.Module):
    stride = None

    def __init__(self, nc=80, anchors=(), ch=(), inplace=True):
        super().__init__()
        self.nc = nc
        self.no = nc + 5
        self.nl = len(anchors)
        self.na = len(anchors[0]) // 2
        self.grid = [torch.empty(0) for _ in range(self.nl)]
        self.anchor_grid = [torch.empty(0) for _ in range(self.nl)]
        self.register_buffer("anchors", torch.tensor(anchors).float().view(self.nl, -1, 2))
        self.m = nn.ModuleList(nn.Conv2d(x, self.no * self.na, 1) for x in ch)
        self.inplace = inplace

    def forward(self, x):
        for i in range(self.nl):
            x[i] = self.m[i](x[i])
            bs, _, ny, nx = x[i].shape
            x[i] = x[i].view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
        return x   # (training mode: the inference branch is not restated)


class TinyDetectionModel(nn.Module):
    """Stands in for ``DetectionModel(cfg)``: a backbone whose P3/P4/P5 outputs feed ``Detect``;
    the build (strides from a 256x256 forward, anchors / stride, biases, weights) as
    DetectionModel.__init__ does it."""

    def __init__(self, ch=3, nc=NC, anchors=ANCHORS):
        super().__init__()
        self.model = nn.ModuleList([
            Conv(ch, 16, 6, 2, 2),   # 0-P1/2
            Conv(16, 32, 3, 2),      # 1-P2/4
            Conv(32, 32, 3, 2),      # 2-P3/8
            Conv(32, 32, 3, 2),      # 3-P4/16
            Conv(32, 64, 3, 2),      # 4-P5/32
            Detect(nc, anchors, (32, 32, 64)),
        ])
        m = self.model[-1]
        s = 256
        m.inplace = True
        m.stride = torch.tensor([s / x.shape[-2] for x in self.forward(torch.zeros(1, ch, s, s))])
        m.anchors /= m.stride.view(-1, 1, 1)
        self.stride = m.stride
        self._initialize_biases()
        initialize_weights(self)

    def forward(self, x):
        y = []
        for m in self.model[:-1]:
            x = m(x)
            y.append(x)
        return self.model[-1]([y[2], y[3], y[4]])

    def _initialize_biases(self, cf=None):
        m = self.model[-1]
        for mi, s in zip(m.m, m.stride):
            b = mi.bias.view(m.na, -1)
            b.data[:, 4] += math.log(8 / (640 / s) ** 2)
            b.data[:, 5: 5 + m.nc] += math.log(0.6 / (m.nc - 0.99999)) if cf is None else torch.log(cf / cf.sum())
            mi.bias = torch.nn.Parameter(b.view(-1), requires_grad=True)


# ---- utils/torch_utils.py ---------------------------------------------------------------------
def initialize_weights(model):
    for m in model.modules():
        t = type(m)
        if t is nn.Conv2d:
            pass
        elif t is nn.BatchNorm2d:
            m.eps = 1e-3
            m.momentum = 0.03
        elif t in [nn.Hardswish, nn.LeakyReLU, nn.ReLU, nn.ReLU6, nn.SiLU]:
            m.inplace = True


def de_parallel(model):
    return model.module if isinstance(model, (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)) \
        else model


def smart_optimizer(model, name="Adam", lr=0.001, momentum=0.9, decay=1e-5):
    g = [], [], []
    bn = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for v in model.modules():
        for p_name, p in v.named_parameters(recurse=0):
            if p_name == "bias":
                g[2].append(p)
            elif p_name == "weight" and isinstance(v, bn):
                g[1].append(p)
            else:
                g[0].append(p)
    if name == "SGD":
        optimizer = torch.optim.SGD(g[2], lr=lr, momentum=momentum, nesterov=True)
    elif name == "Adam":
        optimizer = torch.optim.Adam(g[2], lr=lr, betas=(momentum, 0.999))
    elif name == "AdamW":
        optimizer = torch.optim.AdamW(g[2], lr=lr, betas=(momentum, 0.999), weight_decay=0.0)
    else:
        raise NotImplementedError(f"Optimizer {name} not implemented.")
    optimizer.add_param_group({"params": g[0], "weight_decay": decay})
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})
    return optimizer


def smart_amp_autocast(enabled=True):
    return torch.amp.autocast("cuda", enabled=enabled)


class ModelEMA:
    def __init__(self, model, decay=0.9999, tau=2000, updates=0):
        self.ema = deepcopy(de_parallel(model)).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = de_parallel(model).state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


# ---- utils/metrics.py -------------------------------------------------------------------------
def smooth_bce(eps=0.1):
    return 1.0 - 0.5 * eps, 0.5 * eps


def bbox_iou(box1, box2, xywh=True, GIoU=False, DIoU=False, CIoU=False, eps=1e-7):
    if xywh:
        (x1, y1, w1, h1), (x2, y2, w2, h2) = box1.chunk(4, -1), box2.chunk(4, -1)
        w1_, h1_, w2_, h2_ = w1 / 2, h1 / 2, w2 / 2, h2 / 2
        b1_x1, b1_x2, b1_y1, b1_y2 = x1 - w1_, x1 + w1_, y1 - h1_, y1 + h1_
        b2_x1, b2_x2, b2_y1, b2_y2 = x2 - w2_, x2 + w2_, y2 - h2_, y2 + h2_
    else:
        b1_x1, b1_y1, b1_x2, b1_y2 = box1.chunk(4, -1)
        b2_x1, b2_y1, b2_x2, b2_y2 = box2.chunk(4, -1)
        w1, h1 = b1_x2 - b1_x1, (b1_y2 - b1_y1).clamp(eps)
        w2, h2 = b2_x2 - b2_x1, (b2_y2 - b2_y1).clamp(eps)
    inter = (b1_x2.minimum(b2_x2) - b1_x1.maximum(b2_x1)).clamp(0) * \
        (b1_y2.minimum(b2_y2) - b1_y1.maximum(b2_y1)).clamp(0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    if CIoU or DIoU or GIoU:
        cw = b1_x2.maximum(b2_x2) - b1_x1.minimum(b2_x1)
        ch = b1_y2.maximum(b2_y2) - b1_y1.minimum(b2_y1)
        if CIoU or DIoU:
            c2 = cw ** 2 + ch ** 2 + eps
            rho2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2) ** 2 + (b2_y1 + b2_y2 - b1_y1 - b1_y2) ** 2) / 4
            if CIoU:
                v = (4 / math.pi ** 2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)).pow(2)
                with torch.no_grad():
                    alpha = v / (v - iou + (1 + eps))
                return iou - (rho2 / c2 + v * alpha)
            return iou - rho2 / c2
        c_area = cw * ch + eps
        return iou - (c_area - union) / c_area
    return iou


# ---- utils/loss.py ----------------------------------------------------------------------------
class ComputeLoss:
    sort_obj_iou = False

    def __init__(self, model, autobalance=False):
        device = next(model.parameters()).device
        h = model.hyp
        BCEcls = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([h["cls_pw"]], device=device))
        BCEobj = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([h["obj_pw"]], device=device))
        self.cp, self.cn = smooth_bce(eps=h.get("label_smoothing", 0.0))
        g = h["fl_gamma"]
        if g > 0:
            raise NotImplementedError("FocalLoss is not restated (fl_gamma is 0 in hyp.scratch-low.yaml)")
        m = de_parallel(model).model[-1]
        self.balance = {3: [4.0, 1.0, 0.4]}.get(m.nl, [4.0, 1.0, 0.25, 0.06, 0.02])
        self.ssi = list(m.stride).index(16) if autobalance else 0
        self.BCEcls, self.BCEobj, self.gr, self.hyp, self.autobalance = BCEcls, BCEobj, 1.0, h, autobalance
        self.na = m.na
        self.nc = m.nc
        self.nl = m.nl
        self.anchors = m.anchors
        self.device = device

    def __call__(self, p, targets):
        lcls = torch.zeros(1, device=self.device)
        lbox = torch.zeros(1, device=self.device)
        lobj = torch.zeros(1, device=self.device)
        tcls, tbox, indices, anchors = self.build_targets(p, targets)

        for i, pi in enumerate(p):
            b, a, gj, gi = indices[i]
            tobj = torch.zeros(pi.shape[:4], dtype=pi.dtype, device=self.device)

            if n := b.shape[0]:
                pxy, pwh, _, pcls = pi[b, a, gj, gi].split((2, 2, 1, self.nc), 1)
                pxy = pxy.sigmoid() * 2 - 0.5
                pwh = (pwh.sigmoid() * 2) ** 2 * anchors[i]
                pbox = torch.cat((pxy, pwh), 1)
                iou = bbox_iou(pbox, tbox[i], CIoU=True).squeeze()
                lbox += (1.0 - iou).mean()

                iou = iou.detach().clamp(0).type(tobj.dtype)
                if self.sort_obj_iou:
                    j = iou.argsort()
                    b, a, gj, gi, iou = b[j], a[j], gj[j], gi[j], iou[j]
                if self.gr < 1:
                    iou = (1.0 - self.gr) + self.gr * iou
                tobj[b, a, gj, gi] = iou

                if self.nc > 1:
                    t = torch.full_like(pcls, self.cn, device=self.device)
                    t[range(n), tcls[i]] = self.cp
                    lcls += self.BCEcls(pcls, t)

            obji = self.BCEobj(pi[..., 4], tobj)
            lobj += obji * self.balance[i]
            if self.autobalance:
                self.balance[i] = self.balance[i] * 0.9999 + 0.0001 / obji.detach().item()

        if self.autobalance:
            self.balance = [x / self.balance[self.ssi] for x in self.balance]
        lbox *= self.hyp["box"]
        lobj *= self.hyp["obj"]
        lcls *= self.hyp["cls"]
        bs = tobj.shape[0]
        return (lbox + lobj + lcls) * bs, torch.cat((lbox, lobj, lcls)).detach()

    def build_targets(self, p, targets):
        na, nt = self.na, targets.shape[0]
        tcls, tbox, indices, anch = [], [], [], []
        gain = torch.ones(7, device=self.device)
        ai = torch.arange(na, device=self.device).float().view(na, 1).repeat(1, nt)
        targets = torch.cat((targets.repeat(na, 1, 1), ai[..., None]), 2)

        g = 0.5
        off = torch.tensor([[0, 0], [1, 0], [0, 1], [-1, 0], [0, -1]], device=self.device).float() * g

        for i in range(self.nl):
            anchors, shape = self.anchors[i], p[i].shape
            gain[2:6] = torch.tensor(shape)[[3, 2, 3, 2]]

            t = targets * gain
            if nt:
                r = t[..., 4:6] / anchors[:, None]
                j = torch.max(r, 1 / r).max(2)[0] < self.hyp["anchor_t"]
                t = t[j]

                gxy = t[:, 2:4]
                gxi = gain[[2, 3]] - gxy
                j, k = ((gxy % 1 < g) & (gxy > 1)).T
                left, right = ((gxi % 1 < g) & (gxi > 1)).T
                j = torch.stack((torch.ones_like(j), j, k, left, right))
                t = t.repeat((5, 1, 1))[j]
                offsets = (torch.zeros_like(gxy)[None] + off[:, None])[j]
            else:
                t = targets[0]
                offsets = 0

            bc, gxy, gwh, a = t.chunk(4, 1)
            a, (b, c) = a.long().view(-1), bc.long().T
            gij = (gxy - offsets).long()
            gi, gj = gij.T

            indices.append((b, a, gj.clamp_(0, shape[2] - 1), gi.clamp_(0, shape[3] - 1)))
            tbox.append(torch.cat((gxy - gij, gwh), 1))
            anch.append(anchors[a])
            tcls.append(c)

        return tcls, tbox, indices, anch


# ---- synthetic data (the dataloader's collate_fn layout) ----------------------------------------
def synthetic_batches(n_batches, g):
    out = []
    for _ in range(n_batches):
        imgs = torch.randint(0, 256, (BATCH, 3, IMGSZ, IMGSZ), generator=g, dtype=torch.uint8)
        labels = []
        for bi in range(BATCH):
            k = int(torch.randint(1, 4, (1,), generator=g))
            cls = torch.randint(0, NC, (k, 1), generator=g).float()
            wh = torch.rand(k, 2, generator=g) * 0.5 + 0.1
            xy = wh / 2 + torch.rand(k, 2, generator=g) * (1 - wh)
            labels.append(torch.cat((torch.full((k, 1), float(bi)), cls, xy, wh), 1))
        out.append((imgs, torch.cat(labels, 0), None, None))
    return out


def main(sg, steps=8, device="cpu", amp=None, warmup_in_step=None):
    warmup_in_step = WARMUP_IN_STEP if warmup_in_step is None else warmup_in_step
    device = torch.device(device)
    cuda = device.type != "cpu"
    hyp = dict(HYP)
    epochs, batch_size, nc, imgsz = EPOCHS, BATCH, NC, IMGSZ
    model = TinyDetectionModel(ch=3, nc=nc).to(device)
    amp_enabled = cuda   # check_amp(model): False on the CPU

    nbs = 64
    accumulate = max(round(nbs / batch_size), 1)
    hyp["weight_decay"] *= batch_size * accumulate / nbs
    optimizer = smart_optimizer(model, "SGD", hyp["lr0"], hyp["momentum"], hyp["weight_decay"])

    lf = lambda x: (1 - x / epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]  # noqa: E731 (linear)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model)
    start_epoch = 0

    g = torch.Generator().manual_seed(3)
    train_loader = synthetic_batches(NB, g)

    nl = de_parallel(model).model[-1].nl
    hyp["box"] *= 3 / nl
    hyp["cls"] *= nc / 80 * 3 / nl
    hyp["obj"] *= (imgsz / 640) ** 2 * 3 / nl
    hyp["label_smoothing"] = 0.0
    model.nc = nc
    model.hyp = hyp

    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    last_opt_step = -1
    scheduler.last_epoch = start_epoch - 1
    scaler = torch.cuda.amp.GradScaler(enabled=amp_enabled)
    compute_loss = ComputeLoss(model)
    sg.track(model=model, optimizer=optimizer, ema=ema.ema, scheduler=scheduler)

    epoch = start_epoch
    mloss = None

    def warmup(ni):
        nonlocal accumulate
        if ni <= nw:
            xi = [0, nw]
            accumulate = max(1, np.interp(ni, xi, [1, nbs / batch_size]).round())
            for j, x in enumerate(optimizer.param_groups):
                x["lr"] = np.interp(ni, xi, [hyp["warmup_bias_lr"] if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])
                if "momentum" in x:
                    x["momentum"] = np.interp(ni, xi, [hyp["warmup_momentum"], hyp["momentum"]])

    @sg.compile
    def train_step(i, imgs, targets):
        nonlocal last_opt_step, mloss
        ni = i + nb * epoch
        imgs = imgs.to(device, non_blocking=True).float() / 255

        # Warmup
        if warmup_in_step:
            warmup(ni)

        # Forward
        with (torch.autocast("cpu", dtype=torch.bfloat16) if amp == "bf16" else smart_amp_autocast(amp_enabled)):
            pred = model(imgs)
            loss, loss_items = compute_loss(pred, targets.to(device))

        # Backward
        scaler.scale(loss).backward()

        # Optimize
        if ni - last_opt_step >= accumulate:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if ema:
                ema.update(model)
            last_opt_step = ni

        # Log
        mloss = (mloss * i + loss_items) / (i + 1)
        return loss

    calls = 0
    for epoch in range(start_epoch, epochs):
        model.train()
        mloss = torch.zeros(3, device=device)
        optimizer.zero_grad()
        for i, (imgs, targets, paths, _) in enumerate(train_loader):
            if not warmup_in_step:
                warmup(i + nb * epoch)
            train_step(i, imgs, targets)
            calls += 1
            sg.log({"epoch": epoch, "mloss": mloss, "instances": targets.shape[0], "accumulate": accumulate,
                    "last_opt_step": last_opt_step})
            if calls >= steps:
                break
        scheduler.step()
        if calls >= steps:
            break
