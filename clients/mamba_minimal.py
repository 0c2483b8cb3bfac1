"""johnma2006/mamba-minimal: Mamba in one file of PyTorch (model.py) trained as a tiny
character-level language model. ``Mamba`` (``nn.Embedding``, a ``ModuleList`` of
``ResidualBlock``s, a final ``RMSNorm``, an ``lm_head`` whose weight *is* the embedding's: weight
tying by Parameter assignment); ``ResidualBlock`` = ``mixer(norm(x)) + x``; ``MambaBlock``:
``in_proj`` split into ``(x, res)``, einops ``rearrange`` around a depthwise causal ``Conv1d``
(padding ``d_conv - 1``, sliced back to ``l``), SiLU, the SSM (``A = -exp(A_log.float())``,
``x_proj`` split into ``delta, B, C``, ``softplus(dt_proj(delta))``) and ``selective_scan``:
``deltaA = exp(einsum(delta, A))``, ``deltaB_u = einsum(delta, B, u)``, then the scan written as a
Python loop over the sequence (``x = deltaA[:, i] * x + deltaB_u[:, i]``, ``einsum(x, C[:, i, :])``
appended to a list, ``torch.stack``), ``+ u * D``, gated by ``silu(res)``, ``out_proj``;
``RMSNorm`` = ``x * rsqrt(mean(x^2) + eps) * weight``. einops' ``rearrange`` / ``repeat`` /
``einsum`` are called as model.py calls them (einops must be installed, as model.py imports it; model.py's ``from __future__ import
annotations`` is dropped: the harness loads a client outside ``sys.modules``, where ``@dataclass``
then fails).

mamba-minimal has no training code (its demo only generates). The loop is the one a user of a
minimal model reaches for: karpathy/minGPT's ``Trainer.run`` (mingpt/trainer.py lines 83-107 at
37baab7, also in clients/mingpt.py): a DataLoader with a replacement RandomSampler, the next batch
``.to(device)``, the forward, ``model.zero_grad(set_to_none=True)`` after it, ``loss.backward()``,
``torch.nn.utils.clip_grad_norm_(model.parameters(), grad_norm_clip)``, ``optimizer.step()``, then
the ``on_batch_end`` callback (chargpt's: prints ``trainer.loss.item()`` every 10 iterations) and
the iteration timing. The loss is minGPT's ``F.cross_entropy(logits.view(-1, logits.size(-1)),
targets.view(-1), ignore_index=-1)`` on Mamba's logits. The optimizer is AdamW with minGPT's
Trainer defaults (lr 3e-4, betas (0.9, 0.95), weight decay 0.1) over ``model.parameters()`` in one
group: minGPT's ``configure_optimizers`` splits decay/no-decay by module type (Linear /
LayerNorm, Embedding) and asserts it covered every parameter, which Mamba's Conv1d, RMSNorm,
``A_log`` and ``D`` do not satisfy. ``amp="bf16"``: the forward and loss run under
``torch.autocast(device_type, dtype=torch.bfloat16)`` (the autocast form nanoGPT's train.py uses).

What a user of stepgraph changes: the forward ... ``optimizer.step()`` block is decorated
(``@sg.compile``, i.e. ``@stepgraph.compile``). Scaled down / replaced: ``ModelArgs(d_model=16,
n_layer=2, vocab_size=12)`` (padded to 16 by ``pad_vocab_size_multiple``; d_state 16, expand 2,
d_conv 4, dt_rank 'auto' = 1: model.py's defaults) instead of a pretrained checkpoint
(``from_pretrained`` cut); block_size 16, batch 4, num_workers 0; a synthetic 4000-character text
over a 12-character alphabet instead of input.txt.

Sources: https://github.com/johnma2006/mamba-minimal/blob/03de542a36d873f6e6c4057ad687278cc6ae944d/model.py
(Apache-2.0, Copyright John Ma) and https://github.com/karpathy/minGPT/blob/37baab7/mingpt/trainer.py
(MIT). Restated after the source, not copied: same modules, names, ops, initialisation.
"""
import math
import time
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import einsum, rearrange, repeat
from torch.utils.data import DataLoader, Dataset

SOURCE = "https://github.com/johnma2006/mamba-minimal/blob/03de542a36d873f6e6c4057ad687278cc6ae944d/model.py"
LICENSE = "Apache-2.0"
TAGS = ("ssm", "mamba", "lm", "python-loop-over-sequence", "einops", "weight-tying", "depthwise-conv1d",
        "rmsnorm", "clip", "adamw", "zero-grad-after-forward", "dataloader", "callback", "item-outside-step")


# ---------------------------------------------------------------- model.py (restated)

@dataclass
class ModelArgs:
    d_model: int
    n_layer: int
    vocab_size: int
    d_state: int = 16
    expand: int = 2
    dt_rank: Union[int, str] = 'auto'
    d_conv: int = 4
    pad_vocab_size_multiple: int = 8
    conv_bias: bool = True
    bias: bool = False

    def __post_init__(self):
        self.d_inner = int(self.expand * self.d_model)
        if self.dt_rank == 'auto':
            self.dt_rank = math.ceil(self.d_model / 16)
        if self.vocab_size % self.pad_vocab_size_multiple != 0:
            self.vocab_size += (self.pad_vocab_size_multiple
                                - self.vocab_size % self.pad_vocab_size_multiple)


class Mamba(nn.Module):
    def __init__(self, args: ModelArgs):
        """Full Mamba model."""
        super().__init__()
        self.args = args
        self.embedding = nn.Embedding(args.vocab_size, args.d_model)
        self.layers = nn.ModuleList([ResidualBlock(args) for _ in range(args.n_layer)])
        self.norm_f = RMSNorm(args.d_model)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight  # weight tying

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm_f(x)
        return self.lm_head(x)


class ResidualBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.mixer = MambaBlock(args)
        self.norm = RMSNorm(args.d_model)

    def forward(self, x):
        # [Norm -> Mamba -> Add], numerically the official [Add -> Norm -> Mamba] chain
        return self.mixer(self.norm(x)) + x


class MambaBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        """One Mamba block (Figure 3, Section 3.4 of the paper)."""
        super().__init__()
        self.args = args
        self.in_proj = nn.Linear(args.d_model, args.d_inner * 2, bias=args.bias)
        self.conv1d = nn.Conv1d(in_channels=args.d_inner, out_channels=args.d_inner, bias=args.conv_bias,
                                kernel_size=args.d_conv, groups=args.d_inner, padding=args.d_conv - 1)
        # x_proj: the input-specific delta, B, C
        self.x_proj = nn.Linear(args.d_inner, args.dt_rank + args.d_state * 2, bias=False)
        # dt_proj: delta from dt_rank up to d_in
        self.dt_proj = nn.Linear(args.dt_rank, args.d_inner, bias=True)
        A = repeat(torch.arange(1, args.d_state + 1), 'n -> d n', d=args.d_inner)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(args.d_inner))
        self.out_proj = nn.Linear(args.d_inner, args.d_model, bias=args.bias)

    def forward(self, x):
        (b, l, d) = x.shape
        x_and_res = self.in_proj(x)  # (b, l, 2 * d_in)
        (x, res) = x_and_res.split(split_size=[self.args.d_inner, self.args.d_inner], dim=-1)
        x = rearrange(x, 'b l d_in -> b d_in l')
        x = self.conv1d(x)[:, :, :l]
        x = rearrange(x, 'b d_in l -> b l d_in')
        x = F.silu(x)
        y = self.ssm(x)
        y = y * F.silu(res)
        return self.out_proj(y)

    def ssm(self, x):
        (d_in, n) = self.A_log.shape
        # A, D input-independent; delta, B, C input-dependent (selective)
        A = -torch.exp(self.A_log.float())  # (d_in, n)
        D = self.D.float()
        x_dbl = self.x_proj(x)  # (b, l, dt_rank + 2*n)
        (delta, B, C) = x_dbl.split(split_size=[self.args.dt_rank, n, n], dim=-1)
        delta = F.softplus(self.dt_proj(delta))  # (b, l, d_in)
        return self.selective_scan(x, delta, A, B, C, D)

    def selective_scan(self, u, delta, A, B, C, D):
        (b, l, d_in) = u.shape
        n = A.shape[1]
        # discretise: A by zero-order hold, B by a simplified Euler step
        deltaA = torch.exp(einsum(delta, A, 'b l d_in, d_in n -> b l d_in n'))
        deltaB_u = einsum(delta, B, u, 'b l d_in, b l n, b l d_in -> b l d_in n')
        # the sequential scan (the official kernel scans in parallel)
        x = torch.zeros((b, d_in, n), device=deltaA.device)
        ys = []
        for i in range(l):
            x = deltaA[:, i] * x + deltaB_u[:, i]
            y = einsum(x, C[:, i, :], 'b d_in n, b n -> b d_in')
            ys.append(y)
        y = torch.stack(ys, dim=1)  # (b, l, d_in)
        y = y + u * D
        return y


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# ---------------------------------------------------------------- chargpt's CharDataset (restated)

class CharDataset(Dataset):
    def __init__(self, block_size, data):
        chars = sorted(list(set(data)))
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.vocab_size = len(chars)
        self.block_size = block_size
        self.data = data

    def __len__(self):
        return len(self.data) - self.block_size

    def __getitem__(self, idx):
        chunk = self.data[idx:idx + self.block_size + 1]
        dix = [self.stoi[s] for s in chunk]
        return torch.tensor(dix[:-1], dtype=torch.long), torch.tensor(dix[1:], dtype=torch.long)


# minGPT Trainer defaults
learning_rate = 3e-4
betas = (0.9, 0.95)
weight_decay = 0.1
grad_norm_clip = 1.0
batch_size = 4       # chargpt: 64 (Trainer default)
block_size = 16      # chargpt: 128


def main(sg, steps=8, device="cpu", amp=None):
    alphabet = "abcdefghij \n"
    g = torch.Generator().manual_seed(1)
    text = "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (4000,), generator=g).tolist())
    train_dataset = CharDataset(block_size, text)

    model = Mamba(ModelArgs(d_model=16, n_layer=2, vocab_size=train_dataset.vocab_size)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=betas, weight_decay=weight_decay)
    sg.track(model=model, optimizer=optimizer)
    ctx = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=(amp == "bf16"))

    train_loader = DataLoader(
        train_dataset,
        sampler=torch.utils.data.RandomSampler(train_dataset, replacement=True, num_samples=int(1e10)),
        shuffle=False, pin_memory=False, batch_size=batch_size, num_workers=0)

    @sg.compile
    def train_step(x, y):
        # forward the model
        with ctx:
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)
        # backprop and update the parameters
        model.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_norm_clip)
        optimizer.step()
        return loss

    model.train()
    iter_num = 0
    iter_time = time.time()
    data_iter = iter(train_loader)
    while True:
        try:
            batch = next(data_iter)
        except StopIteration:
            data_iter = iter(train_loader)
            batch = next(data_iter)
        x, y = [t.to(device) for t in batch]

        loss = train_step(x, y)

        # chargpt's on_batch_end callback
        if iter_num % 10 == 0:
            print(f"iter {iter_num}: train loss {loss.item():.5f}")
        sg.log(loss)
        iter_num += 1
        tnow = time.time()
        iter_dt = tnow - iter_time
        iter_time = tnow
        if iter_num >= steps:
            break
