"""karpathy/nanoGPT's train.py with its whole iteration compiled, as a user applying the corpus
client ``nanogpt``'s CaptureError fix would write it: the loop body from "determine and set the
learning rate for this iteration" (``lr = get_lr(iter_num)``, assigned to every param group)
through the micro-step loop, ``clip_grad_norm_``, the scaler step and ``zero_grad`` is the
compiled step, with ``iter_num`` passed in; the batches ``get_batch`` draws with ``torch.randint``
(a random read the step cannot replay) are fetched outside it, one per micro-step, in the order
train.py draws them. The lr is computed inside the step from ``iter_num``: warm-up, cosine and
floor branches of ``get_lr``.

Model: vendor/nanogpt/model.py (verbatim). Loop: train.py lines 255-334 at 3adf61e, as in
``nanogpt.py`` (same scaled-down config), with the two changes above.
"""
import math
from contextlib import nullcontext

import numpy as np
import torch

from clients.vendor.nanogpt.model import GPTConfig, GPT

SOURCE = "https://github.com/karpathy/nanoGPT/blob/3adf61e/train.py"
LICENSE = "MIT"
TAGS = ("transformer", "gpt", "lm", "grad-accum", "manual-lr", "lr-in-step", "cosine-warmup", "autocast",
        "grad-scaler", "clip", "adamw", "weight-decay-groups", "dropout", "eval-mode")

# -----------------------------------------------------------------------------
# train.py's config values, scaled down
eval_interval = 4
eval_iters = 2
gradient_accumulation_steps = 2
batch_size = 4
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.1
bias = False
learning_rate = 6e-4
max_iters = 8
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2
lr_decay_iters = 8
min_lr = 6e-5
device = 'cpu'
dtype = 'float32'
meta_vocab_size = 64
# -----------------------------------------------------------------------------

device_type = 'cpu'
ctx = nullcontext()
train_data = val_data = None
model = optimizer = scaler = None


# poor man's data loader
def get_batch(split):
    # (train.py re-opens np.memmap(train.bin / val.bin) here; the synthetic arrays stand in for them)
    if split == 'train':
        data = train_data
    else:
        data = val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i+block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i+1:i+1+block_size]).astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        # pin arrays x,y, which allows us to move them to GPU asynchronously (non_blocking=True)
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


# helps estimate an arbitrarily accurate loss over either split using many batches
@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


# learning rate decay scheduler (cosine with warmup)
def get_lr(it):
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


def main(sg, steps=8, device="cpu", amp=None):
    global train_data, val_data, model, optimizer, scaler, ctx, device_type, dtype
    globals()['device'] = device
    dtype = 'bfloat16' if amp == "bf16" else 'float32'

    # synthetic stand-ins for data/<dataset>/train.bin and val.bin (uint16 token ids)
    g = torch.Generator().manual_seed(1)
    train_data = torch.randint(0, meta_vocab_size, (4096,), generator=g).numpy().astype(np.uint16)
    val_data = torch.randint(0, meta_vocab_size, (512,), generator=g).numpy().astype(np.uint16)

    device_type = 'cuda' if 'cuda' in device else 'cpu' # for later use in torch.autocast
    # note: float16 data type will automatically use a GradScaler
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
    ctx = nullcontext() if dtype == 'float32' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

    iter_num = 0
    best_val_loss = 1e9

    # model init
    model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                      bias=bias, vocab_size=None, dropout=dropout) # start with model_args from command line
    model_args['vocab_size'] = meta_vocab_size if meta_vocab_size is not None else 50304
    gptconf = GPTConfig(**model_args)
    model = GPT(gptconf)
    model.to(device)

    # initialize a GradScaler. If enabled=False scaler is a no-op
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))

    # optimizer
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
    sg.track(model=model, optimizer=optimizer, scaler=scaler)

    @sg.compile
    def train_step(iter_num, batches):
        # determine and set the learning rate for this iteration
        lr = get_lr(iter_num) if decay_lr else learning_rate
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        # forward backward update, with optional gradient accumulation to simulate larger batch size
        # and using the GradScaler if data type is float16
        for micro_step in range(gradient_accumulation_steps):
            X, Y = batches[micro_step]   # (fetched outside the step: get_batch draws with torch.randint)
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps # scale the loss to account for gradient accumulation
            # backward pass, with gradient scaling if training in fp16
            scaler.scale(loss).backward()
        # clip the gradient
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        # step the optimizer and scaler if training in fp16
        scaler.step(optimizer)
        scaler.update()
        # flush the gradients as soon as we can, no need for this memory anymore
        optimizer.zero_grad(set_to_none=True)
        return loss, lr

    # training loop
    X, Y = get_batch('train') # fetch the very first batch
    for _ in range(steps):

        # evaluate the loss on train/val sets (train.py also writes checkpoints here)
        if iter_num % eval_interval == 0:
            losses = estimate_loss()
            if losses['val'] < best_val_loss:
                best_val_loss = losses['val']

        # the micro-steps' batches, drawn in train.py's order (the first one prefetched)
        batches = [(X, Y)]
        for _micro in range(gradient_accumulation_steps):
            X, Y = get_batch('train')
            batches.append((X, Y))
        X, Y = batches.pop()
        loss, lr = train_step(iter_num, batches)

        # get loss as float. note: this is a CPU-GPU sync point
        # scale up to undo the division above, approximating the true total loss (exact would have been a sum)
        lossf = loss.item() * gradient_accumulation_steps
        sg.log({"loss": loss, "lossf": lossf, "lr": lr})
        iter_num += 1
