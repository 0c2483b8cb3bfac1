"""mlfoundations/open_clip: contrastive image-text pre-training (CLIP). ``CLIP`` (model.py) holds a
``VisionTransformer`` (patch conv, class token, learnable positional embedding, ``ln_pre``, a
sequence-first ``Transformer`` of ``ResidualAttentionBlock``s built on ``nn.MultiheadAttention``,
``ln_post``, ``x @ proj``) and the unpacked pieces of a ``TextTransformer`` (token embedding, a
positional embedding parameter, the same ``Transformer`` under the additive causal mask buffer
``attn_mask`` (-inf above the diagonal, ``.to(q_x.dtype)`` at each block), ``ln_final``, EOT
pooling ``x[torch.arange(x.shape[0]), text.argmax(dim=-1)]`` (``text_global_pool``, 'argmax'), ``x @
text_projection``), both outputs ``F.normalize``d, and the temperature parameter ``logit_scale``
(init ``log(1/0.07)``; the forward returns ``self.logit_scale.exp()``; ``output_dict=True`` as
main.py builds it). ``ClipLoss`` (loss.py, single process: ``world_size=1``, ``cache_labels=True``
as ``create_loss`` makes it): ``logit_scale * image_features @ text_features.T`` both ways, labels
``torch.arange(num_logits)`` computed on the first call and then read back from its cache dict
``self.labels[device]`` while ``self.prev_num_logits`` is unchanged; the mean of the two
cross-entropies, returned as ``{"contrastive_loss": ...}``. AdamW (main.py) on two groups by the
``exclude`` lambda: ``p.ndim < 2 or "bn"/"ln"/"bias"/"logit_scale" in n`` -> weight_decay 0, the
rest ``args.wd``; betas (0.9, 0.98), eps 1e-6 (``get_default_params`` for a ViT).

Loop: training/train.py ``train_one_epoch`` (accum_freq 1). Per batch, in the loop as the program
has it: ``step = num_batches_per_epoch * epoch + i_accum`` and ``scheduler(step)`` -- the
``cosine_lr`` closure of scheduler.py (linear warmup ``base_lr * (step + 1) / warmup_length``,
then ``0.5 * (1 + np.cos(np.pi * e / es)) * base_lr``: a numpy float64) assigning
``param_group["lr"]`` of every group. The step function is the body from ``images.to(...)`` to the
clamp: ``optimizer.zero_grad()``, under ``autocast()`` the model, ``loss(**model_out,
output_dict=True)``, ``total_loss = sum(losses.values())``, ``backward(total_loss, scaler)``
(``scaler.scale(...).backward()`` when a GradScaler exists), ``optimizer.step()`` (or the
scaler's ``step``/``update``), then ``with torch.no_grad():
unwrap_model(model).logit_scale.clamp_(0, math.log(100))``. The logging block stays in the loop
after the step (the AverageMeters of ``val.item()`` per loss, ``logit_scale.item()``, the lr read,
the time meters). Precision: ``args.precision`` is "fp32" for the harness's fp32 run and
"amp_bf16" for ``amp="bf16"`` (``get_autocast`` -> bf16 autocast on the run's device; no
GradScaler, as main.py makes one only for "amp").

Source: https://github.com/mlfoundations/open_clip/blob/698f8cc7a9075b9019168ce0940a38cee604a871/src/training/train.py
(and src/open_clip/loss.py, model.py, transformer.py, src/training/scheduler.py, main.py,
precision.py, params.py at that commit -- the last with the src/training/ layout), MIT. Restated
after the source, not copied: same modules, names, init draws, ops and order; only the branches
this configuration takes (no CoCa, no cls_emb, no attentional pool, no patch dropout, no
distillation, no horovod, no grad checkpointing); ``get_autocast``'s ``torch.cuda.amp.autocast``
is ``torch.autocast(device_type)`` so the bf16 path runs on the CPU. Data: instead of
webdataset/CSV image-text pairs with the tokenizer, synthetic 16x16 images and token rows
``[sot, words..., eot, 0...]`` (eot the largest id, as the BPE tokenizer's). Scaled down: ViT-B/32
-> width 16, 1 layer, 2 heads, patch 8 on 16x16 images; text width 16, 1 layer, 2 heads, context
77 -> 8, vocab 49408 -> 32; embed_dim 512 -> 16; batch 4 (drop_last as the program's loaders), 4
batches an epoch, 2 epochs, warmup 10000 -> 2, log_every_n_steps 100 -> 2.
"""
import math
import time
from collections import OrderedDict
from contextlib import suppress
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SOURCE = ("https://github.com/mlfoundations/open_clip/blob/698f8cc7a9075b9019168ce0940a38cee604a871/"
          "src/training/train.py")
LICENSE = "MIT"
TAGS = ("contrastive", "clip", "vit", "text-transformer", "multihead-attention", "causal-mask", "argmax-pool",
        "label-cache", "logit-scale-exp", "clamp-param-in-step", "adamw", "param-groups", "numpy-schedule",
        "per-step-lr", "autocast", "item-after-step")


# ---------------------------------------------------------------- transformer.py (restated)

class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, its result cast back to the input's dtype."""

    def forward(self, x: torch.Tensor):
        orig_type = x.dtype
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.to(orig_type)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, mlp_ratio: float = 4.0, ls_init_value: float = None,
                 act_layer: Callable = nn.GELU, norm_layer: Callable = LayerNorm, batch_first: bool = True):
        super().__init__()
        self.ln_1 = norm_layer(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head, batch_first=batch_first)
        self.ls_1 = nn.Identity()   # (LayerScale only with ls_init_value)
        self.ln_2 = norm_layer(d_model)
        mlp_width = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(d_model, mlp_width)),
            ("gelu", act_layer()),
            ("c_proj", nn.Linear(mlp_width, d_model)),
        ]))
        self.ls_2 = nn.Identity()

    def attention(self, q_x, k_x=None, v_x=None, attn_mask=None):
        k_x = q_x if k_x is None else k_x
        v_x = q_x if v_x is None else v_x
        attn_mask = None if attn_mask is None else attn_mask.to(q_x.dtype)
        return self.attn(q_x, k_x, v_x, need_weights=False, attn_mask=attn_mask)[0]

    def forward(self, q_x, k_x=None, v_x=None, attn_mask=None):
        x = q_x + self.ls_1(self.attention(q_x=self.ln_1(q_x), k_x=None, v_x=None, attn_mask=attn_mask))
        x = x + self.ls_2(self.mlp(self.ln_2(x)))
        return x


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, mlp_ratio: float = 4.0, ls_init_value: float = None,
                 act_layer: Callable = nn.GELU, norm_layer: Callable = LayerNorm, batch_first: bool = False):
        super().__init__()
        self.width = width
        self.layers = layers
        self.batch_first = batch_first
        self.grad_checkpointing = False
        self.resblocks = nn.ModuleList([
            ResidualAttentionBlock(width, heads, mlp_ratio, ls_init_value=ls_init_value, act_layer=act_layer,
                                   norm_layer=norm_layer, batch_first=batch_first)
            for _ in range(layers)])

    def get_cast_dtype(self) -> torch.dtype:
        return self.resblocks[0].mlp.c_fc.weight.dtype

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None):
        if not self.batch_first:
            x = x.transpose(0, 1).contiguous()   # NLD -> LND
        for r in self.resblocks:
            x = r(x, attn_mask=attn_mask)
        if not self.batch_first:
            x = x.transpose(0, 1)   # LND -> NLD
        return x


def _expand_token(token, batch_size: int):
    return token.view(1, 1, -1).expand(batch_size, -1, -1)


class VisionTransformer(nn.Module):
    def __init__(self, image_size: int, patch_size: int, width: int, layers: int, heads: int, mlp_ratio: float,
                 output_dim: int = 512, pool_type: str = 'tok', act_layer: Callable = nn.GELU,
                 norm_layer: Callable = LayerNorm):
        super().__init__()
        self.image_size = (image_size, image_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (image_size // patch_size, image_size // patch_size)
        self.final_ln_after_pool = False
        self.output_dim = output_dim
        self.conv1 = nn.Conv2d(in_channels=3, out_channels=width, kernel_size=patch_size, stride=patch_size,
                               bias=False)
        scale = width ** -0.5
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn(self.grid_size[0] * self.grid_size[1] + 1, width))
        self.patch_dropout = nn.Identity()
        self.ln_pre = norm_layer(width)
        self.transformer = Transformer(width, layers, heads, mlp_ratio, act_layer=act_layer, norm_layer=norm_layer)
        self.attn_pool = None
        self.pool_type = pool_type
        self.ln_post = norm_layer(width)
        self.proj = nn.Parameter(scale * torch.randn(width, output_dim))
        self.output_tokens = False

    def _global_pool(self, x):
        if self.pool_type == 'avg':
            return x[:, 1:].mean(dim=1), x[:, 1:]
        if self.pool_type == 'tok':
            return x[:, 0], x[:, 1:]
        return x, x

    def forward(self, x: torch.Tensor):
        x = self.conv1(x)   # [*, width, grid, grid]
        x = x.reshape(x.shape[0], x.shape[1], -1)
        x = x.permute(0, 2, 1)   # [*, grid ** 2, width]
        x = torch.cat([_expand_token(self.class_embedding, x.shape[0]).to(x.dtype), x], dim=1)
        x = x + self.positional_embedding.to(x.dtype)
        x = self.patch_dropout(x)
        x = self.ln_pre(x)
        x = self.transformer(x)
        x = self.ln_post(x)
        pooled, tokens = self._global_pool(x)
        if self.proj is not None:
            pooled = pooled @ self.proj
        return pooled


def text_global_pool(x, text: Optional[torch.Tensor] = None, pool_type: str = 'argmax'):
    if pool_type == 'first':
        pooled, tokens = x[:, 0], x[:, 1:]
    elif pool_type == 'last':
        pooled, tokens = x[:, -1], x[:, :-1]
    elif pool_type == 'argmax':
        # the eot token has the largest id of its row
        assert text is not None
        pooled, tokens = x[torch.arange(x.shape[0]), text.argmax(dim=-1)], x
    else:
        pooled = tokens = x
    return pooled, tokens


class TextTransformer(nn.Module):
    def __init__(self, context_length: int = 77, vocab_size: int = 49408, width: int = 512, heads: int = 8,
                 layers: int = 12, mlp_ratio: float = 4.0, output_dim: int = 512, pool_type: str = 'argmax',
                 act_layer: Callable = nn.GELU, norm_layer: Callable = LayerNorm):
        super().__init__()
        self.num_pos = self.context_length = context_length
        self.vocab_size = vocab_size
        self.width = width
        self.output_dim = output_dim
        self.heads = heads
        self.pool_type = pool_type
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.cls_emb = None
        self.positional_embedding = nn.Parameter(torch.empty(self.num_pos, width))
        self.transformer = Transformer(width=width, layers=layers, heads=heads, mlp_ratio=mlp_ratio,
                                       act_layer=act_layer, norm_layer=norm_layer)
        self.ln_final = norm_layer(width)
        self.register_buffer('attn_mask', self.build_causal_mask(), persistent=False)
        self.text_projection = nn.Parameter(torch.empty(width, output_dim))
        self.init_parameters()

    def init_parameters(self):
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        proj_std = (self.transformer.width ** -0.5) * ((2 * self.transformer.layers) ** -0.5)
        attn_std = self.transformer.width ** -0.5
        fc_std = (2 * self.transformer.width) ** -0.5
        for block in self.transformer.resblocks:
            nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
            nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
            nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        nn.init.normal_(self.text_projection, std=self.transformer.width ** -0.5)

    def build_causal_mask(self):
        # additive mask: -inf strictly above the diagonal, 0 elsewhere
        mask = torch.empty(self.num_pos, self.num_pos)
        mask.fill_(float("-inf"))
        mask.triu_(1)
        return mask


# ---------------------------------------------------------------- model.py (restated)

class CLIPVisionCfg:
    layers = 1; width = 16; head_width = 8; mlp_ratio = 4.0; patch_size = 8; image_size = 16; pool_type = 'tok'


class CLIPTextCfg:
    context_length = 8; vocab_size = 32; width = 16; heads = 2; layers = 1; mlp_ratio = 4.0; pool_type = 'argmax'


def _build_vision_tower(embed_dim, vision_cfg, quick_gelu=False, cast_dtype=None):
    act_layer = nn.GELU
    vision_heads = vision_cfg.width // vision_cfg.head_width
    norm_layer = LayerNorm   # (LayerNormFp32 only for pure fp16/bf16 weights)
    return VisionTransformer(image_size=vision_cfg.image_size, patch_size=vision_cfg.patch_size,
                             width=vision_cfg.width, layers=vision_cfg.layers, heads=vision_heads,
                             mlp_ratio=vision_cfg.mlp_ratio, pool_type=vision_cfg.pool_type, output_dim=embed_dim,
                             act_layer=act_layer, norm_layer=norm_layer)


def _build_text_tower(embed_dim, text_cfg, quick_gelu=False, cast_dtype=None):
    return TextTransformer(context_length=text_cfg.context_length, vocab_size=text_cfg.vocab_size,
                           width=text_cfg.width, heads=text_cfg.heads, layers=text_cfg.layers,
                           mlp_ratio=text_cfg.mlp_ratio, output_dim=embed_dim, pool_type=text_cfg.pool_type,
                           act_layer=nn.GELU, norm_layer=LayerNorm)


class CLIP(nn.Module):
    def __init__(self, embed_dim, vision_cfg, text_cfg, quick_gelu=False, init_logit_scale=np.log(1 / 0.07),
                 init_logit_bias=None, cast_dtype=None, output_dict=False):
        super().__init__()
        self.output_dict = output_dict
        self.visual = _build_vision_tower(embed_dim, vision_cfg, quick_gelu, cast_dtype)
        text = _build_text_tower(embed_dim, text_cfg, quick_gelu, cast_dtype)
        self.transformer = text.transformer
        self.context_length = text.context_length
        self.vocab_size = text.vocab_size
        self.token_embedding = text.token_embedding
        self.positional_embedding = text.positional_embedding
        self.ln_final = text.ln_final
        self.text_projection = text.text_projection
        self.text_pool_type = text.pool_type
        self.register_buffer('attn_mask', text.attn_mask, persistent=False)
        self.logit_scale = nn.Parameter(torch.ones([]) * init_logit_scale)
        self.logit_bias = None

    def encode_image(self, image, normalize: bool = False):
        features = self.visual(image)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text, normalize: bool = False):
        cast_dtype = self.transformer.get_cast_dtype()
        x = self.token_embedding(text).to(cast_dtype)   # [batch_size, n_ctx, d_model]
        x = x + self.positional_embedding.to(cast_dtype)
        x = self.transformer(x, attn_mask=self.attn_mask)
        x = self.ln_final(x)
        x, _ = text_global_pool(x, text, self.text_pool_type)
        if self.text_projection is not None:
            x = x @ self.text_projection
        return F.normalize(x, dim=-1) if normalize else x

    def forward(self, image=None, text=None):
        image_features = self.encode_image(image, normalize=True) if image is not None else None
        text_features = self.encode_text(text, normalize=True) if text is not None else None
        if self.output_dict:
            return {"image_features": image_features, "text_features": text_features,
                    "logit_scale": self.logit_scale.exp()}
        return image_features, text_features, self.logit_scale.exp()


# ---------------------------------------------------------------- loss.py (restated)

class ClipLoss(nn.Module):
    def __init__(self, local_loss=False, gather_with_grad=False, cache_labels=False, rank=0, world_size=1,
                 use_horovod=False):
        super().__init__()
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.cache_labels = cache_labels
        self.rank = rank
        self.world_size = world_size
        self.use_horovod = use_horovod
        # cache state
        self.prev_num_logits = 0
        self.labels = {}

    def get_ground_truth(self, device, num_logits) -> torch.Tensor:
        if self.prev_num_logits != num_logits or device not in self.labels:
            labels = torch.arange(num_logits, device=device, dtype=torch.long)
            if self.world_size > 1 and self.local_loss:
                labels = labels + num_logits * self.rank
            if self.cache_labels:
                self.labels[device] = labels
                self.prev_num_logits = num_logits
        else:
            labels = self.labels[device]
        return labels

    def get_logits(self, image_features, text_features, logit_scale):
        # (world_size 1: no feature gather)
        logits_per_image = logit_scale * image_features @ text_features.T
        logits_per_text = logit_scale * text_features @ image_features.T
        return logits_per_image, logits_per_text

    def forward(self, image_features, text_features, logit_scale, output_dict=False):
        device = image_features.device
        logits_per_image, logits_per_text = self.get_logits(image_features, text_features, logit_scale)
        labels = self.get_ground_truth(device, logits_per_image.shape[0])
        total_loss = (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2
        return {"contrastive_loss": total_loss} if output_dict else total_loss


# ---------------------------------------------------------------- scheduler.py (restated)

def assign_learning_rate(optimizer, new_lr):
    for param_group in optimizer.param_groups:
        param_group["lr"] = new_lr


def _warmup_lr(base_lr, warmup_length, step):
    return base_lr * (step + 1) / warmup_length


def cosine_lr(optimizer, base_lr, warmup_length, steps):
    def _lr_adjuster(step):
        if step < warmup_length:
            lr = _warmup_lr(base_lr, warmup_length, step)
        else:
            e = step - warmup_length
            es = steps - warmup_length
            lr = 0.5 * (1 + np.cos(np.pi * e / es)) * base_lr
        assign_learning_rate(optimizer, lr)
        return lr
    return _lr_adjuster


# ---------------------------------------------------------------- train.py / precision.py (restated)

class AverageMeter(object):
    """Computes and stores the average and current value"""

    def __init__(self):
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


def unwrap_model(model):
    if hasattr(model, 'module'):
        return model.module
    return model


def backward(total_loss, scaler):
    if scaler is not None:
        scaler.scale(total_loss).backward()
    else:
        total_loss.backward()


def get_autocast(precision, device_type):
    if precision == 'amp':
        return lambda: torch.autocast(device_type)
    elif precision == 'amp_bfloat16' or precision == 'amp_bf16':
        # amp_bfloat16 is more stable than amp float16 for clip training
        return lambda: torch.autocast(device_type, dtype=torch.bfloat16)
    else:
        return suppress


class args:  # params.py defaults (ViT: get_default_params), scaled down
    lr = 5.0e-4; beta1 = 0.9; beta2 = 0.98; eps = 1.0e-6; wd = 0.2; warmup = 2; epochs = 2; batch_size = 4
    accum_freq = 1; grad_clip_norm = None; lr_scheduler = "cosine"; skip_scheduler = False; precision = "fp32"
    log_every_n_steps = 2; horovod = False; distill = False; world_size = 1; rank = 0; local_loss = False
    gather_with_grad = False; embed_dim = 16; device = "cpu"


num_batches = 4   # batches an epoch (drop_last)


def _texts(g, n):
    """Token rows as the tokenizer makes them: sot, words, eot (the largest id), zero padding."""
    sot, eot = CLIPTextCfg.vocab_size - 2, CLIPTextCfg.vocab_size - 1
    rows = torch.zeros(n, CLIPTextCfg.context_length, dtype=torch.long)
    for r in range(n):
        k = int(torch.randint(1, CLIPTextCfg.context_length - 1, (1,), generator=g))
        rows[r, 0] = sot
        rows[r, 1:k] = torch.randint(1, sot, (k - 1,), generator=g)
        rows[r, k] = eot
    return rows


def main(sg, steps=8, device="cpu", amp=None):
    args.device = device
    args.precision = "amp_bf16" if amp == "bf16" else "fp32"
    device = torch.device(args.device)

    model = CLIP(args.embed_dim, CLIPVisionCfg, CLIPTextCfg, output_dict=True)
    model.to(device=device)

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or 'logit_scale' in n  # noqa: E731
    include = lambda n, p: not exclude(n, p)  # noqa: E731
    named_parameters = list(model.named_parameters())
    gain_or_bias_params = [p for n, p in named_parameters if exclude(n, p) and p.requires_grad]
    rest_params = [p for n, p in named_parameters if include(n, p) and p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": gain_or_bias_params, "weight_decay": 0.},
            {"params": rest_params, "weight_decay": args.wd},
        ],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
    )
    scaler = torch.amp.GradScaler(device.type) if args.precision == "amp" else None

    g = torch.Generator().manual_seed(1)
    n_epochs = min(args.epochs, -(-steps // num_batches))
    data = [[(torch.randn(args.batch_size, 3, CLIPVisionCfg.image_size, CLIPVisionCfg.image_size, generator=g),
              _texts(g, args.batch_size)) for _ in range(min(num_batches, steps - e * num_batches))]
            for e in range(n_epochs)]

    total_steps = (num_batches // args.accum_freq) * args.epochs
    scheduler = cosine_lr(optimizer, args.lr, args.warmup, total_steps)
    loss = ClipLoss(local_loss=args.local_loss, gather_with_grad=args.gather_with_grad, cache_labels=True,
                    rank=args.rank, world_size=args.world_size, use_horovod=args.horovod)
    sg.track(model=model, optimizer=optimizer)

    autocast = get_autocast(args.precision, device.type)
    input_dtype = None

    @sg.compile
    def train_batch(images, texts):
        images = images.to(device=device, dtype=input_dtype, non_blocking=True)
        texts = texts.to(device=device, non_blocking=True)
        optimizer.zero_grad()

        with autocast():
            model_out = model(images, texts)
            logit_scale = model_out["logit_scale"]
            losses = loss(**model_out, output_dict=True)
            total_loss = sum(losses.values())
            losses["loss"] = total_loss

        backward(total_loss, scaler)

        if scaler is not None:
            if args.grad_clip_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_norm, norm_type=2.0)
            scaler.step(optimizer)
            scaler.update()
        else:
            if args.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_norm, norm_type=2.0)
            optimizer.step()

        # Note: we clamp to 4.6052 = ln(100), as in the original paper.
        with torch.no_grad():
            unwrap_model(model).logit_scale.clamp_(0, math.log(100))
        return losses, logit_scale

    def train_one_epoch(epoch, dataloader):
        model.train()
        num_batches_per_epoch = num_batches // args.accum_freq
        losses_m = {}
        batch_time_m = AverageMeter()
        data_time_m = AverageMeter()
        end = time.time()
        for i, batch in enumerate(dataloader):
            i_accum = i // args.accum_freq
            step = num_batches_per_epoch * epoch + i_accum
            if not args.skip_scheduler:
                scheduler(step)
            images, texts = batch
            data_time_m.update(time.time() - end)

            losses, logit_scale = train_batch(images, texts)
            sg.log((losses, logit_scale))

            batch_time_m.update(time.time() - end)
            end = time.time()
            batch_count = i_accum + 1
            if i_accum % args.log_every_n_steps == 0 or batch_count == num_batches_per_epoch:
                batch_size = len(images)
                for key, val in losses.items():
                    if key not in losses_m:
                        losses_m[key] = AverageMeter()
                    losses_m[key].update(val.item(), batch_size)
                logit_scale_scalar = logit_scale.item()
                loss_log = " ".join(f"{name.capitalize()}: {m.val:#.5g} ({m.avg:#.5g})" for name, m in losses_m.items())
                _ = (f"Train Epoch: {epoch} LR: {optimizer.param_groups[0]['lr']:5f} "
                     f"Logit Scale: {logit_scale_scalar:.3f} " + loss_log)
                batch_time_m.reset()
                data_time_m.reset()

    for epoch in range(n_epochs):
        train_one_epoch(epoch, data[epoch])
