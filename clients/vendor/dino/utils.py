# Restates the helpers clients/dino.py uses from facebookresearch/dino's utils.py:
# clip_gradients, cancel_gradients_last_layer, cosine_scheduler, get_world_size (with
# is_dist_avail_and_initialized), trunc_normal_, MultiCropWrapper and get_params_groups:
#   https://github.com/facebookresearch/dino/blob/7c446df5b9f45747937fb0d72314eb9f7b66930a/utils.py
# Copyright (c) Facebook, Inc. and its affiliates. Apache License 2.0 (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. Kept as in the source because the corpus exercises it: clip_gradients
# reads each gradient norm on the host (``.item()``) and branches on ``clip_coef < 1``;
# cancel_gradients_last_layer sets grads to None; MultiCropWrapper groups the crops by size on
# the host (``torch.unique_consecutive`` counts, a tensor cumsum used as list slice bounds); the
# schedules are numpy arrays, indexed per iteration; trunc_normal_ is the inverse-CDF sampler of
# the source (PyTorch's own trunc_normal_ has since become a rejection sampler: other draws).
import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


def clip_gradients(model, clip):
    """Clip each parameter's gradient to norm ``clip`` on its own; return the norms as floats."""
    norms = []
    for _, p in model.named_parameters():
        if p.grad is None:
            continue
        norm = p.grad.data.norm(2)
        norms.append(norm.item())
        coef = clip / (norm + 1e-6)
        if coef < 1:
            p.grad.data.mul_(coef)
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    """During the first ``freeze_last_layer`` epochs the head's last layer does not move."""
    if epoch < freeze_last_layer:
        for name, p in model.named_parameters():
            if "last_layer" in name:
                p.grad = None


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    """One value per iteration: a linear warm-up from ``start_warmup_value``, then a half cosine
    from ``base_value`` down (or up) to ``final_value``."""
    n_warm = warmup_epochs * niter_per_ep
    warm = np.linspace(start_warmup_value, base_value, n_warm) if warmup_epochs > 0 else np.array([])
    t = np.arange(epochs * niter_per_ep - n_warm)
    cosine = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * t / len(t)))
    schedule = np.concatenate((warm, cosine))
    assert len(schedule) == epochs * niter_per_ep
    return schedule


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def trunc_normal_(tensor, mean=0., std=1., a=-2., b=2.):
    """Fill ``tensor`` in place with N(mean, std^2) truncated to [a, b], by inverse transform:
    u uniform on [2 Phi(alpha) - 1, 2 Phi(beta) - 1], x = mean + std * sqrt(2) * erfinv(u)."""
    def phi(z):   # standard normal CDF
        return (1. + math.erf(z / math.sqrt(2.))) / 2.

    with torch.no_grad():
        lo, hi = phi((a - mean) / std), phi((b - mean) / std)
        tensor.uniform_(2 * lo - 1, 2 * hi - 1)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.))
        tensor.add_(mean)
        tensor.clamp_(min=a, max=b)   # (rounding can step just outside)
        return tensor


class MultiCropWrapper(nn.Module):
    """Runs the backbone once per run of consecutive same-size crops (the 2 global crops, then the
    local ones), concatenates the features and applies the head to all of them at once."""

    def __init__(self, backbone, head):
        super(MultiCropWrapper, self).__init__()
        # no classification layer: the backbone yields features
        backbone.fc, backbone.head = nn.Identity(), nn.Identity()
        self.backbone = backbone
        self.head = head

    def forward(self, x):
        if not isinstance(x, list):
            x = [x]
        sizes = torch.tensor([crop.shape[-1] for crop in x])
        ends = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start, feats = 0, torch.empty(0).to(x[0].device)
        for end in ends:
            out = self.backbone(torch.cat(x[start: end]))
            if isinstance(out, tuple):   # (backbones returning a tuple: the features come first)
                out = out[0]
            feats = torch.cat((feats, out))
            start = end
        return self.head(feats)


def get_params_groups(model):
    """Two AdamW groups: weights decayed, biases and 1-d (norm) parameters with weight_decay 0."""
    decayed, not_decayed = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(".bias") or len(param.shape) == 1:
            not_decayed.append(param)
        else:
            decayed.append(param)
    return [{'params': decayed}, {'params': not_decayed, 'weight_decay': 0.}]
