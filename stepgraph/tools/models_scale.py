"""Real-scale cases for the benchmark (issue 21): nanoGPT's model and its ``train.py`` loop body.

The model follows Karpathy's nanoGPT ``model.py`` (pre-LayerNorm blocks, fused qkv projection,
``F.scaled_dot_product_attention`` with ``is_causal``, tied token embedding / lm head, optional
biases, residual projections initialised with std 0.02/sqrt(2 L)). The step follows its
``train.py``: micro-batches accumulated inside the step under bf16 autocast, each loss divided by
their number, ``clip_grad_norm_``, AdamW with weight decay on matrices only (fused on CUDA, as
nanoGPT's ``configure_optimizers``), ``zero_grad(set_to_none=True)``.

    case = nanogpt(layers=12, d=768, heads=12, vocab=50304, seq=1024, batch=8, micro=2)
    opt = case.make_opt(case.model)
    step = case.make_step(case.model, opt)      # step(x, y): x, y are [micro * batch, seq]

``flops_per_step`` is nanoGPT's ``estimate_mfu`` count (6 N + 12 L H Q T per token, forward and
backward), so MFU = flops_per_step / seconds / peak.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .models import Case, _built, _classify_loss, _generator


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT: PyTorch's had no bias=False until 2.1)."""

    def __init__(self, d, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Attention(nn.Module):
    def __init__(self, d, heads, dropout, bias):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, d, heads, dropout, bias):
        super().__init__()
        self.ln_1, self.ln_2 = LayerNorm(d, bias), LayerNorm(d, bias)
        self.attn = Attention(d, heads, dropout, bias)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=bias), nn.GELU(), nn.Linear(4 * d, d, bias=bias),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, layers, d, heads, vocab, seq, dropout, bias):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(d, heads, dropout, bias) for _ in range(layers))
        self.ln_f = LayerNorm(d, bias)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.h:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def nanogpt(layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50304, seq: int = 1024,
            batch: int = 8, micro: int = 2, dropout: float = 0.0, bias: bool = False,
            autocast: str = "bfloat16", lr: float = 6e-4, weight_decay: float = 0.1, grad_clip: float = 1.0,
            *, seed: int = 0, device="cpu", dtype: torch.dtype = torch.float32) -> Case:
    """nanoGPT with its train.py step; a batch is ``micro`` micro-batches of ``batch`` x ``seq``."""
    cfg = dict(layers=layers, d=d, heads=heads, vocab=vocab, seq=seq, batch=batch, micro=micro,
               dropout=dropout, bias=bias, autocast=autocast, lr=lr, weight_decay=weight_decay,
               grad_clip=grad_clip, seed=seed, device=device, dtype=dtype)
    model = _built(lambda: NanoGPT(layers, d, heads, vocab, seq, dropout, bias), seed, device, dtype)

    def make_batch(seed_or_gen):
        t = torch.randint(0, vocab, (micro * batch, seq + 1), generator=_generator(seed_or_gen))
        return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)

    case = Case(f"nanogpt{layers}l_d{d}", model, make_batch, _classify_loss, "nanogpt", cfg)
    dev_type = torch.device(device).type
    amp = getattr(torch, autocast) if autocast else None

    def make_opt(m):
        # nanoGPT's configure_optimizers: decay matrices and embeddings, not biases and norms.
        params = [p for p in m.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=dev_type == "cuda")

    def make_step(m, opt, before=None):
        def step(x, y):
            if before is not None:
                before()
            total = None
            for xb, yb in zip(x.chunk(micro), y.chunk(micro)):
                with torch.autocast(dev_type, dtype=amp, enabled=amp is not None):
                    loss = _classify_loss(m, xb, yb) / micro
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total
        return step

    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()  # as nanoGPT
    case.make_opt, case.make_step = make_opt, make_step
    case.tokens_per_step = micro * batch * seq
    case.flops_per_step = (6 * n_params + 12 * layers * d * seq) * case.tokens_per_step
    return case


# --------------------------------------------------------------------------- bench helpers

def opt_and_step(case: Case, model: nn.Module, before=None):
    """``(optimizer, step)`` for a benchmark variant that runs ``model`` (maybe torch.compile'd):
    the case's own recipe where it has one, else AdamW and ``models.train_step``."""
    from .models import train_step
    if case.make_step is not None:
        opt = case.make_opt(case.model)
        return opt, case.make_step(model, opt, before)
    opt = torch.optim.AdamW(case.model.parameters())
    return opt, train_step(model, case.loss_fn, opt, before=before)


# Dense bf16 tensor-core peak, FLOP/s (the datasheets' SXM numbers without sparsity); MFU is
# reported against it whatever the step's dtype, as nanoGPT does (it uses the A100's 312e12).
PEAK_BF16 = {"H100": 989.5e12, "H200": 989.5e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def peak_flops(dev: torch.device) -> float | None:
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def fused_timeline(handle, t0: float) -> tuple[float | None, float | None]:
    """``(ready_s, switch_s)`` of a ``backend="inductor"`` step: from ``t0`` (perf_counter when
    the step function was built) to the fused graph loaded, and the switching call's length."""
    for e in getattr(handle, "_order", []):
        run = e.run
        started = getattr(run, "started", None)
        if started is not None and getattr(run, "compile_seconds", 0.0):
            return started + run.compile_seconds - t0, run.switch_seconds
    return None, None
