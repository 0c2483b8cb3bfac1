"""A plain PyTorch loop training transformers' LlamaForCausalLM: the "Train in native PyTorch"
loop of transformers' training tutorial (``outputs = model(**batch); loss = outputs.loss;
loss.backward(); optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()``) with the
schedule from ``transformers.get_cosine_schedule_with_warmup`` and ``clip_grad_norm_(..., 1.0)``
before the optimizer step, as causal-LM pretraining scripts commonly write it; batches of
left-padded sequences (attention_mask zeros at the start, labels -100 there).

Model: the installed transformers' LlamaForCausalLM (not vendored), LlamaConfig defaults except
vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
num_attention_heads=2, max_position_embeddings=64 (default attention implementation, no
dropout). Loop: docs/source/en/training.md at 6ce62e2, section "Train in native PyTorch"
(DataLoader with shuffle=True, ``torch.optim.AdamW(model.parameters(), lr=5e-5)``, the epoch /
batch loop), with get_scheduler("linear", num_warmup_steps=0) replaced by
get_cosine_schedule_with_warmup(num_warmup_steps=2) and the clip added (this corpus entry's
brief); an autocast around the forward when amp == "bf16". The tutorial's evaluate metric
is left out.

Data: synthetic token sequences of length 16, left-padded with pad id 0 to the batch length.
Scaled down: 16 examples, batch 4, 2 epochs for 8 steps.
"""
import math

import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

SOURCE = "https://github.com/huggingface/transformers/blob/6ce62e29e46975b66d0d8e9cec024ca05c4beb4d/docs/source/en/training.md"
LICENSE = "Apache-2.0"
TAGS = ("transformer", "hf", "llama", "lm", "rope", "rmsnorm", "cosine-warmup", "lr-scheduler", "clip",
        "adamw", "left-padding", "padding-mask", "dict-batch")

SEQ = 16


def synthetic_dataset(n, g, vocab=100):
    rows = []
    for _ in range(n):
        length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (length,), generator=g)
        rows.append(ids)
    return rows


def collate_left_pad(rows):
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r):] = r
        attention_mask[i, width - len(r):] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def main(sg, steps=8, device="cpu", amp=None):
    device_type = device.split(":")[0]
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)

    g = torch.Generator().manual_seed(1)
    train_dataloader = DataLoader(synthetic_dataset(16, g), shuffle=True, batch_size=4, collate_fn=collate_left_pad)

    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)

    num_epochs = math.ceil(steps / len(train_dataloader))
    num_training_steps = num_epochs * len(train_dataloader)
    lr_scheduler = get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=2, num_training_steps=num_training_steps
    )

    model.to(device)
    sg.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    @sg.compile
    def train_step(batch):
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            outputs = model(**batch)
        loss = outputs.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        return loss

    calls = 0
    model.train()
    for epoch in range(num_epochs):
        for batch in train_dataloader:
            if calls >= steps:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = train_step(batch)
            calls += 1
            sg.log(loss)
