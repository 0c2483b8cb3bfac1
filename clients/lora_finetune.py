"""microsoft/LoRA: a small causal transformer LM whose attention ``q`` and ``v`` projections are
``loralib.Linear(d, d, r=8, lora_alpha=16, lora_dropout=0.1)`` (README "Additional Notes" 2: the
qkv projection broken up, ``k`` a plain ``nn.Linear``; ``merge_weights=True``, loralib's default),
``lora.mark_only_lora_as_trainable(model)``, trained with the LoRA repo's own GPT-2 fine-tuning loop
(examples/NLG/src/gpt2_ft.py ``train_validate``): the repo's AdamW (``create_adam_optimizer_from_args``:
every parameter in one group, the frozen ones skipped by ``if p.grad is None``; ``state['step']`` a
Python int, ``p.data.addcdiv_``), ``get_linear_schedule_with_warmup`` stepped every step inside
``optimizer_step``, ``avg_lm_loss.update(_lm_loss.item())`` in the step, and ``evaluate`` every
``eval_interval`` steps: ``model.eval()`` -- which MERGES ``B @ A * scaling`` into every LoRA layer's
frozen ``weight.data`` in place -- a no_grad pass over the validation batches, then ``model.train()``,
which subtracts it again (the weight is not bitwise what it was: the next steps train on the
round-tripped weight, as the program does).

Vendored: vendor/loralib/ (loralib/__init__.py, layers.py, utils.py verbatim; examples/NLG/src/optimizer.py
verbatim as nlg_optimizer.py). Loop: gpt2_ft.py lines 122-141 (``optimizer_step``), 143-168 (``evaluate``),
171-258 (``train_validate``), with the hyper-parameters of the repo's E2E command (examples/NLG/README.md:
``--lr 0.0002 --weight_decay 0.01 --correct_bias --adam_beta2 0.999 --scheduler linear --warmup_step 500
--clip 0.0 --lora_dropout 0.1``) except lora_dim/alpha 8/16 as asked. The model is not the repo's GPT-2
(model.py uses ``MergedLinear(..., merge_weights=False)``, which never merges): it is a 2-layer pre-norm
causal transformer written here, with loralib layers where the README puts them. Its randomly initialised
"pretrained" weights stand in for a checkpoint. Scaled down: vocab 64, seq 16, d 32, 2 heads, batch 4,
warmup 500 -> 3, max_step = steps, eval_interval 2000 -> 3, log_interval 100 -> 4, 2 validation batches.
Not reproduced: DistributedSampler, checkpoint saving (``lora.lora_state_dict`` is taken at save_interval
as the program does, the torch.save dropped), printing.
"""
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import clients.vendor.loralib as lora
from clients.vendor.loralib.nlg_optimizer import create_adam_optimizer_from_args, create_optimizer_scheduler

SOURCE = "https://github.com/microsoft/LoRA/blob/c4593f060e6a368d7bb5af5273b8e42810cdef90/examples/NLG/src/gpt2_ft.py"
LICENSE = "MIT"
TAGS = ("lora", "peft", "frozen-weights", "train-eval-switch", "in-place-weight-merge", "custom-adamw",
        "lambda-lr", "item-in-step", "dropout", "transformer", "lm")


class args:  # gpt2_ft.py / optimizer.py argparse defaults and the E2E command line, scaled down
    lr = 0.0002; weight_decay = 0.01; correct_bias = True; adam_epislon = 1e-6; no_decay_bias = False
    adam_beta1 = 0.9; adam_beta2 = 0.999; scheduler = 'linear'; max_step = None; warmup_step = 3
    train_batch_size = 4; valid_batch_size = 4; grad_acc = 1; clip = 0.0; seq_len = 16
    log_interval = 4; eval_interval = 3; save_interval = 6; lora_dim = 8; lora_alpha = 16; lora_dropout = 0.1
    label_smooth = 0.0; fp16 = False; rank = 0; device = 'cpu'


class AverageMeter(object):  # gpt2_ft.py lines 105-121
    """Computes and stores the average and current value
         Imported from https://github.com/pytorch/examples/blob/master/imagenet/main.py#L247-L262
    """
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


class Attention(nn.Module):
    def __init__(self, d, n_head, r, alpha, dropout):
        super().__init__()
        self.n_head = n_head
        # README "Additional Notes" 2: the qkv projection broken up, LoRA on q and v
        self.q_proj = lora.Linear(d, d, r=r, lora_alpha=alpha, lora_dropout=dropout)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = lora.Linear(d, d, r=r, lora_alpha=alpha, lora_dropout=dropout)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d, n_head, r, alpha, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_head, r, alpha, dropout)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LM(nn.Module):
    """(input, lm_labels, lm_mask) -> (logits, per-sequence loss), the call GPT2LMModel makes."""
    def __init__(self, vocab=64, seq=16, d=32, n_head=2, n_layer=2, r=8, alpha=16, dropout=0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, n_head, r, alpha, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, lm_labels, lm_mask, label_smooth=0.0):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.flatten(0, 1), lm_labels.flatten(), reduction='none',
                               label_smoothing=label_smooth).view_as(lm_labels)
        loss = (loss * lm_mask).sum(1) / lm_mask.sum(1)
        return logits, loss


def main(sg, steps=8, device="cpu", amp=None, torch_adamw=False):
    args.device = device
    args.max_step = steps
    g = torch.Generator().manual_seed(110)

    def batch(n):
        tok = torch.randint(0, 64, (n, args.seq_len + 1), generator=g)
        msk = (torch.rand(n, args.seq_len, generator=g) > 0.2).float()
        msk[:, 0] = 1.0
        return {'input': tok[:, :-1], 'target': tok[:, 1:], 'mask': msk}

    train_loader = [batch(args.train_batch_size) for _ in range(steps)]
    valid_loader = [batch(args.valid_batch_size) for _ in range(2)]

    lm_net = LM(r=args.lora_dim, alpha=args.lora_alpha, dropout=args.lora_dropout).to(device)
    if args.lora_dim > 0:
        lora.mark_only_lora_as_trainable(lm_net)
    optimizer = create_adam_optimizer_from_args(lm_net, args)
    if torch_adamw:   # (lora_finetune_torch_adamw: the fix the CLEAR-ERROR names)
        optimizer = torch.optim.AdamW([p for p in lm_net.parameters() if p.requires_grad], lr=args.lr,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epislon,
                                      weight_decay=args.weight_decay)
    scheduler = create_optimizer_scheduler(optimizer, args)
    sg.track(model=lm_net, opt=optimizer, sched=scheduler)

    def optimizer_step(_loss, _optimizer, _model, _schedule, args, is_update=True):
        _loss.backward()

        if is_update:
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(_model.parameters(), args.clip)

            _optimizer.step()
            _optimizer.zero_grad()

        if _schedule is not None:
            _schedule.step()

    def evaluate(model, valid_loader, args):
        model.eval()
        total_loss = 0.
        start_time = time.time()

        avg_lm_loss = AverageMeter()

        with torch.no_grad():
            for idx, data in enumerate(valid_loader):
                data = {key: value for key, value in data.items()}

                _input = data['input'].to(args.device)
                _target = data['target'].to(args.device)
                _msk = data['mask'].to(args.device)

                _lm_logits, _loss = model(_input, lm_labels=_target, lm_mask=_msk)
                loss = _loss.mean()

                avg_lm_loss.update(loss.item())
                sg.log(loss)

            total_time = time.time() - start_time
        return avg_lm_loss.avg, math.exp(avg_lm_loss.avg)

    state = {}

    @sg.compile
    def train_batch(_input, _target, _msk, is_update):
        model, avg_lm_loss = lm_net, state['avg_lm_loss']
        _lm_logits, _lm_loss = model(
            _input, lm_labels=_target, lm_mask=_msk, label_smooth=args.label_smooth
        )

        _lm_loss = _lm_loss.mean()

        avg_lm_loss.update(_lm_loss.item())
        optimizer_step(
            _lm_loss/(args.grad_acc), optimizer, model, scheduler, args, is_update=is_update
        )
        return _lm_loss

    def train_validate(model, optimizer, scheduler, train_loader, valid_loader, args, train_step=0, epoch=0):
        model.train()
        avg_lm_loss = AverageMeter()
        state['avg_lm_loss'] = avg_lm_loss
        log_start_time = time.time()
        best_val_ppl = None

        for idx, data in enumerate(train_loader):
            data = {key: value for key, value in data.items()}

            _input = data['input'].to(args.device)
            _target = data['target'].to(args.device)
            _msk = data['mask'].to(args.device)

            train_step += 1
            is_update = True if train_step % args.grad_acc == 0 else False
            _lm_loss = train_batch(_input, _target, _msk, is_update)
            sg.log(_lm_loss)

            if train_step % args.log_interval == 0:
                elapsed = time.time() - log_start_time
                lr = optimizer.param_groups[0]['lr']
                log_str = f'| epoch {epoch:3d} step {train_step:>8d} | { idx + 1:>6d} batches | ' \
                          f'lr {lr:.3g} | ms/batch {elapsed * 1000 / args.log_interval:5.2f} | ' \
                          f'loss {avg_lm_loss.val:5.2f} | avg loss {avg_lm_loss.avg:5.2f} | ' \
                          f'ppl {math.exp(avg_lm_loss.avg):5.2f}'
                log_start_time = time.time()
                avg_lm_loss.reset()

            if train_step % args.save_interval == 0:
                lora.lora_state_dict(model)  # torch.save({'model_state_dict': ...}, model_path)

            # evaluation interval
            if train_step % args.eval_interval == 0:
                valid_loss, valid_ppl = evaluate(model, valid_loader, args)
                sg.log(valid_loss)
                if best_val_ppl is None or valid_ppl < best_val_ppl:
                    best_val_ppl = valid_ppl
                model.train()

            if train_step == args.max_step:
                break
        return train_step

    train_validate(lm_net, optimizer, scheduler, train_loader, valid_loader, args, train_step=0, epoch=1)
