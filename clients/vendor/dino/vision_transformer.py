# Restates what clients/dino.py uses of facebookresearch/dino's vision_transformer.py: the ViT
# (PatchEmbed, Attention, Mlp, Block with stochastic depth, VisionTransformer with its
# positional-embedding interpolation), the vit_tiny builder and DINOHead:
#   https://github.com/facebookresearch/dino/blob/7c446df5b9f45747937fb0d72314eb9f7b66930a/vision_transformer.py
# Copyright (c) Facebook, Inc. and its affiliates. Apache License 2.0 (see LICENSE beside this
# file); the source says it is mostly taken from timm's vision_transformer.py.
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. Changes from the source: only what the client uses is kept (vit_small,
# vit_base, get_last_selfattention, get_intermediate_layers and the attention-map return are
# left out). Kept as in the source, because the numbers and the traced step depend on it: the
# order in which modules and parameters are created and initialised (with the source's
# inverse-CDF trunc_normal_, utils.py), their names, the Dropout/DropPath modules (drop_path
# draws torch.rand per call) and every forward op in order.
import math
from functools import partial

import torch
import torch.nn as nn

from clients.vendor.dino.utils import trunc_normal_


def drop_path(x, drop_prob: float = 0., training: bool = False):
    """Stochastic depth: zero a sample's residual branch with probability ``drop_prob`` and scale
    the kept ones by 1 / (1 - drop_prob)."""
    if drop_prob == 0. or not training:
        return x
    keep = 1 - drop_prob
    per_sample = (x.shape[0],) + (1,) * (x.ndim - 1)
    mask = keep + torch.rand(per_sample, dtype=x.dtype, device=x.device)
    mask.floor_()   # 1 with probability keep, else 0
    return x.div(keep) * mask


class DropPath(nn.Module):
    def __init__(self, drop_prob=None):
        super(DropPath, self).__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class Mlp(nn.Module):
    """fc1, activation, dropout, fc2, dropout."""

    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features or in_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features or in_features, out_features or in_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        x = self.drop(self.act(self.fc1(x)))
        return self.drop(self.fc2(x))


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_scale=None, attn_drop=0., proj_drop=0.):
        super().__init__()
        self.num_heads = num_heads
        self.scale = qk_scale or (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        heads = self.num_heads
        # (B, N, 3C) -> (3, B, heads, N, C / heads)
        qkv = self.qkv(x).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        weights = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        weights = self.attn_drop(weights)
        out = (weights @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(out))


class Block(nn.Module):
    """Pre-norm transformer block: x + DropPath(attn(norm1(x))), then x + DropPath(mlp(norm2(x)))."""

    def __init__(self, dim, num_heads, mlp_ratio=4., qkv_bias=False, qk_scale=None, drop=0., attn_drop=0.,
                 drop_path=0., act_layer=nn.GELU, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_scale=qk_scale,
                              attn_drop=attn_drop, proj_drop=drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=drop)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    """Non-overlapping patch_size x patch_size patches, each projected to embed_dim by a conv."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768):
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)   # (B, patches, embed_dim)


class VisionTransformer(nn.Module):
    """ViT returning the final [CLS] token; the positional embedding, learnt for ``img_size[0]``,
    is resized bicubically for other input sizes (DINO's multi-crop)."""

    def __init__(self, img_size=[224], patch_size=16, in_chans=3, num_classes=0, embed_dim=768, depth=12,
                 num_heads=12, mlp_ratio=4., qkv_bias=False, qk_scale=None, drop_rate=0., attn_drop_rate=0.,
                 drop_path_rate=0., norm_layer=nn.LayerNorm, **kwargs):
        super().__init__()
        self.num_features = self.embed_dim = embed_dim
        self.patch_embed = PatchEmbed(img_size=img_size[0], patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(p=drop_rate)
        # stochastic depth grows linearly with the block index
        rates = [r.item() for r in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList(
            Block(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_scale=qk_scale,
                  drop=drop_rate, attn_drop=attn_drop_rate, drop_path=rate, norm_layer=norm_layer)
            for rate in rates)
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        trunc_normal_(self.pos_embed, std=.02)
        trunc_normal_(self.cls_token, std=.02)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.bias, 0)
            nn.init.constant_(m.weight, 1.0)

    def interpolate_pos_encoding(self, x, w, h):
        n_patches = x.shape[1] - 1
        N = self.pos_embed.shape[1] - 1
        if n_patches == N and w == h:
            return self.pos_embed
        cls_pos = self.pos_embed[:, 0]
        grid_pos = self.pos_embed[:, 1:]
        dim = x.shape[-1]
        side = math.sqrt(N)
        # +0.1: so that the scale factor lands the output size on the intended integer
        # (the source's fix for a floating point error, its issue #8)
        w0 = w // self.patch_embed.patch_size + 0.1
        h0 = h // self.patch_embed.patch_size + 0.1
        grid_pos = nn.functional.interpolate(
            grid_pos.reshape(1, int(side), int(side), dim).permute(0, 3, 1, 2),
            scale_factor=(w0 / side, h0 / side),
            mode='bicubic',
        )
        assert (int(w0), int(h0)) == tuple(grid_pos.shape[-2:])
        grid_pos = grid_pos.permute(0, 2, 3, 1).view(1, -1, dim)
        return torch.cat((cls_pos.unsqueeze(0), grid_pos), dim=1)

    def prepare_tokens(self, x):
        B, nc, w, h = x.shape
        tokens = self.patch_embed(x)
        tokens = torch.cat((self.cls_token.expand(B, -1, -1), tokens), dim=1)
        tokens = tokens + self.interpolate_pos_encoding(tokens, w, h)
        return self.pos_drop(tokens)

    def forward(self, x):
        x = self.prepare_tokens(x)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 0]


def vit_tiny(patch_size=16, **kwargs):
    """ViT-Tiny: width 192, 12 blocks of 3 heads, LayerNorm eps 1e-6, qkv bias."""
    return VisionTransformer(patch_size=patch_size, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4,
                             qkv_bias=True, norm_layer=partial(nn.LayerNorm, eps=1e-6), **kwargs)


class DINOHead(nn.Module):
    """Projection MLP to a bottleneck, L2 normalisation, then a weight-normalised linear layer to
    out_dim (its norm ``weight_g`` fixed at 1 when ``norm_last_layer``)."""

    def __init__(self, in_dim, out_dim, use_bn=False, norm_last_layer=True, nlayers=3, hidden_dim=2048,
                 bottleneck_dim=256):
        super().__init__()
        nlayers = max(nlayers, 1)
        if nlayers == 1:
            self.mlp = nn.Linear(in_dim, bottleneck_dim)
        else:
            layers = []
            for k in range(nlayers - 1):
                layers.append(nn.Linear(in_dim if k == 0 else hidden_dim, hidden_dim))
                if use_bn:
                    layers.append(nn.BatchNorm1d(hidden_dim))
                layers.append(nn.GELU())
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        self.apply(self._init_weights)   # (before last_layer exists: it keeps torch's default init)
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = nn.functional.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)
