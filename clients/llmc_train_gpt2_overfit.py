"""karpathy/llm.c's train_gpt2.py run as ``python train_gpt2.py`` with its defaults
``--overfit_single_batch 1 --flash 0``: the TRAINING SECTION calls ``train_loader.reset()`` first,
so every step trains on the same first batches; attention is the manual masked softmax over the
``bias`` tril buffer. On top of ``llmc_train_gpt2_tokens_tensor`` (the shard held as a tensor, the
fix stepgraph names for ``llmc_train_gpt2``); sizes, loop and logging as ``llmc_train_gpt2``.

Source: https://github.com/karpathy/llm.c/blob/f1e2ace651495b74ae22d45d1723443fd00ecd3a/train_gpt2.py
(MIT License, Copyright (c) 2024 Andrej Karpathy).
"""
from clients.harness import load

SOURCE = "https://github.com/karpathy/llm.c/blob/f1e2ace651495b74ae22d45d1723443fd00ecd3a/train_gpt2.py"
LICENSE = "MIT"
TAGS = ("transformer", "gpt", "lm", "manual-attention", "weight-tying", "grad-accum", "data-in-step",
        "overfit-single-batch", "item-in-step", "manual-lr", "cosine-warmup", "clip", "adamw",
        "weight-decay-groups")


def main(sg, steps=8, device="cpu", amp=None):
    fixed = load("llmc_train_gpt2_tokens_tensor")
    fixed.ARGS.update(overfit_single_batch=1, flash=0)
    fixed.main(sg, steps=steps, device=device, amp=amp)
