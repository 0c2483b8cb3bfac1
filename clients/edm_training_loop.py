"""NVlabs/edm: the EDM diffusion training loop (training/training_loop.py) with ``EDMLoss``
(training/loss.py) and ``EDMPrecond`` (training/networks.py). Per iteration, as the program writes
it: ``optimizer.zero_grad(set_to_none=True)``; ``num_accumulation_rounds`` rounds, each under
``misc.ddp_sync(ddp, round_idx == last)`` (``ddp.no_sync()`` on all but the last), taking
``next(dataset_iterator)``, ``images.to(device).to(torch.float32) / 127.5 - 1``, the loss
``loss_fn(net=ddp, images=images, labels=labels, augment_pipe=augment_pipe)`` -- EDMLoss:
``rnd_normal = torch.randn([N, 1, 1, 1])``, ``sigma = (rnd_normal * P_std + P_mean).exp()``,
``weight = (sigma ** 2 + sigma_data ** 2) / (sigma * sigma_data) ** 2``, ``n = randn_like(y) *
sigma``, ``D_yn = net(y + n, sigma, labels, augment_labels=None)`` (EDMPrecond: ``c_skip``,
``c_out``, ``c_in``, ``c_noise = sigma.log() / 4``, ``D_x = c_skip * x + c_out * F_x``), the
per-pixel ``weight * (D_yn - y) ** 2`` --, ``training_stats.report('Loss/loss', loss)`` (its
float64 moment counters, created lazily in a module-level dict and ``add_``-ed in place),
``loss.sum().mul(loss_scaling / batch_gpu_total).backward()``; then the lr ramp-up assigned in
every param group (``g['lr'] = optimizer_kwargs['lr'] * min(cur_nimg / max(lr_rampup_kimg *
1000, 1e-8), 1)``: 0 at the first step), ``torch.nan_to_num(param.grad, nan=0, posinf=1e5,
neginf=-1e5, out=param.grad)`` over every grad, ``optimizer.step()`` (Adam, betas [0.9, 0.999],
eps 1e-8), and the EMA: ``ema_halflife_nimg = min(ema_halflife_kimg * 1000, cur_nimg *
ema_rampup_ratio)``, ``ema_beta = 0.5 ** (batch_size / max(ema_halflife_nimg, 1e-8))`` (a Python
float that changes every step: 0.0 at the first), ``p_ema.copy_(p_net.detach().lerp(p_ema,
ema_beta))`` (outside ``no_grad``, as the program does; ``ema`` is a deepcopy with
``requires_grad_(False)``). After it, ``cur_nimg += batch_size`` and, once per tick, the status
line from ``training_stats`` (``Collector.update()``, the mean loss), which the client logs.

What a user of stepgraph changes: the loop body from "Accumulate gradients" to "Update EMA" is a
function decorated with ``@sg.compile`` (``@stepgraph.compile``) and called once per iteration; it
reads ``cur_nimg`` from the enclosing function, as the inlined loop body does. The tick block
(maintenance, status line, snapshots) stays in the loop.

Scaled down / replaced: the network is a two-level SongUNet-shaped denoiser (ddpmpp's mapping
network: ``PositionalEmbedding(endpoint=True)`` with the sin/cos flip, two ``Linear`` + SiLU;
a 3x3 ``Conv2d`` in, ``UNetBlock``s with adaptive scale, a ``down``/``up`` resample pair with
``resample_filter=[1,1]``, skip concatenation, ``GroupNorm`` + 3x3 ``Conv2d`` out) built from
EDM's own ``Linear``, ``Conv2d``, ``GroupNorm``, ``UNetBlock``, ``weight_init`` (restated; ddpmpp's
``init_mode='xavier_uniform'``, ``init_zero`` weight 1e-5, dropout 0.13 as train.py's default) at
model_channels 16, on 8x8 RGB; no attention blocks (SongUNet puts them at 16x16). Data: 64 random
uint8 8x8 images with empty labels (``label_dim`` 0, unconditional) in training/dataset.py's
``Dataset`` form (numpy ``image.copy(), label.copy()`` per item; restated, held in memory) through
``misc.InfiniteSampler`` (restated) instead of CIFAR-10's ImageFolderDataset zip; augmentation off (``--augment=0``, a
train.py option). ``batch_size`` 512 -> 8 with ``batch_gpu`` 4 (so 2 accumulation rounds and the
``no_sync`` path run), ``lr`` 1e-3 (train.py's 10e-4), ``lr_rampup_kimg`` 10000 -> 0.032 (the ramp
ends at the 5th step), ``ema_halflife_kimg`` 500 (train.py: ``int(--ema 0.5 * 1000)``) with
``ema_rampup_ratio`` 0.05, ``kimg_per_tick`` 50 -> 0.032; DDP in a one-process gloo group (the
program always wraps ``net`` in DDP); no snapshots, state dumps or stats.jsonl; no print of
the module summary; the tick's GPU-memory fields dropped (CPU).

Variants (``main``'s keywords; clients ``edm_training_loop_tensordataset``,
``edm_training_loop_batch_outside``): ``tensor_dataset=True`` holds the same images in a
``torch.utils.data.TensorDataset`` (the in-memory form many users write) instead of the numpy
``Dataset``; ``batch_outside=True`` (with the TensorDataset) takes the accumulation rounds'
batches with ``next(dataset_iterator)`` in the loop and passes them to the step (which then
indexes ``batches[round_idx]``): the fix stepgraph names for ``next()`` in the step.

Source: https://github.com/NVlabs/edm/blob/008a4e5316c8e3bfe61a62f874bddba254295afb/training/training_loop.py
(and training/loss.py, training/networks.py, torch_utils/training_stats.py, torch_utils/misc.py
at that commit), CC BY-NC-SA 4.0, Copyright (c) 2022 NVIDIA CORPORATION & AFFILIATES. Restated
after the source, not copied: same modules, names, ops, initialisation and loop semantics.
"""
import copy
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.functional import silu

SOURCE = "https://github.com/NVlabs/edm/blob/008a4e5316c8e3bfe61a62f874bddba254295afb/training/training_loop.py"
LICENSE = "CC-BY-NC-SA-4.0"
DEVICES = ("cpu", "cuda")
TAGS = ("diffusion", "edm", "unet", "groupnorm", "dropout", "rng-in-step", "randn-in-step", "ddp", "no-sync",
        "grad-accumulation", "data-in-step", "per-step-lr", "lr-computed-in-step", "lr-zero", "nan-to-num-out",
        "adam", "ema-in-step", "ema-lerp", "python-float-changes-every-step", "global-stats-counter")


# ---------------------------------------------------------------- torch_utils/training_stats.py (restated)

class training_stats:
    _num_moments = 3               # [num_scalars, sum_of_scalars, sum_of_squares]
    _reduce_dtype = torch.float32  # initial per-tensor reduction
    _counter_dtype = torch.float64 # internal counters
    _counters = dict()             # name => device => torch.Tensor

    @staticmethod
    def report(name, value):
        self = training_stats
        if name not in self._counters:
            self._counters[name] = dict()
        elems = torch.as_tensor(value)
        if elems.numel() == 0:
            return value
        elems = elems.detach().flatten().to(self._reduce_dtype)
        moments = torch.stack([
            torch.ones_like(elems).sum(),
            elems.sum(),
            elems.square().sum(),
        ])
        assert moments.ndim == 1 and moments.shape[0] == self._num_moments
        moments = moments.to(self._counter_dtype)
        device = moments.device
        if device not in self._counters[name]:
            self._counters[name][device] = torch.zeros_like(moments)
        self._counters[name][device].add_(moments)
        return value

    class Collector:
        """(single process) the moments since the last ``update()``: mean and std per name."""

        def __init__(self):
            self._moments = dict()
            self.update()
            self._moments.clear()

        def update(self):
            for name, per_device in training_stats._counters.items():
                delta = torch.zeros([training_stats._num_moments], dtype=training_stats._counter_dtype)
                for counter in per_device.values():
                    delta.add_(counter.to('cpu'))
                    counter.copy_(torch.zeros_like(counter))
                self._moments[name] = delta

        def mean(self, name):
            m = self._moments.get(name)
            return float('nan') if m is None or m[0] == 0 else float(m[1] / m[0])

        def std(self, name):
            m = self._moments.get(name)
            if m is None or m[0] == 0:
                return float('nan')
            mean = float(m[1] / m[0])
            raw_var = float(m[2] / m[0])
            return np.sqrt(max(raw_var - np.square(mean), 0))


# ---------------------------------------------------------------- training/dataset.py (restated)

class Dataset(torch.utils.data.Dataset):
    """training.dataset.Dataset, unconditional, no xflip, images held in memory (``cache=True``):
    ``__getitem__`` returns ``(image.copy(), label.copy())`` as numpy arrays (uint8 CHW, and a
    float32 label of length 0)."""

    def __init__(self, raw_images):
        self._raw_images = raw_images
        self._raw_idx = np.arange(raw_images.shape[0], dtype=np.int64)
        self._raw_labels = np.zeros([raw_images.shape[0], 0], dtype=np.float32)

    def __len__(self):
        return self._raw_idx.size

    def __getitem__(self, idx):
        image = self._raw_images[self._raw_idx[idx]]
        assert isinstance(image, np.ndarray) and image.dtype == np.uint8
        return image.copy(), self.get_label(idx)

    def get_label(self, idx):
        return self._raw_labels[self._raw_idx[idx]].copy()


# ---------------------------------------------------------------- torch_utils/misc.py (restated)

class InfiniteSampler(torch.utils.data.Sampler):
    def __init__(self, dataset, rank=0, num_replicas=1, shuffle=True, seed=0, window_size=0.5):
        assert len(dataset) > 0 and num_replicas > 0 and 0 <= rank < num_replicas and 0 <= window_size <= 1
        super().__init__()
        self.dataset, self.rank, self.num_replicas = dataset, rank, num_replicas
        self.shuffle, self.seed, self.window_size = shuffle, seed, window_size

    def __iter__(self):
        order = np.arange(len(self.dataset))
        rnd = None
        window = 0
        if self.shuffle:
            rnd = np.random.RandomState(self.seed)
            rnd.shuffle(order)
            window = int(np.rint(order.size * self.window_size))
        idx = 0
        while True:
            i = idx % order.size
            if idx % self.num_replicas == self.rank:
                yield order[i]
            if window >= 2:
                j = (i - rnd.randint(window)) % order.size
                order[i], order[j] = order[j], order[i]
            idx += 1


class misc:
    InfiniteSampler = InfiniteSampler

    @staticmethod
    def ddp_sync(module, sync):
        import contextlib

        @contextlib.contextmanager
        def _ctx():
            assert isinstance(module, torch.nn.Module)
            if sync or not isinstance(module, torch.nn.parallel.DistributedDataParallel):
                yield
            else:
                with module.no_sync():
                    yield
        return _ctx()


# ---------------------------------------------------------------- training/networks.py (restated)

def weight_init(shape, mode, fan_in, fan_out):
    if mode == 'xavier_uniform': return np.sqrt(6 / (fan_in + fan_out)) * (torch.rand(*shape) * 2 - 1)
    if mode == 'xavier_normal': return np.sqrt(2 / (fan_in + fan_out)) * torch.randn(*shape)
    if mode == 'kaiming_uniform': return np.sqrt(3 / fan_in) * (torch.rand(*shape) * 2 - 1)
    if mode == 'kaiming_normal': return np.sqrt(1 / fan_in) * torch.randn(*shape)
    raise ValueError(f'Invalid init mode "{mode}"')


class Linear(torch.nn.Module):
    def __init__(self, in_features, out_features, bias=True, init_mode='kaiming_normal', init_weight=1, init_bias=0):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        init_kwargs = dict(mode=init_mode, fan_in=in_features, fan_out=out_features)
        self.weight = torch.nn.Parameter(weight_init([out_features, in_features], **init_kwargs) * init_weight)
        self.bias = torch.nn.Parameter(weight_init([out_features], **init_kwargs) * init_bias) if bias else None

    def forward(self, x):
        x = x @ self.weight.to(x.dtype).t()
        if self.bias is not None:
            x = x.add_(self.bias.to(x.dtype))
        return x


class Conv2d(torch.nn.Module):
    def __init__(self, in_channels, out_channels, kernel, bias=True, up=False, down=False,
                 resample_filter=[1, 1], fused_resample=False, init_mode='kaiming_normal', init_weight=1, init_bias=0):
        assert not (up and down)
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.up, self.down, self.fused_resample = up, down, fused_resample
        init_kwargs = dict(mode=init_mode, fan_in=in_channels * kernel * kernel, fan_out=out_channels * kernel * kernel)
        self.weight = torch.nn.Parameter(weight_init([out_channels, in_channels, kernel, kernel], **init_kwargs) * init_weight) if kernel else None
        self.bias = torch.nn.Parameter(weight_init([out_channels], **init_kwargs) * init_bias) if kernel and bias else None
        f = torch.as_tensor(resample_filter, dtype=torch.float32)
        f = f.ger(f).unsqueeze(0).unsqueeze(1) / f.sum().square()
        self.register_buffer('resample_filter', f if up or down else None)

    def forward(self, x):
        w = self.weight.to(x.dtype) if self.weight is not None else None
        b = self.bias.to(x.dtype) if self.bias is not None else None
        f = self.resample_filter.to(x.dtype) if self.resample_filter is not None else None
        w_pad = w.shape[-1] // 2 if w is not None else 0
        f_pad = (f.shape[-1] - 1) // 2 if f is not None else 0
        F = torch.nn.functional
        if self.up:
            x = F.conv_transpose2d(x, f.mul(4).tile([self.in_channels, 1, 1, 1]), groups=self.in_channels, stride=2, padding=f_pad)
        if self.down:
            x = F.conv2d(x, f.tile([self.in_channels, 1, 1, 1]), groups=self.in_channels, stride=2, padding=f_pad)
        if w is not None:
            x = F.conv2d(x, w, padding=w_pad)
        if b is not None:
            x = x.add_(b.reshape(1, -1, 1, 1))
        return x


class GroupNorm(torch.nn.Module):
    def __init__(self, num_channels, num_groups=32, min_channels_per_group=4, eps=1e-5):
        super().__init__()
        self.num_groups = min(num_groups, num_channels // min_channels_per_group)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(num_channels))
        self.bias = torch.nn.Parameter(torch.zeros(num_channels))

    def forward(self, x):
        return torch.nn.functional.group_norm(x, num_groups=self.num_groups, weight=self.weight.to(x.dtype),
                                              bias=self.bias.to(x.dtype), eps=self.eps)


class UNetBlock(torch.nn.Module):
    """(attention=False: the attention half is not built here)"""

    def __init__(self, in_channels, out_channels, emb_channels, up=False, down=False, dropout=0, skip_scale=1,
                 eps=1e-5, resample_filter=[1, 1], resample_proj=False, adaptive_scale=True,
                 init=dict(), init_zero=dict(init_weight=0)):
        super().__init__()
        self.in_channels, self.out_channels, self.emb_channels = in_channels, out_channels, emb_channels
        self.dropout, self.skip_scale, self.adaptive_scale = dropout, skip_scale, adaptive_scale
        self.norm0 = GroupNorm(num_channels=in_channels, eps=eps)
        self.conv0 = Conv2d(in_channels=in_channels, out_channels=out_channels, kernel=3, up=up, down=down,
                            resample_filter=resample_filter, **init)
        self.affine = Linear(in_features=emb_channels, out_features=out_channels * (2 if adaptive_scale else 1), **init)
        self.norm1 = GroupNorm(num_channels=out_channels, eps=eps)
        self.conv1 = Conv2d(in_channels=out_channels, out_channels=out_channels, kernel=3, **init_zero)
        self.skip = None
        if out_channels != in_channels or up or down:
            kernel = 1 if resample_proj or out_channels != in_channels else 0
            self.skip = Conv2d(in_channels=in_channels, out_channels=out_channels, kernel=kernel, up=up, down=down,
                               resample_filter=resample_filter, **init)

    def forward(self, x, emb):
        orig = x
        x = self.conv0(silu(self.norm0(x)))
        params = self.affine(emb).unsqueeze(2).unsqueeze(3).to(x.dtype)
        if self.adaptive_scale:
            scale, shift = params.chunk(chunks=2, dim=1)
            x = silu(torch.addcmul(shift, self.norm1(x), scale + 1))
        else:
            x = silu(self.norm1(x.add_(params)))
        x = self.conv1(torch.nn.functional.dropout(x, p=self.dropout, training=self.training))
        x = x.add_(self.skip(orig) if self.skip is not None else orig)
        x = x * self.skip_scale
        return x


class PositionalEmbedding(torch.nn.Module):
    def __init__(self, num_channels, max_positions=10000, endpoint=False):
        super().__init__()
        self.num_channels, self.max_positions, self.endpoint = num_channels, max_positions, endpoint

    def forward(self, x):
        freqs = torch.arange(start=0, end=self.num_channels // 2, dtype=torch.float32, device=x.device)
        freqs = freqs / (self.num_channels // 2 - (1 if self.endpoint else 0))
        freqs = (1 / self.max_positions) ** freqs
        x = x.ger(freqs.to(x.dtype))
        return torch.cat([x.cos(), x.sin()], dim=1)


class TinySongUNet(torch.nn.Module):
    """SongUNet (ddpmpp) shape at two resolutions, num_blocks=1 (two decoder blocks a level), no attention."""

    def __init__(self, img_resolution, in_channels, out_channels, label_dim=0, model_channels=16,
                 channel_mult=[1, 2], channel_mult_emb=4, dropout=0.10, resample_filter=[1, 1]):
        super().__init__()
        emb_channels = model_channels * channel_mult_emb
        noise_channels = model_channels * 1   # channel_mult_noise=1
        init = dict(init_mode='xavier_uniform')
        init_zero = dict(init_mode='xavier_uniform', init_weight=1e-5)
        block_kwargs = dict(emb_channels=emb_channels, dropout=dropout, skip_scale=np.sqrt(0.5), eps=1e-6,
                            resample_filter=resample_filter, resample_proj=True, adaptive_scale=False,
                            init=init, init_zero=init_zero)
        # mapping
        self.map_noise = PositionalEmbedding(num_channels=noise_channels, endpoint=True)
        self.map_layer0 = Linear(in_features=noise_channels, out_features=emb_channels, **init)
        self.map_layer1 = Linear(in_features=emb_channels, out_features=emb_channels, **init)
        # encoder
        c0, c1 = model_channels * channel_mult[0], model_channels * channel_mult[1]
        self.enc = torch.nn.ModuleDict()
        self.enc[f'{img_resolution}x{img_resolution}_conv'] = Conv2d(in_channels=in_channels, out_channels=c0, kernel=3, **init)
        self.enc[f'{img_resolution}x{img_resolution}_block0'] = UNetBlock(in_channels=c0, out_channels=c0, **block_kwargs)
        r = img_resolution // 2
        self.enc[f'{r}x{r}_down'] = UNetBlock(in_channels=c0, out_channels=c0, down=True, **block_kwargs)
        self.enc[f'{r}x{r}_block0'] = UNetBlock(in_channels=c0, out_channels=c1, **block_kwargs)
        # decoder
        self.dec = torch.nn.ModuleDict()
        self.dec[f'{r}x{r}_in0'] = UNetBlock(in_channels=c1, out_channels=c1, **block_kwargs)
        self.dec[f'{r}x{r}_block0'] = UNetBlock(in_channels=c1 + c1, out_channels=c1, **block_kwargs)
        self.dec[f'{r}x{r}_block1'] = UNetBlock(in_channels=c1 + c0, out_channels=c1, **block_kwargs)
        self.dec[f'{img_resolution}x{img_resolution}_up'] = UNetBlock(in_channels=c1, out_channels=c1, up=True, **block_kwargs)
        self.dec[f'{img_resolution}x{img_resolution}_block0'] = UNetBlock(in_channels=c1 + c0, out_channels=c0, **block_kwargs)
        self.dec[f'{img_resolution}x{img_resolution}_block1'] = UNetBlock(in_channels=c0 + c0, out_channels=c0, **block_kwargs)
        self.out_norm = GroupNorm(num_channels=c0, eps=1e-6)
        self.out_conv = Conv2d(in_channels=c0, out_channels=out_channels, kernel=3, **init_zero)

    def forward(self, x, noise_labels, class_labels, augment_labels=None):
        emb = self.map_noise(noise_labels)
        emb = emb.reshape(emb.shape[0], 2, -1).flip(1).reshape(*emb.shape)  # swap sin/cos
        emb = silu(self.map_layer0(emb))
        emb = silu(self.map_layer1(emb))
        skips = []
        for name, block in self.enc.items():
            x = block(x, emb) if isinstance(block, UNetBlock) else block(x)
            skips.append(x)
        for name, block in self.dec.items():
            if x.shape[1] != block.in_channels:
                x = torch.cat([x, skips.pop()], dim=1)
            x = block(x, emb)
        return self.out_conv(silu(self.out_norm(x)))


class EDMPrecond(torch.nn.Module):
    def __init__(self, img_resolution, img_channels, label_dim=0, use_fp16=False, sigma_min=0,
                 sigma_max=float('inf'), sigma_data=0.5, **model_kwargs):
        super().__init__()
        self.img_resolution, self.img_channels, self.label_dim = img_resolution, img_channels, label_dim
        self.use_fp16, self.sigma_min, self.sigma_max, self.sigma_data = use_fp16, sigma_min, sigma_max, sigma_data
        self.model = TinySongUNet(img_resolution=img_resolution, in_channels=img_channels, out_channels=img_channels,
                                  label_dim=label_dim, **model_kwargs)

    def forward(self, x, sigma, class_labels=None, force_fp32=False, **model_kwargs):
        x = x.to(torch.float32)
        sigma = sigma.to(torch.float32).reshape(-1, 1, 1, 1)
        class_labels = None if self.label_dim == 0 else torch.zeros([1, self.label_dim], device=x.device) \
            if class_labels is None else class_labels.to(torch.float32).reshape(-1, self.label_dim)
        dtype = torch.float16 if (self.use_fp16 and not force_fp32 and x.device.type == 'cuda') else torch.float32
        c_skip = self.sigma_data ** 2 / (sigma ** 2 + self.sigma_data ** 2)
        c_out = sigma * self.sigma_data / (sigma ** 2 + self.sigma_data ** 2).sqrt()
        c_in = 1 / (self.sigma_data ** 2 + sigma ** 2).sqrt()
        c_noise = sigma.log() / 4
        F_x = self.model((c_in * x).to(dtype), c_noise.flatten(), class_labels=class_labels, **model_kwargs)
        assert F_x.dtype == dtype
        D_x = c_skip * x + c_out * F_x.to(torch.float32)
        return D_x


# ---------------------------------------------------------------- training/loss.py (restated)

class EDMLoss:
    def __init__(self, P_mean=-1.2, P_std=1.2, sigma_data=0.5):
        self.P_mean, self.P_std, self.sigma_data = P_mean, P_std, sigma_data

    def __call__(self, net, images, labels=None, augment_pipe=None):
        rnd_normal = torch.randn([images.shape[0], 1, 1, 1], device=images.device)
        sigma = (rnd_normal * self.P_std + self.P_mean).exp()
        weight = (sigma ** 2 + self.sigma_data ** 2) / (sigma * self.sigma_data) ** 2
        y, augment_labels = augment_pipe(images) if augment_pipe is not None else (images, None)
        n = torch.randn_like(y) * sigma
        D_yn = net(y + n, sigma, labels, augment_labels=augment_labels)
        loss = weight * ((D_yn - y) ** 2)
        return loss


# ---------------------------------------------------------------- training/training_loop.py (restated)

def main(sg, steps=8, device="cpu", amp=None, batch_outside=False, tensor_dataset=False):
    own_group = not dist.is_initialized()
    if own_group:   # (torch_utils.distributed.init(); here one process)
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"file://{tempfile.mktemp(prefix='edm_pg_')}", world_size=1, rank=0)
    try:
        training_stats._counters.clear()
        training_loop(sg, steps, device=torch.device(device), batch_outside=batch_outside,
                      tensor_dataset=tensor_dataset)
    finally:
        if own_group:
            dist.destroy_process_group()


def training_loop(sg, steps, device, batch_outside=False, tensor_dataset=False,
                  batch_size=8,               # 512
                  batch_gpu=4,                # None
                  ema_halflife_kimg=500,
                  ema_rampup_ratio=0.05,
                  lr_rampup_kimg=0.032,       # 10000
                  loss_scaling=1,
                  kimg_per_tick=0.032,        # 50
                  seed=0):
    optimizer_kwargs = dict(lr=10e-4, betas=[0.9, 0.999], eps=1e-8)
    world_size, rank = dist.get_world_size(), dist.get_rank()

    # Select batch size per GPU.
    batch_gpu_total = batch_size // world_size
    if batch_gpu is None or batch_gpu > batch_gpu_total:
        batch_gpu = batch_gpu_total
    num_accumulation_rounds = batch_gpu_total // batch_gpu
    assert batch_size == batch_gpu * num_accumulation_rounds * world_size

    # Load dataset (synthetic uint8 8x8 RGB images, no labels).
    g = torch.Generator().manual_seed(1)
    images_u8 = torch.randint(0, 256, (64, 3, 8, 8), generator=g, dtype=torch.uint8)
    if tensor_dataset:   # (variant: the images held as tensors)
        dataset_obj = torch.utils.data.TensorDataset(images_u8, torch.zeros(64, 0))
    else:
        dataset_obj = Dataset(images_u8.numpy())
    dataset_sampler = misc.InfiniteSampler(dataset=dataset_obj, rank=rank, num_replicas=world_size, seed=seed)
    dataset_iterator = iter(torch.utils.data.DataLoader(dataset=dataset_obj, sampler=dataset_sampler, batch_size=batch_gpu))

    # Construct network.
    net = EDMPrecond(img_resolution=8, img_channels=3, label_dim=0, model_channels=16, dropout=0.13)
    net.train().requires_grad_(True).to(device)

    # Setup optimizer.
    loss_fn = EDMLoss()
    optimizer = torch.optim.Adam(params=net.parameters(), **optimizer_kwargs)
    augment_pipe = None
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device] if device.type == 'cuda' else None)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    sg.track(net=net, ema=ema, optimizer=optimizer)

    cur_nimg = 0
    cur_tick = 0
    tick_start_nimg = cur_nimg
    collector = training_stats.Collector()

    @sg.compile
    def training_step(batches=None):
        # Accumulate gradients.
        optimizer.zero_grad(set_to_none=True)
        for round_idx in range(num_accumulation_rounds):
            with misc.ddp_sync(ddp, (round_idx == num_accumulation_rounds - 1)):
                images, labels = next(dataset_iterator) if batches is None else batches[round_idx]
                images = images.to(device).to(torch.float32) / 127.5 - 1
                labels = labels.to(device)
                loss = loss_fn(net=ddp, images=images, labels=labels, augment_pipe=augment_pipe)
                training_stats.report('Loss/loss', loss)
                loss.sum().mul(loss_scaling / batch_gpu_total).backward()

        # Update weights.
        for g in optimizer.param_groups:
            g['lr'] = optimizer_kwargs['lr'] * min(cur_nimg / max(lr_rampup_kimg * 1000, 1e-8), 1)
        for param in net.parameters():
            if param.grad is not None:
                torch.nan_to_num(param.grad, nan=0, posinf=1e5, neginf=-1e5, out=param.grad)
        optimizer.step()

        # Update EMA.
        ema_halflife_nimg = ema_halflife_kimg * 1000
        if ema_rampup_ratio is not None:
            ema_halflife_nimg = min(ema_halflife_nimg, cur_nimg * ema_rampup_ratio)
        ema_beta = 0.5 ** (batch_size / max(ema_halflife_nimg, 1e-8))
        for p_ema, p_net in zip(ema.parameters(), net.parameters()):
            p_ema.copy_(p_net.detach().lerp(p_ema, ema_beta))

    for _ in range(steps):
        if batch_outside:   # (variant: the fix stepgraph would need to name)
            training_step([next(dataset_iterator) for _ in range(num_accumulation_rounds)])
        else:
            training_step()

        # Perform maintenance tasks once per tick.
        cur_nimg += batch_size
        if (cur_tick != 0) and (cur_nimg < tick_start_nimg + kimg_per_tick * 1000):
            continue

        # Print status line (the program's fields, the loss mean from training_stats).
        collector.update()
        fields = [f"tick {cur_tick:<5d}", f"kimg {cur_nimg / 1e3:<9.3f}",
                  f"loss {collector.mean('Loss/loss'):<9.4f}", f"std {collector.std('Loss/loss'):<9.4f}"]
        print(' '.join(fields))
        sg.log((cur_tick, cur_nimg, collector.mean('Loss/loss'), collector.std('Loss/loss'),
                optimizer.param_groups[0]['lr']))
        cur_tick += 1
        tick_start_nimg = cur_nimg
    sg.log({f"counter.{k}": v for k, d in training_stats._counters.items() for v in d.values()})
