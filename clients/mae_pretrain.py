"""facebookresearch/mae: masked-autoencoder pre-training of a ViT. ``MaskedAutoencoderViT``
(models_mae.py): ``PatchEmbed`` (a patch conv, ``flatten(2).transpose(1, 2)``), fixed 2-D sin-cos
``pos_embed`` / ``decoder_pos_embed`` parameters (``requires_grad=False``, from numpy), a class token;
``random_masking`` per sample -- ``noise = torch.rand(N, L)``, ``ids_shuffle = torch.argsort(noise)``,
``ids_restore = torch.argsort(ids_shuffle)``, the kept tokens by ``torch.gather``, the binary mask
made by ``mask[:, :len_keep] = 0`` and unshuffled by ``gather``; timm ``Block``s (qkv Linear, manual
softmax attention, GELU Mlp, pre-norm LayerNorm eps 1e-6) for the encoder; the decoder embeds,
appends ``mask_token.repeat(...)``, unshuffles with ``gather`` on ``ids_restore``, adds its
positions, runs its blocks, ``decoder_pred``, drops the class token; ``forward_loss`` with
``norm_pix_loss`` (``patchify`` by ``einsum('nchpwq->nhwpqc')``, per-patch mean and ``var``,
``(target - mean) / (var + 1.e-6)**.5``, the squared error averaged per patch and over the removed
patches: ``(loss * mask).sum() / mask.sum()``). Init as ``initialize_weights``: xavier_uniform on
the patch conv viewed as a matrix and on every Linear, normal(0.02) on the tokens, LayerNorm 1/0.
AdamW on ``optim_factory.add_weight_decay(model, weight_decay)`` (timm 0.3.2: 1-d parameters and
biases without weight decay, frozen ones left out), betas (0.9, 0.95), ``lr = blr * eff_batch_size
/ 256``; ``NativeScalerWithGradNormCount`` (util/misc.py).

Loop: engine_pretrain.py ``train_one_epoch``; its per-batch body is the step function (the
batch, ``data_iter_step`` and ``epoch`` passed in): ``if data_iter_step % accum_iter == 0:
lr_sched.adjust_learning_rate(optimizer, data_iter_step / len(data_loader) + epoch, args)``
(util/lr_sched.py: linear warmup, then half-cycle cosine to ``min_lr``, ``param_group["lr"] = lr``
per group, ``* lr_scale`` where a group has one), ``samples.to(device)``, the model under
autocast, ``loss_value = loss.item()`` and ``if not math.isfinite(loss_value): sys.exit(1)``,
``loss /= accum_iter``, ``loss_scaler(loss, optimizer, parameters=model.parameters(),
update_grad=(data_iter_step + 1) % accum_iter == 0)`` (``scale(loss).backward()``; on update
``unscale_``, ``get_grad_norm_`` = norm of the stacked per-parameter grad norms, ``step``,
``update``), ``optimizer.zero_grad()`` after an update. ``torch.cuda.synchronize()`` dropped (CPU);
the MetricLogger updates (``loss=loss_value``, the lr read) stay in the loop after the step, on the
``loss_value`` it returns. ``optimizer.zero_grad()`` before the epoch as the program does.

Source: https://github.com/facebookresearch/mae/blob/efb2a8062c206524e35e47d04501ed4f544c0ae8/engine_pretrain.py
(and models_mae.py, main_pretrain.py, util/lr_sched.py, util/misc.py, util/pos_embed.py at that
commit; timm 0.3.2's ``Block``/``Attention``/``Mlp``/``PatchEmbed``/``add_weight_decay``, which
MAE pins), CC-BY-NC-4.0. Restated after the source, not copied: same modules, names, init draws,
ops and order. Deviations: ``np.float`` (gone from numpy) is ``np.float64``; ``torch._six.inf``
is ``math.inf``; the program's ``torch.cuda.amp.autocast()`` (fp16 on CUDA, always on) is
``torch.autocast(device_type)`` enabled only where the harness asks for bf16, and its
``torch.cuda.amp.GradScaler()`` is ``torch.amp.GradScaler(device_type, enabled=False)`` (fp32: the
scaler's calls pass through, as they do for a bf16 run). Data: instead of ImageNet with
RandomResizedCrop, 16 synthetic 16x16 images (RandomSampler, drop_last, as main_pretrain.py's loader). Scaled down (PRETRAIN.md's recipe: ``--norm_pix_loss
--mask_ratio 0.75 --blr 1.5e-4 --weight_decay 0.05``): mae_vit_large_patch16 -> patch 4 on 16x16
images (16 patches, 4 kept), embed_dim 16, depth 1, 2 heads, decoder 16 wide, depth 1, 2 heads;
batch 64 -> 4, ``accum_iter`` 1 -> 2 (so the accumulation path runs), 4 batches an epoch, epochs
800 -> 2, warmup_epochs 40 -> 1.
"""
import math
import sys
from functools import partial

import numpy as np
import torch
import torch.nn as nn

SOURCE = ("https://github.com/facebookresearch/mae/blob/efb2a8062c206524e35e47d04501ed4f544c0ae8/"
          "engine_pretrain.py")
LICENSE = "CC-BY-NC-4.0"
TAGS = ("self-supervised", "masked-autoencoder", "vit", "rand-in-step", "argsort", "gather", "norm-pix-loss",
        "grad-accumulation", "grad-scaler-disabled", "grad-norm", "lr-computed-in-step", "per-step-lr",
        "item-in-step", "isfinite-check", "adamw", "param-groups", "numpy-init")


# ---------------------------------------------------------------- util/pos_embed.py (restated)

def get_2d_sincos_pos_embed(embed_dim, grid_size, cls_token=False):
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)  # w goes first
    grid = np.stack(grid, axis=0)
    grid = grid.reshape([2, 1, grid_size, grid_size])
    pos_embed = get_2d_sincos_pos_embed_from_grid(embed_dim, grid)
    if cls_token:
        pos_embed = np.concatenate([np.zeros([1, embed_dim]), pos_embed], axis=0)
    return pos_embed


def get_2d_sincos_pos_embed_from_grid(embed_dim, grid):
    assert embed_dim % 2 == 0
    emb_h = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0])  # half the dims for h
    emb_w = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1])  # half for w
    return np.concatenate([emb_h, emb_w], axis=1)


def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):
    assert embed_dim % 2 == 0
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.
    omega = 1. / 10000 ** omega
    pos = pos.reshape(-1)
    out = np.einsum('m,d->md', pos, omega)   # outer product
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


# ---------------------------------------------------------------- timm 0.3.2 layers (restated)

def to_2tuple(x):
    return x if isinstance(x, tuple) else (x, x)


class PatchEmbed(nn.Module):
    """Image to patch embedding"""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768):
        super().__init__()
        img_size = to_2tuple(img_size)
        patch_size = to_2tuple(patch_size)
        self.img_size = img_size
        self.patch_size = patch_size
        self.num_patches = (img_size[1] // patch_size[1]) * (img_size[0] // patch_size[0])
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        B, C, H, W = x.shape
        assert H == self.img_size[0] and W == self.img_size[1], "input size does not match the model's"
        return self.proj(x).flatten(2).transpose(1, 2)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        x = self.drop(self.act(self.fc1(x)))
        return self.drop(self.fc2(x))


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_scale=None, attn_drop=0., proj_drop=0.):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4., qkv_bias=False, qk_scale=None, drop=0., attn_drop=0.,
                 drop_path=0., act_layer=nn.GELU, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_scale=qk_scale,
                              attn_drop=attn_drop, proj_drop=drop)
        self.drop_path = nn.Identity()   # (DropPath only for drop_path > 0)
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=drop)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


def add_weight_decay(model, weight_decay=1e-5, skip_list=()):
    """timm 0.3.2 optim_factory: no weight decay for 1-d parameters and biases."""
    decay = []
    no_decay = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue  # frozen weights
        if len(param.shape) == 1 or name.endswith(".bias") or name in skip_list:
            no_decay.append(param)
        else:
            decay.append(param)
    return [{'params': no_decay, 'weight_decay': 0.}, {'params': decay, 'weight_decay': weight_decay}]


# ---------------------------------------------------------------- models_mae.py (restated)

class MaskedAutoencoderViT(nn.Module):
    """Masked Autoencoder with VisionTransformer backbone"""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=1024, depth=24, num_heads=16,
                 decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, mlp_ratio=4.,
                 norm_layer=nn.LayerNorm, norm_pix_loss=False):
        super().__init__()
        # encoder
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim), requires_grad=False)
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, qk_scale=None, norm_layer=norm_layer)
            for i in range(depth)])
        self.norm = norm_layer(embed_dim)
        # decoder
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, decoder_embed_dim),
                                              requires_grad=False)
        self.decoder_blocks = nn.ModuleList([
            Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True, qk_scale=None,
                  norm_layer=norm_layer)
            for i in range(decoder_depth)])
        self.decoder_norm = norm_layer(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size ** 2 * in_chans, bias=True)

        self.norm_pix_loss = norm_pix_loss
        self.initialize_weights()

    def initialize_weights(self):
        # fixed sin-cos position embeddings
        pos_embed = get_2d_sincos_pos_embed(self.pos_embed.shape[-1], int(self.patch_embed.num_patches ** .5),
                                            cls_token=True)
        self.pos_embed.data.copy_(torch.from_numpy(pos_embed).float().unsqueeze(0))
        decoder_pos_embed = get_2d_sincos_pos_embed(self.decoder_pos_embed.shape[-1],
                                                    int(self.patch_embed.num_patches ** .5), cls_token=True)
        self.decoder_pos_embed.data.copy_(torch.from_numpy(decoder_pos_embed).float().unsqueeze(0))
        # the patch conv initialised as a Linear
        w = self.patch_embed.proj.weight.data
        torch.nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        torch.nn.init.normal_(self.cls_token, std=.02)
        torch.nn.init.normal_(self.mask_token, std=.02)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.bias, 0)
            nn.init.constant_(m.weight, 1.0)

    def patchify(self, imgs):
        """(N, 3, H, W) -> (N, L, patch_size**2 * 3)"""
        p = self.patch_embed.patch_size[0]
        assert imgs.shape[2] == imgs.shape[3] and imgs.shape[2] % p == 0
        h = w = imgs.shape[2] // p
        x = imgs.reshape(shape=(imgs.shape[0], 3, h, p, w, p))
        x = torch.einsum('nchpwq->nhwpqc', x)
        return x.reshape(shape=(imgs.shape[0], h * w, p ** 2 * 3))

    def random_masking(self, x, mask_ratio):
        """Per-sample random masking: shuffle each sample by argsort of uniform noise."""
        N, L, D = x.shape
        len_keep = int(L * (1 - mask_ratio))
        noise = torch.rand(N, L, device=x.device)  # in [0, 1]
        ids_shuffle = torch.argsort(noise, dim=1)  # small is keep, large is remove
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, D))
        # binary mask, 0 keep / 1 remove, in the original order
        mask = torch.ones([N, L], device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, dim=1, index=ids_restore)
        return x_masked, mask, ids_restore

    def forward_encoder(self, x, mask_ratio):
        x = self.patch_embed(x)
        x = x + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, mask_ratio)
        cls_token = self.cls_token + self.pos_embed[:, :1, :]
        cls_tokens = cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return x, mask, ids_restore

    def forward_decoder(self, x, ids_restore):
        x = self.decoder_embed(x)
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)  # without the cls token
        x_ = torch.gather(x_, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))  # unshuffle
        x = torch.cat([x[:, :1, :], x_], dim=1)  # cls token back in front
        x = x + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        x = self.decoder_norm(x)
        x = self.decoder_pred(x)
        return x[:, 1:, :]

    def forward_loss(self, imgs, pred, mask):
        target = self.patchify(imgs)
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.e-6) ** .5
        loss = (pred - target) ** 2
        loss = loss.mean(dim=-1)  # per patch
        loss = (loss * mask).sum() / mask.sum()  # over the removed patches
        return loss

    def forward(self, imgs, mask_ratio=0.75):
        latent, mask, ids_restore = self.forward_encoder(imgs, mask_ratio)
        pred = self.forward_decoder(latent, ids_restore)
        loss = self.forward_loss(imgs, pred, mask)
        return loss, pred, mask


def mae_vit_tiny_patch4(**kwargs):   # (mae_vit_large_patch16_dec512d8b, scaled down)
    return MaskedAutoencoderViT(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                                decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, mlp_ratio=4,
                                norm_layer=partial(nn.LayerNorm, eps=1e-6), **kwargs)


# ---------------------------------------------------------------- util/lr_sched.py, util/misc.py (restated)

class lr_sched:
    @staticmethod
    def adjust_learning_rate(optimizer, epoch, args):
        """Half-cycle cosine after a linear warmup."""
        if epoch < args.warmup_epochs:
            lr = args.lr * epoch / args.warmup_epochs
        else:
            lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * \
                (1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
        for param_group in optimizer.param_groups:
            if "lr_scale" in param_group:
                param_group["lr"] = lr * param_group["lr_scale"]
            else:
                param_group["lr"] = lr
        return lr


def get_grad_norm_(parameters, norm_type: float = 2.0) -> torch.Tensor:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if len(parameters) == 0:
        return torch.tensor(0.)
    device = parameters[0].grad.device
    if norm_type == math.inf:
        total_norm = max(p.grad.detach().abs().max().to(device) for p in parameters)
    else:
        total_norm = torch.norm(torch.stack([torch.norm(p.grad.detach(), norm_type).to(device)
                                             for p in parameters]), norm_type)
    return total_norm


class NativeScalerWithGradNormCount:
    state_dict_key = "amp_scaler"

    def __init__(self, device_type="cuda"):
        self._scaler = torch.amp.GradScaler(device_type, enabled=False)   # (see the docstring)

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, update_grad=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if update_grad:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the grads in place
                norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            else:
                self._scaler.unscale_(optimizer)
                norm = get_grad_norm_(parameters)
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            norm = None
        return norm

    def state_dict(self):
        return self._scaler.state_dict()


class args:  # main_pretrain.py defaults with PRETRAIN.md's flags, scaled down
    batch_size = 4; epochs = 2; accum_iter = 2; model = "mae_vit_tiny_patch4"; input_size = 16; mask_ratio = 0.75
    norm_pix_loss = True; weight_decay = 0.05; lr = None; blr = 1.5e-4; min_lr = 0.; warmup_epochs = 1
    start_epoch = 0


batches_per_epoch = 4


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    amp_dtype = torch.bfloat16 if amp == "bf16" else None

    g = torch.Generator().manual_seed(1)
    n_epochs = min(args.epochs, -(-steps // batches_per_epoch))
    dataset_train = torch.utils.data.TensorDataset(
        torch.rand(batches_per_epoch * args.batch_size, 3, args.input_size, args.input_size, generator=g),
        torch.zeros(batches_per_epoch * args.batch_size, dtype=torch.long))
    sampler_train = torch.utils.data.RandomSampler(dataset_train)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train,
                                                    batch_size=args.batch_size, drop_last=True)

    model = globals()[args.model](norm_pix_loss=args.norm_pix_loss)
    model.to(device)
    model_without_ddp = model

    eff_batch_size = args.batch_size * args.accum_iter * 1
    if args.lr is None:  # only base_lr is specified
        args.lr = args.blr * eff_batch_size / 256

    # following timm: set wd as 0 for bias and norm layers
    param_groups = add_weight_decay(model_without_ddp, args.weight_decay)
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, betas=(0.9, 0.95))
    loss_scaler = NativeScalerWithGradNormCount(device.type)
    sg.track(model=model, optimizer=optimizer)

    state = {}

    @sg.compile
    def train_step(samples, data_iter_step, epoch):
        data_loader, accum_iter = state['data_loader'], state['accum_iter']
        # we use a per iteration (instead of per epoch) lr scheduler
        if data_iter_step % accum_iter == 0:
            lr_sched.adjust_learning_rate(optimizer, data_iter_step / len(data_loader) + epoch, args)

        samples = samples.to(device, non_blocking=True)

        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss, _, _ = model(samples, mask_ratio=args.mask_ratio)

        loss_value = loss.item()

        if not math.isfinite(loss_value):
            print("Loss is {}, stopping training".format(loss_value))
            sys.exit(1)

        loss /= accum_iter
        loss_scaler(loss, optimizer, parameters=model.parameters(),
                    update_grad=(data_iter_step + 1) % accum_iter == 0)
        if (data_iter_step + 1) % accum_iter == 0:
            optimizer.zero_grad()
        return loss_value

    def train_one_epoch(model, data_loader, optimizer, device, epoch, loss_scaler, args=None):
        model.train(True)
        meters = {'loss': [], 'lr': []}   # (misc.MetricLogger's meters)
        accum_iter = args.accum_iter
        optimizer.zero_grad()
        for data_iter_step, (samples, _) in enumerate(data_loader):
            if epoch * len(data_loader) + data_iter_step >= steps:
                break
            state.update(data_loader=data_loader, accum_iter=accum_iter)
            loss_value = train_step(samples, data_iter_step, epoch)
            sg.log(loss_value)
            meters['loss'].append(loss_value)
            lr = optimizer.param_groups[0]["lr"]
            meters['lr'].append(lr)
        return {k: sum(v) / len(v) for k, v in meters.items()}

    for epoch in range(args.start_epoch, n_epochs):
        train_one_epoch(model, data_loader_train, optimizer, device, epoch, loss_scaler, args=args)
