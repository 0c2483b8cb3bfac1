"""A small model zoo for stepgraph's demo, benchmark and tests (pure torch).

Every family is a function ``family(**config, seed=0, device="cpu", dtype=torch.float32)``
returning a :class:`Case`. Two calls with the same arguments give bitwise-identical weights,
and ``case.make_batch(i)`` gives the same batch for the same ``i`` on every call, so a test
can drive an eager copy and a compiled copy with the same data step by step::

    a, b = models.gpt(seed=0), models.gpt(seed=0)
    for i in range(5):
        batch = a.make_batch(i)
        a.loss_fn(a.model, *batch).backward()

``loss_fn(model, *batch)`` only calls ``model(...)`` (never ``model.forward``), so ``model`` may
be swapped for a ``torch.compile``-wrapped module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Case", "FAMILIES", "build", "train_step", "mlp", "cnn_bn", "gpt", "embedding_model",
           "hooked_mlp", "tied"]


@dataclass
class Case:
    """One model plus how to feed it: ``loss_fn(model, *make_batch(seed_or_gen))``."""

    name: str
    model: nn.Module
    make_batch: Callable[[torch.Generator | int], tuple]
    loss_fn: Callable[..., torch.Tensor]
    family: str = ""
    # Everything the constructor was called with, so fresh() can rebuild an identical copy.
    config: dict = field(default_factory=dict)
    # Real-scale cases (models_scale.py) bring their own training recipe and its cost.
    make_opt: Callable | None = None         # make_opt(model) -> optimizer
    make_step: Callable | None = None        # make_step(model, opt, before=None) -> step(*batch)
    tokens_per_step: int | None = None
    flops_per_step: float | None = None

    def fresh(self) -> "Case":
        """A new, independent Case with identical initial weights (same family, config, seed)."""
        return FAMILIES[self.family](**self.config)


def train_step(model: nn.Module, loss_fn: Callable, opt: torch.optim.Optimizer,
               before: Callable | None = None) -> Callable:
    """The plain eager training step every demo, benchmark and test wraps:
    ``loss_fn(model, *batch)`` -> ``backward()`` -> ``opt.step()`` -> ``opt.zero_grad()``."""
    def step(*batch):
        if before is not None:
            before()
        loss = loss_fn(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _generator(seed_or_gen: torch.Generator | int) -> torch.Generator:
    # Batches are drawn on the CPU and then moved, so a seed gives the same data on any device.
    if isinstance(seed_or_gen, torch.Generator):
        return seed_or_gen
    return torch.Generator().manual_seed(int(seed_or_gen))


def _built(model_fn: Callable[[], nn.Module], seed: int, device, dtype) -> nn.Module:
    """Build a module under a private RNG seeded with ``seed``; leaves the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Initialise on the CPU in float32 and convert afterwards: identical weights on every device.
        model = model_fn()
    return model.to(device=device, dtype=dtype)


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _classify_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _ce(model(x), y)


def _float_batch(shape, classes, device, dtype):
    """make_batch for float inputs of ``shape`` and integer labels in ``[0, classes)``."""
    def make_batch(seed_or_gen):
        g = _generator(seed_or_gen)
        x = torch.randn(shape, generator=g)
        y = torch.randint(0, classes, (shape[0],), generator=g)
        return x.to(device=device, dtype=dtype), y.to(device)
    return make_batch


# --------------------------------------------------------------------------- MLP

class MLP(nn.Module):
    """``depth`` x (Linear(width) + GELU), then Linear(width, classes)."""

    def __init__(self, in_dim: int, width: int, depth: int, classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(in_dim if i == 0 else width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(x))


def mlp(width: int = 64, depth: int = 8, batch: int = 32, classes: int = 10,
        in_dim: int | None = None, *, seed: int = 0, device="cpu",
        dtype: torch.dtype = torch.float32) -> Case:
    """Plain MLP on random features with cross-entropy (``in_dim`` defaults to ``width``)."""
    cfg = dict(width=width, depth=depth, batch=batch, classes=classes, in_dim=in_dim,
               seed=seed, device=device, dtype=dtype)
    in_dim = width if in_dim is None else in_dim
    model = _built(lambda: MLP(in_dim, width, depth, classes), seed, device, dtype)
    return Case(f"mlp{width}x{depth}", model, _float_batch((batch, in_dim), classes, device, dtype),
                _classify_loss, "mlp", cfg)


# --------------------------------------------------------------------------- CNN + BatchNorm

class ConvBN(nn.Module):
    """Two conv/BN/ReLU stages with pooling; BatchNorm gives in-place buffer updates to capture."""

    def __init__(self, channels: int, width: int, classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def cnn_bn(channels: int = 3, size: int = 16, width: int = 16, batch: int = 16,
           classes: int = 10, *, seed: int = 0, device="cpu",
           dtype: torch.dtype = torch.float32) -> Case:
    """Small conv net with BatchNorm2d on ``channels x size x size`` images, cross-entropy."""
    cfg = dict(channels=channels, size=size, width=width, batch=batch, classes=classes,
               seed=seed, device=device, dtype=dtype)
    model = _built(lambda: ConvBN(channels, width, classes), seed, device, dtype)
    return Case(f"cnn_bn{size}", model,
                _float_batch((batch, channels, size, size), classes, device, dtype),
                _classify_loss, "cnn_bn", cfg)


# --------------------------------------------------------------------------- GPT

class CausalSelfAttention(nn.Module):
    """Multi-head causal attention: explicit matmul + mask + softmax, or SDPA when ``sdpa``."""

    def __init__(self, d: int, heads: int, seq: int, dropout: float, sdpa: bool):
        super().__init__()
        assert d % heads == 0, f"d={d} must be divisible by heads={heads}"
        self.heads, self.dropout, self.sdpa = heads, dropout, sdpa
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        # Non-persistent: derived from seq, so it need not be in state_dict; still moves with .to().
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool))
                             .view(1, 1, seq, seq), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            y = self.attn_drop(F.softmax(att, dim=-1)) @ v
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d, heads, seq, dropout, sdpa):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, seq, dropout, sdpa)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Minimal GPT: token + position embeddings, blocks, final LayerNorm, tied lm head."""

    def __init__(self, layers, d, heads, vocab, seq, dropout, sdpa):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, seq, dropout, sdpa) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one Parameter, two uses, grads accumulate
        self.apply(self._init)

    @staticmethod
    def _init(m):
        # GPT-2 style init keeps the initial loss near log(vocab) so training curves are sane.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def gpt(layers: int = 2, d: int = 128, heads: int = 4, vocab: int = 1024, batch: int = 4,
        seq: int = 64, dropout: float = 0.0, sdpa: bool = False, *, seed: int = 0,
        device="cpu", dtype: torch.dtype = torch.float32) -> Case:
    """GPT language model on random tokens with next-token cross-entropy.

    ``sdpa=False`` writes attention as matmul + masked_fill(causal-mask buffer) + softmax;
    ``sdpa=True`` uses ``F.scaled_dot_product_attention(is_causal=True)``.
    """
    cfg = dict(layers=layers, d=d, heads=heads, vocab=vocab, batch=batch, seq=seq,
               dropout=dropout, sdpa=sdpa, seed=seed, device=device, dtype=dtype)
    model = _built(lambda: GPT(layers, d, heads, vocab, seq, dropout, sdpa), seed, device, dtype)

    def make_batch(seed_or_gen):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=_generator(seed_or_gen))
        # Shifted by one: predict token t+1 from tokens <= t.
        return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)

    return Case(f"gpt{layers}l_d{d}", model, make_batch, _classify_loss, "gpt", cfg)


# --------------------------------------------------------------------------- embeddings

class EmbeddingClassifier(nn.Module):
    """Bag-of-tokens classifier: EmbeddingBag(mean), or Embedding followed by a mean over tokens."""

    def __init__(self, vocab, dim, classes, bag):
        super().__init__()
        self.bag = bag
        self.emb = nn.EmbeddingBag(vocab, dim, mode="mean") if bag else nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, idx):
        h = self.emb(idx) if self.bag else self.emb(idx).mean(dim=1)
        return self.head(h)


def embedding_model(vocab: int = 1000, dim: int = 32, tokens: int = 12, batch: int = 16,
                    classes: int = 5, bag: bool = True, *, seed: int = 0, device="cpu",
                    dtype: torch.dtype = torch.float32) -> Case:
    """Token-bag classifier (EmbeddingBag if ``bag`` else Embedding + mean), cross-entropy."""
    cfg = dict(vocab=vocab, dim=dim, tokens=tokens, batch=batch, classes=classes, bag=bag,
               seed=seed, device=device, dtype=dtype)
    model = _built(lambda: EmbeddingClassifier(vocab, dim, classes, bag), seed, device, dtype)

    def make_batch(seed_or_gen):
        g = _generator(seed_or_gen)
        idx = torch.randint(0, vocab, (batch, tokens), generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
        return idx.to(device), y.to(device)

    return Case("embedding_bag" if bag else "embedding_mean", model, make_batch, _classify_loss,
                "embedding_model", cfg)


# --------------------------------------------------------------------------- hooks

def _halve(g: torch.Tensor) -> torch.Tensor:
    return g * 0.5


class _Scale:
    """Picklable grad hook ``g -> g * factor`` (a lambda would pin the closure and not pickle)."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        return g * self.factor


class HookedMLP(nn.Module):
    """MLP with a tensor hook registered on every forward and a persistent parameter hook.

    Both hooks change the gradients, so a capture that drops them gives visibly different weights.
    """

    def __init__(self, width, classes, grad_scale):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, classes)
        self.fc1.weight.register_hook(_Scale(grad_scale))

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if h.requires_grad:  # registering on a no-grad tensor raises (e.g. under torch.no_grad)
            h.register_hook(_halve)
        return self.fc2(h)


def hooked_mlp(width: int = 32, batch: int = 8, classes: int = 10, grad_scale: float = 2.0, *,
               seed: int = 0, device="cpu", dtype: torch.dtype = torch.float32) -> Case:
    """MLP with ``h.register_hook(g * 0.5)`` in forward and ``fc1.weight`` grads scaled."""
    cfg = dict(width=width, batch=batch, classes=classes, grad_scale=grad_scale, seed=seed,
               device=device, dtype=dtype)
    model = _built(lambda: HookedMLP(width, classes, grad_scale), seed, device, dtype)
    return Case("hooked_mlp", model, _float_batch((batch, width), classes, device, dtype),
                _classify_loss, "hooked_mlp", cfg)


# --------------------------------------------------------------------------- weight sharing

class Tied(nn.Module):
    """Two Linear modules sharing one weight Parameter (distinct biases)."""

    def __init__(self, width, classes):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.b.weight = self.a.weight
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(F.gelu(self.b(F.gelu(self.a(x)))))


def tied(width: int = 32, batch: int = 8, classes: int = 10, *, seed: int = 0, device="cpu",
         dtype: torch.dtype = torch.float32) -> Case:
    """Small classifier whose modules ``a`` and ``b`` share one weight Parameter."""
    cfg = dict(width=width, batch=batch, classes=classes, seed=seed, device=device, dtype=dtype)
    model = _built(lambda: Tied(width, classes), seed, device, dtype)
    return Case("tied", model, _float_batch((batch, width), classes, device, dtype),
                _classify_loss, "tied", cfg)


FAMILIES: dict[str, Callable[..., Case]] = {
    "mlp": mlp,
    "cnn_bn": cnn_bn,
    "gpt": gpt,
    "embedding_model": embedding_model,
    "hooked_mlp": hooked_mlp,
    "tied": tied,
    # Hugging Face models (transformers imported only when built): see models_hf.py.
    "hf_gpt2": lambda **kw: __import__("stepgraph.tools.models_hf", fromlist=["x"]).hf_gpt2(**kw),
    "nanogpt": lambda **kw: __import__("stepgraph.tools.models_scale", fromlist=["x"]).nanogpt(**kw),
    "hf_llama": lambda **kw: __import__("stepgraph.tools.models_hf", fromlist=["x"]).hf_llama(**kw),
}


def build(family: str, **config) -> Case:
    """``FAMILIES[family](**config)`` with a readable error for unknown names."""
    try:
        ctor = FAMILIES[family]
    except KeyError:
        raise KeyError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}") from None
    return ctor(**config)
