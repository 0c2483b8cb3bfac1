"""karpathy/llm.c's train_gpt2.py: the PyTorch reference GPT-2 training script (a tweaked nanoGPT).
Model: ``NewGELU`` (the tanh GeLU written out), ``CausalSelfAttention`` (one ``c_attn`` Linear
split into q/k/v, heads by ``view``/``transpose``; the module-global ``FLASH`` picks
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` or the manual masked softmax over the
``bias`` tril buffer), ``MLP``, pre-norm ``Block``s, ``GPT`` with ``wte``/``wpe``, ``lm_head``
tied to ``wte`` (``LLMC_SKIP_INIT``), init by ``self.apply(self._init_weights)`` drawing from its
own ``torch.Generator`` seeded 42 (std 0.02, ``0.02/sqrt(2*n_layer)`` on the residual
projections flagged ``LLMC_RESIDUAL_SCALE_FLAG``), ``F.cross_entropy(..., ignore_index=-1)``,
``return_logits=False`` in training; ``configure_optimizers``: AdamW over two groups (params
with ``dim() >= 2`` decayed, the rest not), ``fused = 'fused' in signature and device_type ==
'cuda'`` (as the script calls it, with ``device_type=device``), betas (0.9, 0.95).

Loop: the script's ``__main__`` from "main training loop" to the end: every ``val_loss_every``
steps (and at the last) ``model.eval()``, ``val_loader.reset()`` and ``val_max_steps`` no_grad
batches summed with ``loss.item()``; every ``sample_every`` steps ``raw_model.generate`` (top-k
sampling with ``torch.multinomial``); then the TRAINING SECTION: ``model.train()``,
``optimizer.zero_grad(set_to_none=True)``, ``train_loader.reset()`` if
``overfit_single_batch``, the micro-step loop (``x, y = train_loader.next_batch()`` inside it,
``with ctx:`` forward, ``loss = loss / grad_accum_steps``, ``lossf += loss.detach()``,
``loss.backward()``), ``lossf = lossf.item()``, ``norm = clip_grad_norm_(model.parameters(),
grad_clip)``, ``lr = get_lr(step)`` (linear warmup, cosine decay to ``learning_rate *
learning_rate_decay_frac``) assigned to every param group, ``optimizer.step()``; then the
timing/print diagnostics (kept as ``sg.log`` of lossf, norm, lr). Before the loop, the script's
"PyTorch -> C bridge" block runs one forward/backward on the first batch and resets the loader
(the .bin files it writes are not written).

What a user of stepgraph changes: the TRAINING SECTION (BEGIN to END, as the script marks it) is
the body of ``train_step(step)`` decorated with ``sg.compile`` (= ``@stepgraph.compile``), which
returns ``lossf, norm, lr`` for the diagnostics that follow it.

Scaled down / replaced: no DDP / ZeroRedundancyOptimizer (the single-process branch), no
torch.compile (``--compile`` 0, the default), no tiktoken (``enc.eot_token`` is the last token
id, samples are logged as ids). The ``.bin`` token shards are synthetic uint16 arrays held in
memory: ``_load_data_shard(filename)`` returns the array its "file" names (header checks kept as
asserts on a header array), ``glob`` is ``fnmatch`` over those names. Sizes: vocab 50257 -> 64,
d12 -> n_layer 2, n_head 2, n_embd 32, block_size 32; B=4, T=16, total_batch_size 128 (so
``grad_accum_steps`` = 2), two train shards of 4096 tokens and one val shard; num_iterations =
``steps``, learning_rate 6e-4, warmup_iters 2, learning_rate_decay_frac 0.1, weight_decay 0.1,
grad_clip 1.0, val_loss_every 4, val_max_steps 2, sample_every 4 (8 new tokens),
overfit_single_batch 0 (a training run; the default 1 is the variant
``llmc_train_gpt2_overfit``), flash 1 (the README's launch line). ``ctx`` is autocast(bf16) only
on CUDA with amp == "bf16" (the script's ``--dtype bfloat16``); on the CPU the script uses
``nullcontext()`` whatever the dtype.

Source: https://github.com/karpathy/llm.c/blob/f1e2ace651495b74ae22d45d1723443fd00ecd3a/train_gpt2.py
(MIT License, Copyright (c) 2024 Andrej Karpathy). Restated after the source, not copied: same
modules, names, init draws, ops and loop semantics.
"""
import fnmatch
import inspect
import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

SOURCE = "https://github.com/karpathy/llm.c/blob/f1e2ace651495b74ae22d45d1723443fd00ecd3a/train_gpt2.py"
LICENSE = "MIT"
TAGS = ("transformer", "gpt", "lm", "sdpa", "weight-tying", "grad-accum", "data-in-step", "numpy-data",
        "item-in-step", "manual-lr", "cosine-warmup", "clip", "adamw", "weight-decay-groups",
        "generator-init", "eval-mode", "generate-between-steps")


def print0(*args, **kwargs):
    # the script prints on rank 0; the corpus run is silent (the values go to sg.log)
    pass


# -----------------------------------------------------------------------------
# PyTorch nn.Module definitions for the GPT-2 model

class NewGELU(nn.Module):
    """The exact GeLU of OpenAI's GPT-2 (tanh approximation)."""
    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


# a global toggles flash attention (set from --flash in __main__)
FLASH = 0


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.LLMC_RESIDUAL_SCALE_FLAG = 1
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        # the causal mask, named "bias" after OpenAI/HF
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        qkv = self.c_attn(x)
        q, k, v = qkv.split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if FLASH:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.c_proj(y)
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = NewGELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.LLMC_RESIDUAL_SCALE_FLAG = 1

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.LLMC_SKIP_INIT = 1  # tied to wte below: not initialised on its own
        self.transformer.wte.weight = self.lm_head.weight
        # all init draws come from a generator of the model's own
        self.init_rng = torch.Generator()
        self.init_rng.manual_seed(42)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02 if not hasattr(module, 'LLMC_RESIDUAL_SCALE_FLAG') else 0.02 / math.sqrt(2 * self.config.n_layer)
            if not hasattr(module, 'LLMC_SKIP_INIT'):
                torch.nn.init.normal_(module.weight, mean=0.0, std=std, generator=self.init_rng)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=self.init_rng)

    def forward(self, idx, targets=None, return_logits=True):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = tok_emb + pos_emb
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # only the last position at inference
            loss = None
        if not return_logits:
            logits = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, zero_stage):
        param_dict = {pn: p for pn, p in self.named_parameters()}
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        # matmul weights and embeddings decay; biases and layernorms do not
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0}
        ]
        num_decay_params = sum(p.numel() for p in decay_params)
        num_nodecay_params = sum(p.numel() for p in nodecay_params)
        print0(f"num decayed parameter tensors: {len(decay_params)}, with {num_decay_params:,} parameters")
        print0(f"num non-decayed parameter tensors: {len(nodecay_params)}, with {num_nodecay_params:,} parameters")
        fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == 'cuda'
        print0(f"using fused AdamW: {use_fused}")
        assert zero_stage != 1  # (ZeroRedundancyOptimizer: DDP only)
        print0("using regular AdamW")
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, fused=use_fused)
        return optimizer

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# -----------------------------------------------------------------------------
# the script's DistributedDataLoader, over in-memory "files"

SHARDS = {}   # filename -> (header int32[256], uint16 tokens): the synthetic .bin files


def _peek_data_shard(filename):
    header = SHARDS[filename][0]
    assert header[0] == 20240520, "magic number mismatch in the data .bin file!"
    assert header[1] == 1, "unsupported version"
    ntok = header[2]
    return ntok


def _load_data_shard(filename):
    header, tokens = SHARDS[filename]
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    assert header[1] == 1, "unsupported version"
    ntok = header[2]
    assert len(tokens) == ntok, "number of tokens read does not match header?"
    return tokens


class DistributedDataLoader:
    def __init__(self, filename_pattern, B, T, process_rank, num_processes):
        self.process_rank = process_rank
        self.num_processes = num_processes
        self.B = B
        self.T = T
        self.files = sorted(fnmatch.filter(SHARDS, filename_pattern))
        assert len(self.files) > 0, f"did not find any files that match the pattern {filename_pattern}"
        ntok_total = 0
        for fname in self.files:
            shard_ntok = _peek_data_shard(fname)
            assert shard_ntok >= num_processes * B * T + 1
            ntok_total += shard_ntok
        self.ntok_total = ntok_total
        print0(f"DataLoader: total number of tokens: {ntok_total:,} across {len(self.files)} files")
        self.current_shard = None
        self.reset()

    def reset(self):
        if self.current_shard != 0:
            self.current_shard = 0
            self.tokens = _load_data_shard(self.files[self.current_shard])
        self.current_position = self.process_rank * self.B * self.T

    def advance(self):  # to the next data shard
        self.current_shard = (self.current_shard + 1) % len(self.files)
        self.current_position = self.process_rank * self.B * self.T
        self.tokens = _load_data_shard(self.files[self.current_shard])

    def next_batch(self):
        B = self.B
        T = self.T
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        buf = torch.tensor(buf.astype(np.int32), dtype=torch.long)
        x = (buf[:-1]).view(B, T)
        y = (buf[1:]).view(B, T)
        self.current_position += B * T * self.num_processes
        if self.current_position + (B * T * self.num_processes + 1) > len(self.tokens):
            self.advance()
        return x, y


def make_shard(name, ntok, vocab, g):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, ntok
    tokens = torch.randint(0, vocab, (ntok,), generator=g).numpy().astype(np.uint16)
    SHARDS[name] = (header, tokens)


class args:  # the script's argparse values, scaled down (see the docstring)
    input_bin = "dev/data/synthetic/synthetic_train_*.bin"
    input_val_bin = "dev/data/synthetic/synthetic_val.bin"
    output_dir = ""
    model = "d12"
    batch_size = 4
    sequence_length = 16
    total_batch_size = 128
    num_iterations = 10
    inference_only = 0
    learning_rate = 6e-4
    warmup_iters = 2
    learning_rate_decay_frac = 0.1
    weight_decay = 0.1
    grad_clip = 1.0
    val_loss_every = 4
    val_max_steps = 2
    sample_every = 4
    overfit_single_batch = 0
    tensorcores = 0
    device = ""
    compile = 0
    flash = 1
    dtype = "float32"
    zero_stage = 0
    write_tensors = 1


VOCAB = 64


def main(sg, steps=8, device="cpu", amp=None):
    global FLASH
    args.num_iterations = steps
    if amp == "bf16":
        args.dtype = "bfloat16"

    B, T = args.batch_size, args.sequence_length
    assert 1 <= T <= 1024
    assert args.dtype in {"float32", "float16", "bfloat16"}

    # single process: no DDP
    ddp = False
    ddp_rank = 0
    ddp_local_rank = 0
    zero_stage = 0
    ddp_world_size = 1
    master_process = True
    device_type = 'cuda' if 'cuda' in device else 'cpu'

    tokens_per_fwdbwd = B * T * ddp_world_size
    assert args.total_batch_size % tokens_per_fwdbwd == 0
    grad_accum_steps = args.total_batch_size // tokens_per_fwdbwd

    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[args.dtype]
    ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype) if device_type == "cuda" else nullcontext()

    # (the harness seeds; the script calls torch.manual_seed(42) here)
    torch.manual_seed(42)

    assert args.flash in {0, 1}
    FLASH = args.flash

    eot_token = VOCAB - 1  # stands in for enc.eot_token

    # the synthetic .bin shards
    SHARDS.clear()
    g = torch.Generator().manual_seed(1)
    make_shard("dev/data/synthetic/synthetic_train_000.bin", 4096, VOCAB, g)
    make_shard("dev/data/synthetic/synthetic_train_001.bin", 4096, VOCAB, g)
    make_shard("dev/data/synthetic/synthetic_val.bin", 1024, VOCAB, g)

    # from scratch ("d12", scaled down)
    model_config = {
        "d12": GPTConfig(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32),
    }[args.model]
    model = GPT(model_config)
    model.train()
    model.to(device)

    train_loader = DistributedDataLoader(args.input_bin, B, T, ddp_rank, ddp_world_size)
    val_loader = None
    if args.input_val_bin:
        val_loader = DistributedDataLoader(args.input_val_bin, B, T, ddp_rank, ddp_world_size)

    # PyTorch -> C bridge: one forward/backward on the first batch (the files are not written)
    if master_process and args.write_tensors and (not args.inference_only):
        x, y = train_loader.next_batch()
        x, y = x.to(device), y.to(device)
        logits, loss = model(x, y)
        loss.backward()
        train_loader.reset()

    raw_model = model  # (no DDP wrapper)

    optimizer = raw_model.configure_optimizers(weight_decay=args.weight_decay,
                                               learning_rate=args.learning_rate, betas=(0.9, 0.95),
                                               device_type=device, zero_stage=zero_stage)
    sg.track(model=model, optimizer=optimizer)

    # learning rate decay scheduler (cosine with warmup)
    def get_lr(it):
        min_lr = args.learning_rate * args.learning_rate_decay_frac
        if it < args.warmup_iters:
            return args.learning_rate * (it + 1) / args.warmup_iters
        if it > args.num_iterations:
            return min_lr
        decay_ratio = (it - args.warmup_iters) / (args.num_iterations - args.warmup_iters)
        assert 0 <= decay_ratio <= 1
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return min_lr + coeff * (args.learning_rate - min_lr)

    @sg.compile
    def train_step(step):
        # --------------- TRAINING SECTION BEGIN -----------------
        model.train()
        optimizer.zero_grad(set_to_none=True)
        if args.overfit_single_batch:
            train_loader.reset()
        lossf = 0.0  # the mean loss over the accumulation steps, as a simple float
        for micro_step in range(grad_accum_steps):
            x, y = train_loader.next_batch()
            x, y = x.to(device), y.to(device)
            with ctx:
                _, loss = model(x, y, return_logits=False)
                # the grads add up over micro-steps: scale for a MEAN objective
                loss = loss / grad_accum_steps
                lossf += loss.detach()
            if not args.inference_only:
                loss.backward()
        lossf = lossf.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        lr = get_lr(step)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        optimizer.step()
        # --------------- TRAINING SECTION END -------------------
        return lossf, norm, lr

    norm = -1.0
    for step in range(args.num_iterations + 1):
        last_step = (step == args.num_iterations)

        # once in a while evaluate the validation dataset
        if (args.val_loss_every > 0 and (step % args.val_loss_every == 0 or last_step)) and (val_loader is not None):
            model.eval()
            val_loader.reset()
            with torch.no_grad():
                val_loss = 0.0
                for _ in range(args.val_max_steps):
                    x, y = val_loader.next_batch()
                    x, y = x.to(device), y.to(device)
                    _, loss = model(x, y, return_logits=False)
                    val_loss += loss.item()
                val_loss /= args.val_max_steps
            print0(f"val loss {val_loss}")
            sg.log({"val_loss": val_loss})

        # once in a while sample from the model
        if (args.sample_every > 0 and (step % args.sample_every == 0 or last_step)) and master_process:
            model.eval()
            start_ids = [eot_token]
            xg = (torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...])
            max_new_tokens = 8
            temperature = 1.0
            top_k = 40
            yg = raw_model.generate(xg, max_new_tokens, temperature=temperature, top_k=top_k)
            sg.log({"sample": yg[0].tolist()})

        if last_step:
            break

        lossf, norm, lr = train_step(step)

        print0(f"step {step+1:4d}/{args.num_iterations} | train loss {lossf:.6f} | norm {norm:.4f} | lr {lr:.2e}")
        sg.log({"lossf": lossf, "norm": norm, "lr": lr})
