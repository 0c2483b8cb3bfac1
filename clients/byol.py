"""lucidrains/byol-pytorch: Bootstrap Your Own Latent. ``BYOL`` wraps a backbone in a ``NetWrapper``
(a forward hook on the hidden layer stores its flattened output in ``self.hidden[device]``; the
projector MLP -- Linear, BatchNorm1d, ReLU(inplace), Linear -- is made lazily by the
``@singleton('projector')`` getter on the first forward), adds an online predictor MLP, and keeps a
target encoder: a ``copy.deepcopy`` of the online encoder made lazily by
``@singleton('target_encoder')``, requires_grad False. ``__init__`` runs one mock forward on
``torch.randn(2, 3, image_size, image_size)`` so that the lazy modules exist before the optimizer
is made. Each forward: the two augmentations of the batch (``augment1(x)``, ``augment2(x)``),
``torch.cat`` of both views, the online encoder and predictor once on the pair, ``chunk(2)``; under
``no_grad`` the target encoder on the pair (detached, chunked); the loss ``loss_fn`` (the normalised
MSE, ``2 - 2 * (normalize(x) * normalize(y)).sum(-1)``) symmetrised, ``loss_one + loss_two``, and
its mean. ``update_moving_average`` is the EMA of the target: for each parameter pair
``ma_params.data = ema_updater.update_average(old_weight, up_weight)`` (``EMA.update_average``:
``old * beta + (1 - beta) * new``, beta 0.99): the ``.data`` of every target parameter rebound.

Loop: the README's, ``loss = learner(images); opt.zero_grad(); loss.backward(); opt.step();
learner.update_moving_average()`` over ``sample_unlabelled_images()`` (``torch.randn``), with Adam
(lr 3e-4) on ``learner.parameters()``; the whole body, the moving-average update included, is the
step function; the images are drawn in the loop and passed in.

Source: https://github.com/lucidrains/byol-pytorch/blob/61621ed3d6816f5fec62d934c7853d3293d812ed/byol_pytorch/byol_pytorch.py
(v0.8.0) and README.md there, MIT. Restated after the source, not copied: same modules, names, ops
and order (the SimSiam MLP and the ``use_momentum=False`` path kept; ``MaybeSyncBatchnorm`` gives
BatchNorm1d: no process group). Augmentations: the default ``DEFAULT_AUG`` is torchvision's SimCLR
pipeline (ColorJitter, RandomGrayscale, RandomHorizontalFlip, GaussianBlur, RandomResizedCrop,
Normalize, and ``RandomApply`` deciding with Python's ``random.random()``); torchvision is not
usable here, so this client passes ``augment_fn`` / ``augment_fn2`` as the README's "Advanced"
section does (there: kornia's ``RandomHorizontalFlip()``, and that plus ``GaussianBlur2d((3, 3),
(1.5, 1.5))`` for the second view), restated as simple torch modules: a per-sample horizontal flip
drawn with ``torch.rand`` on the batch's device (``torch.where``; no host read), and a fixed 3x3
Gaussian blur (sigma 1.5, depthwise conv, reflect padding). They run inside the learner's forward,
so inside the step, as the program runs them. Backbone: instead of torchvision's resnet50, a tiny
CNN whose ``avgpool`` is the hidden layer (``hidden_layer='avgpool'`` as the README). Scaled down:
image_size 256 -> 16, batch 20 -> 4, projection_size 256 -> 16, projection_hidden_size 4096 -> 32.
"""
import copy
import random
from functools import wraps

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SOURCE = ("https://github.com/lucidrains/byol-pytorch/blob/61621ed3d6816f5fec62d934c7853d3293d812ed/"
          "byol_pytorch/byol_pytorch.py")
LICENSE = "MIT"
TAGS = ("self-supervised", "byol", "ema-teacher", "data-rebind", "forward-hook", "hook-dict", "lazy-modules",
        "deepcopy", "augment-in-step", "rand-in-step", "batchnorm", "adam")


# ---- byol_pytorch/byol_pytorch.py (restated) ----

def default(val, def_val):
    return def_val if val is None else val


def flatten(t):
    return t.reshape(t.shape[0], -1)


def singleton(cache_key):
    """Make the decorated getter build its object once and keep it on self.<cache_key>."""
    def inner_fn(fn):
        @wraps(fn)
        def wrapper(self, *args, **kwargs):
            instance = getattr(self, cache_key)
            if instance is not None:
                return instance

            instance = fn(self, *args, **kwargs)
            setattr(self, cache_key, instance)
            return instance
        return wrapper
    return inner_fn


def get_module_device(module):
    return next(module.parameters()).device


def set_requires_grad(model, val):
    for p in model.parameters():
        p.requires_grad = val


def MaybeSyncBatchnorm(is_distributed=None):
    is_distributed = default(is_distributed, dist.is_initialized() and dist.get_world_size() > 1)
    return nn.SyncBatchNorm if is_distributed else nn.BatchNorm1d


# loss fn

def loss_fn(x, y):
    x = F.normalize(x, dim=-1, p=2)
    y = F.normalize(y, dim=-1, p=2)
    return 2 - 2 * (x * y).sum(dim=-1)


# augmentation utils

class RandomApply(nn.Module):
    def __init__(self, fn, p):
        super().__init__()
        self.fn = fn
        self.p = p

    def forward(self, x):
        if random.random() > self.p:
            return x
        return self.fn(x)


# exponential moving average

class EMA():
    def __init__(self, beta):
        super().__init__()
        self.beta = beta

    def update_average(self, old, new):
        if old is None:
            return new
        return old * self.beta + (1 - self.beta) * new


def update_moving_average(ema_updater, ma_model, current_model):
    for current_params, ma_params in zip(current_model.parameters(), ma_model.parameters()):
        old_weight, up_weight = ma_params.data, current_params.data
        ma_params.data = ema_updater.update_average(old_weight, up_weight)


# MLPs for the projector and the predictor

def MLP(dim, projection_size, hidden_size=4096, sync_batchnorm=None):
    return nn.Sequential(
        nn.Linear(dim, hidden_size),
        MaybeSyncBatchnorm(sync_batchnorm)(hidden_size),
        nn.ReLU(inplace=True),
        nn.Linear(hidden_size, projection_size)
    )


def SimSiamMLP(dim, projection_size, hidden_size=4096, sync_batchnorm=None):
    return nn.Sequential(
        nn.Linear(dim, hidden_size, bias=False),
        MaybeSyncBatchnorm(sync_batchnorm)(hidden_size),
        nn.ReLU(inplace=True),
        nn.Linear(hidden_size, hidden_size, bias=False),
        MaybeSyncBatchnorm(sync_batchnorm)(hidden_size),
        nn.ReLU(inplace=True),
        nn.Linear(hidden_size, projection_size, bias=False),
        MaybeSyncBatchnorm(sync_batchnorm)(projection_size, affine=False)
    )


class NetWrapper(nn.Module):
    """The backbone, with a hook taking its hidden layer's output, and a lazily made projector."""

    def __init__(self, net, projection_size, projection_hidden_size, layer=-2, use_simsiam_mlp=False,
                 sync_batchnorm=None):
        super().__init__()
        self.net = net
        self.layer = layer

        self.projector = None
        self.projection_size = projection_size
        self.projection_hidden_size = projection_hidden_size

        self.use_simsiam_mlp = use_simsiam_mlp
        self.sync_batchnorm = sync_batchnorm

        self.hidden = {}
        self.hook_registered = False

    def _find_layer(self):
        if type(self.layer) == str:
            modules = dict([*self.net.named_modules()])
            return modules.get(self.layer, None)
        elif type(self.layer) == int:
            children = [*self.net.children()]
            return children[self.layer]
        return None

    def _hook(self, _, input, output):
        device = input[0].device
        self.hidden[device] = flatten(output)

    def _register_hook(self):
        layer = self._find_layer()
        assert layer is not None, f'hidden layer ({self.layer}) not found'
        handle = layer.register_forward_hook(self._hook)
        self.hook_registered = True

    @singleton('projector')
    def _get_projector(self, hidden):
        _, dim = hidden.shape
        create_mlp_fn = MLP if not self.use_simsiam_mlp else SimSiamMLP
        projector = create_mlp_fn(dim, self.projection_size, self.projection_hidden_size,
                                  sync_batchnorm=self.sync_batchnorm)
        return projector.to(hidden)

    def get_representation(self, x):
        if self.layer == -1:
            return self.net(x)

        if not self.hook_registered:
            self._register_hook()

        self.hidden.clear()
        _ = self.net(x)
        hidden = self.hidden[x.device]
        self.hidden.clear()

        assert hidden is not None, f'hidden layer {self.layer} never emitted an output'
        return hidden

    def forward(self, x, return_projection=True):
        representation = self.get_representation(x)

        if not return_projection:
            return representation

        projector = self._get_projector(representation)
        projection = projector(representation)
        return projection, representation


class BYOL(nn.Module):
    def __init__(self, net, image_size, hidden_layer=-2, projection_size=256, projection_hidden_size=4096,
                 augment_fn=None, augment_fn2=None, moving_average_decay=0.99, use_momentum=True,
                 sync_batchnorm=None):
        super().__init__()
        self.net = net

        # DEFAULT_AUG (torchvision's SimCLR augmentations) is not built here: see the module doc.
        DEFAULT_AUG = None

        self.augment1 = default(augment_fn, DEFAULT_AUG)
        self.augment2 = default(augment_fn2, self.augment1)

        self.online_encoder = NetWrapper(
            net,
            projection_size,
            projection_hidden_size,
            layer=hidden_layer,
            use_simsiam_mlp=not use_momentum,
            sync_batchnorm=sync_batchnorm
        )

        self.use_momentum = use_momentum
        self.target_encoder = None
        self.target_ema_updater = EMA(moving_average_decay)

        self.online_predictor = MLP(projection_size, projection_size, projection_hidden_size)

        # put the wrapper on the backbone's device
        device = get_module_device(net)
        self.to(device)

        # one mock batch, so that the lazily made modules exist
        self.forward(torch.randn(2, 3, image_size, image_size, device=device))

    @singleton('target_encoder')
    def _get_target_encoder(self):
        target_encoder = copy.deepcopy(self.online_encoder)
        set_requires_grad(target_encoder, False)
        return target_encoder

    def reset_moving_average(self):
        del self.target_encoder
        self.target_encoder = None

    def update_moving_average(self):
        assert self.use_momentum, 'no moving average to update: momentum is off for the target encoder'
        assert self.target_encoder is not None, 'target encoder has not been created yet'
        update_moving_average(self.target_ema_updater, self.target_encoder, self.online_encoder)

    def forward(self, x, return_embedding=False, return_projection=True):
        assert not (self.training and x.shape[0] == 1), \
            'training needs more than 1 sample (batchnorm in the projection layer)'

        if return_embedding:
            return self.online_encoder(x, return_projection=return_projection)

        image_one, image_two = self.augment1(x), self.augment2(x)

        images = torch.cat((image_one, image_two), dim=0)

        online_projections, _ = self.online_encoder(images)
        online_predictions = self.online_predictor(online_projections)

        online_pred_one, online_pred_two = online_predictions.chunk(2, dim=0)

        with torch.no_grad():
            target_encoder = self._get_target_encoder() if self.use_momentum else self.online_encoder

            target_projections, _ = target_encoder(images)
            target_projections = target_projections.detach()

            target_proj_one, target_proj_two = target_projections.chunk(2, dim=0)

        loss_one = loss_fn(online_pred_one, target_proj_two.detach())
        loss_two = loss_fn(online_pred_two, target_proj_one.detach())

        loss = loss_one + loss_two
        return loss.mean()


# ---- stand-ins: the backbone and the README's augment_fn / augment_fn2 ----

class TinyConvNet(nn.Module):
    """In place of torchvision's resnet50: conv-BN-ReLU x2, ``avgpool``, ``fc``."""

    def __init__(self, num_classes=10, width=8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


class RandomHorizontalFlip(nn.Module):
    """Each image flipped with probability p (one draw per image, on the batch's device)."""

    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def forward(self, x):
        flip = torch.rand(x.shape[0], 1, 1, 1, device=x.device) < self.p
        return torch.where(flip, x.flip(-1), x)


class GaussianBlur2d(nn.Module):
    """A fixed Gaussian blur: depthwise conv, reflect padding."""

    def __init__(self, kernel_size, sigma):
        super().__init__()
        kh, kw = kernel_size
        def g(k, s):
            t = torch.arange(k, dtype=torch.float32) - (k - 1) / 2
            w = torch.exp(-t ** 2 / (2 * s ** 2))
            return w / w.sum()
        self.register_buffer("kernel", g(kh, sigma[0])[:, None] * g(kw, sigma[1])[None, :])
        self.pad = (kw // 2, kw // 2, kh // 2, kh // 2)

    def forward(self, x):
        c = x.shape[1]
        w = self.kernel.expand(c, 1, *self.kernel.shape)
        return F.conv2d(F.pad(x, self.pad, mode="reflect"), w, groups=c)


def main(sg, steps=8, device="cpu", amp=None):
    image_size = 16
    resnet = TinyConvNet().to(device)

    augment_fn = nn.Sequential(
        RandomHorizontalFlip()
    )
    augment_fn2 = nn.Sequential(
        RandomHorizontalFlip(),
        GaussianBlur2d((3, 3), (1.5, 1.5))
    )

    learner = BYOL(
        resnet,
        image_size=image_size,
        hidden_layer='avgpool',
        projection_size=16,
        projection_hidden_size=32,
        augment_fn=augment_fn,
        augment_fn2=augment_fn2,
    )

    opt = torch.optim.Adam(learner.parameters(), lr=3e-4)
    sg.track(learner=learner, opt=opt)

    def sample_unlabelled_images():
        return torch.randn(4, 3, image_size, image_size, device=device)

    @sg.compile
    def train_step(images):
        loss = learner(images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        learner.update_moving_average()  # update moving average of target encoder
        return loss

    for _ in range(steps):
        images = sample_unlabelled_images()
        loss = train_step(images)
        sg.log(loss)
