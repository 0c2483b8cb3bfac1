"""karpathy/llm.c's train_gpt2.py as the corpus client ``llmc_train_gpt2``, with the fix that
stepgraph's CaptureError names applied ("make it a tensor once outside the step
(torch.from_numpy shares its memory)"): ``_load_data_shard`` returns ``torch.from_numpy(tokens)``
(the uint16 shard as a tensor, made when the shard is loaded, outside the step), and
``next_batch`` slices it and converts with ``buf.to(torch.long)`` where the script wrote
``torch.tensor(buf.astype(np.int32), dtype=torch.long)``. Everything else, the compiled
TRAINING SECTION included, is ``llmc_train_gpt2``'s (same sizes, loop and logging).

Source: https://github.com/karpathy/llm.c/blob/f1e2ace651495b74ae22d45d1723443fd00ecd3a/train_gpt2.py
(MIT License, Copyright (c) 2024 Andrej Karpathy).
"""
import torch

from clients.harness import load

SOURCE = "https://github.com/karpathy/llm.c/blob/f1e2ace651495b74ae22d45d1723443fd00ecd3a/train_gpt2.py"
LICENSE = "MIT"
TAGS = ("transformer", "gpt", "lm", "sdpa", "weight-tying", "grad-accum", "data-in-step", "tensor-data",
        "item-in-step", "manual-lr", "cosine-warmup", "clip", "adamw", "weight-decay-groups", "fix-applied")


ARGS = {}   # argparse values a variant sets on top of llmc_train_gpt2's


def main(sg, steps=8, device="cpu", amp=None):
    base = load("llmc_train_gpt2")   # a fresh copy of the client, its own globals
    for k, v in ARGS.items():
        setattr(base.args, k, v)

    def _load_data_shard(filename):
        header, tokens = base.SHARDS[filename]
        assert header[0] == 20240520, "magic number mismatch in the data .bin file"
        assert header[1] == 1, "unsupported version"
        ntok = header[2]
        assert len(tokens) == ntok, "number of tokens read does not match header?"
        return torch.from_numpy(tokens)

    def next_batch(self):
        B = self.B
        T = self.T
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        buf = buf.to(torch.long)
        x = (buf[:-1]).view(B, T)
        y = (buf[1:]).view(B, T)
        self.current_position += B * T * self.num_processes
        if self.current_position + (B * T * self.num_processes + 1) > len(self.tokens):
            self.advance()
        return x, y

    base._load_data_shard = _load_data_shard
    base.DistributedDataLoader.next_batch = next_batch
    base.main(sg, steps=steps, device=device, amp=amp)
