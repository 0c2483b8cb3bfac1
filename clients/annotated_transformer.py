"""The Annotated Transformer (harvardnlp): the encoder-decoder Transformer of "Attention Is All You
Need" trained on the notebook's synthetic copy task (``example_simple_model``), with the notebook's
own ``run_epoch`` loop body compiled.

The program: ``make_model(V, V, N=2)`` builds ``EncoderDecoder`` (``Encoder``/``Decoder`` stacks of
``EncoderLayer``/``DecoderLayer`` made by ``clones`` (deepcopy), pre-norm ``SublayerConnection``
with the notebook's own ``LayerNorm`` (``a_2 * (x - mean) / (std + eps) + b_2``, unbiased std),
``MultiHeadedAttention`` (four ``nn.Linear``, ``attention()`` with ``masked_fill(mask == 0, -1e9)``,
softmax, dropout, ``self.attn`` kept on the module), ``PositionwiseFeedForward``, ``Embeddings``
scaled by ``sqrt(d_model)``, sinusoidal ``PositionalEncoding`` buffer + dropout) and ``Generator``
(linear + log_softmax), xavier_uniform_ on every parameter with dim > 1. The criterion is
``LabelSmoothing(size=V, padding_idx=0, smoothing=0.0)``: ``KLDivLoss(reduction="sum")`` against a
target distribution built from ``x.data.clone()`` with ``fill_``, ``scatter_``, the padding column
zeroed, the rows of padding targets found with ``torch.nonzero(target.data == padding_idx)`` and
zeroed with ``index_fill_``, and the distribution kept as ``self.true_dist``.
``SimpleLossCompute(model.generator, criterion)`` returns ``(sloss.data * norm, sloss)``.
``torch.optim.Adam(lr=0.5, betas=(0.9, 0.98), eps=1e-9)`` with ``LambdaLR`` over the notebook's
``rate(step, model_size=d_model, factor=1.0, warmup=400)`` (inverse-square-root warm-up), stepped
once per batch. ``data_gen(V, batch_size, nbatches)`` yields ``Batch(src, tgt, 0)`` (``src_mask``,
``tgt``/``tgt_y`` shifted, ``make_std_mask`` with ``subsequent_mask``, ``ntokens`` a 0-dim tensor).
Per epoch: ``model.train()``, ``run_epoch(..., mode="train")``, ``model.eval()``,
``run_epoch(..., DummyOptimizer(), DummyScheduler(), mode="eval")``.

``run_epoch``'s per-batch body is what is compiled: forward, ``loss_compute``, and in train mode
``loss_node.backward()``, the ``TrainState`` counters (``train_state.step += 1``, ``samples +=
batch.src.shape[0]``, ``tokens += batch.ntokens``), ``if i % accum_iter == 0: optimizer.step();
optimizer.zero_grad(set_to_none=True); n_accum += 1; train_state.accum_step += 1``,
``scheduler.step()``; then ``total_loss += loss``, ``total_tokens += batch.ntokens``, ``tokens +=
batch.ntokens``, and every 40 batches (``i % 40 == 1``) the print of loss per token, tokens/sec
from ``time.time() - start`` and the lr, followed by ``start = time.time(); tokens = 0``; ``del
loss; del loss_node``. The one restructuring: ``run_epoch``'s locals (``start``, ``total_tokens``,
``total_loss``, ``tokens``, ``n_accum``) live in ``main``'s scope, reset by ``run_epoch`` at its
start (``nonlocal``), so that the step is defined once, taking the batch, the loss compute, the
optimizer, the scheduler, ``mode``, ``accum_iter`` and the train state as arguments exactly as
``run_epoch`` receives them. The eval epoch calls the same step (the program's one ``run_epoch``)
with the dummies and ``mode="eval"``.

Source: https://github.com/harvardnlp/annotated-transformer/blob/debc9fd747bb2123160a98046ad1c2d4da44a567/the_annotated_transformer.py
MIT licence. Restated after the source, not copied: same classes, names, init, ops and order.
Deviations / scale: N=2 as in the example; d_model 512 -> 32, d_ff 2048 -> 64, h 8 -> 4,
PositionalEncoding max_len 5000 -> 64; batch_size 80 -> 8; nbatches per epoch 20 -> 4 (train) and
5 -> 1 (eval); the step count is cut at ``steps`` calls of the step (train and eval calls counted);
no final ``greedy_decode``.
"""
import copy
import math
import time

import torch
import torch.nn as nn
from torch.nn.functional import log_softmax
from torch.optim.lr_scheduler import LambdaLR

SOURCE = ("https://github.com/harvardnlp/annotated-transformer/blob/debc9fd747bb2123160a98046ad1c2d4da44a567/"
          "the_annotated_transformer.py")
LICENSE = "MIT"
TAGS = ("transformer", "seq2seq", "label-smoothing", "nonzero", "lambda-lr", "lr-scheduler-per-step",
        "adam", "python-counters", "print-in-step", "clock-in-step", "module-attr-tensor", "dummy-optimizer",
        "eval-through-step")

D_MODEL, D_FF, H = 32, 64, 4
MAX_LEN = 64
N_TRAIN_BATCHES, N_EVAL_BATCHES = 4, 1


class DummyOptimizer(torch.optim.Optimizer):
    def __init__(self):
        self.param_groups = [{"lr": 0}]
        None

    def step(self):
        None

    def zero_grad(self, set_to_none=False):
        None


class DummyScheduler:
    def step(self):
        None


class EncoderDecoder(nn.Module):
    def __init__(self, encoder, decoder, src_embed, tgt_embed, generator):
        super(EncoderDecoder, self).__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator

    def forward(self, src, tgt, src_mask, tgt_mask):
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)

    def encode(self, src, src_mask):
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)


class Generator(nn.Module):
    def __init__(self, d_model, vocab):
        super(Generator, self).__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        return log_softmax(self.proj(x), dim=-1)


def clones(module, N):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


class LayerNorm(nn.Module):
    def __init__(self, features, eps=1e-6):
        super(LayerNorm, self).__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class Encoder(nn.Module):
    def __init__(self, layer, N):
        super(Encoder, self).__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class SublayerConnection(nn.Module):
    def __init__(self, size, dropout):
        super(SublayerConnection, self).__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class EncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout):
        super(EncoderLayer, self).__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 2)
        self.size = size

    def forward(self, x, mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
        return self.sublayer[1](x, self.feed_forward)


class Decoder(nn.Module):
    def __init__(self, layer, N):
        super(Decoder, self).__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, memory, src_mask, tgt_mask):
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class DecoderLayer(nn.Module):
    def __init__(self, size, self_attn, src_attn, feed_forward, dropout):
        super(DecoderLayer, self).__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 3)

    def forward(self, x, memory, src_mask, tgt_mask):
        m = memory
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask))
        x = self.sublayer[1](x, lambda x: self.src_attn(x, m, m, src_mask))
        return self.sublayer[2](x, self.feed_forward)


def subsequent_mask(size):
    attn_shape = (1, size, size)
    subsequent_mask = torch.triu(torch.ones(attn_shape), diagonal=1).type(torch.uint8)
    return subsequent_mask == 0


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super(MultiHeadedAttention, self).__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)
        nbatches = query.size(0)
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value))
        ]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query
        del key
        del value
        return self.linears[-1](x)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super(PositionwiseFeedForward, self).__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(self.w_1(x).relu()))


class Embeddings(nn.Module):
    def __init__(self, d_model, vocab):
        super(Embeddings, self).__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        return self.lut(x) * math.sqrt(self.d_model)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout, max_len=MAX_LEN):
        super(PositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0)
        self.register_buffer("pe", pe)

    def forward(self, x):
        x = x + self.pe[:, : x.size(1)].requires_grad_(False)
        return self.dropout(x)


def make_model(src_vocab, tgt_vocab, N=6, d_model=D_MODEL, d_ff=D_FF, h=H, dropout=0.1):
    c = copy.deepcopy
    attn = MultiHeadedAttention(h, d_model)
    ff = PositionwiseFeedForward(d_model, d_ff, dropout)
    position = PositionalEncoding(d_model, dropout)
    model = EncoderDecoder(
        Encoder(EncoderLayer(d_model, c(attn), c(ff), dropout), N),
        Decoder(DecoderLayer(d_model, c(attn), c(attn), c(ff), dropout), N),
        nn.Sequential(Embeddings(d_model, src_vocab), c(position)),
        nn.Sequential(Embeddings(d_model, tgt_vocab), c(position)),
        Generator(d_model, tgt_vocab),
    )
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


class Batch:
    """A batch of data with its masks, as the notebook makes it."""

    def __init__(self, src, tgt=None, pad=2):  # 2 = <blank>
        self.src = src
        self.src_mask = (src != pad).unsqueeze(-2)
        if tgt is not None:
            self.tgt = tgt[:, :-1]
            self.tgt_y = tgt[:, 1:]
            self.tgt_mask = self.make_std_mask(self.tgt, pad)
            self.ntokens = (self.tgt_y != pad).data.sum()

    @staticmethod
    def make_std_mask(tgt, pad):
        tgt_mask = (tgt != pad).unsqueeze(-2)
        tgt_mask = tgt_mask & subsequent_mask(tgt.size(-1)).type_as(tgt_mask.data)
        return tgt_mask


class TrainState:
    """Track number of steps, examples, and tokens processed"""

    step: int = 0
    accum_step: int = 0
    samples: int = 0
    tokens: int = 0


def rate(step, model_size, factor, warmup):
    if step == 0:
        step = 1
    return factor * (model_size ** (-0.5) * min(step ** (-0.5), step * warmup ** (-1.5)))


class LabelSmoothing(nn.Module):
    def __init__(self, size, padding_idx, smoothing=0.0):
        super(LabelSmoothing, self).__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.padding_idx = padding_idx
        self.confidence = 1.0 - smoothing
        self.smoothing = smoothing
        self.size = size
        self.true_dist = None

    def forward(self, x, target):
        assert x.size(1) == self.size
        true_dist = x.data.clone()
        true_dist.fill_(self.smoothing / (self.size - 2))
        true_dist.scatter_(1, target.data.unsqueeze(1), self.confidence)
        true_dist[:, self.padding_idx] = 0
        mask = torch.nonzero(target.data == self.padding_idx)
        if mask.dim() > 0:
            true_dist.index_fill_(0, mask.squeeze(), 0.0)
        self.true_dist = true_dist
        return self.criterion(x, true_dist.clone().detach())


def data_gen(V, batch_size, nbatches, device):
    for i in range(nbatches):
        data = torch.randint(1, V, size=(batch_size, 10))
        data[:, 0] = 1
        src = data.requires_grad_(False).clone().detach().to(device)
        tgt = data.requires_grad_(False).clone().detach().to(device)
        yield Batch(src, tgt, 0)


class SimpleLossCompute:
    def __init__(self, generator, criterion):
        self.generator = generator
        self.criterion = criterion

    def __call__(self, x, y, norm):
        x = self.generator(x)
        sloss = self.criterion(x.contiguous().view(-1, x.size(-1)), y.contiguous().view(-1)) / norm
        return sloss.data * norm, sloss


def main(sg, steps=8, device="cpu", amp=None):
    V = 11
    criterion = LabelSmoothing(size=V, padding_idx=0, smoothing=0.0)
    model = make_model(V, V, N=2).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5, betas=(0.9, 0.98), eps=1e-9)
    lr_scheduler = LambdaLR(
        optimizer=optimizer,
        lr_lambda=lambda step: rate(step, model_size=model.src_embed[0].d_model, factor=1.0, warmup=400),
    )
    sg.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    # run_epoch's locals (see the module docstring)
    start = total_tokens = total_loss = tokens = n_accum = 0

    @sg.compile
    def run_batch(i, batch, model, loss_compute, optimizer, scheduler, mode, accum_iter, train_state):
        nonlocal start, total_tokens, total_loss, tokens, n_accum
        out = model.forward(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        loss, loss_node = loss_compute(out, batch.tgt_y, batch.ntokens)
        # loss_node = loss_node / accum_iter
        if mode == "train" or mode == "train+log":
            loss_node.backward()
            train_state.step += 1
            train_state.samples += batch.src.shape[0]
            train_state.tokens += batch.ntokens
            if i % accum_iter == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                n_accum += 1
                train_state.accum_step += 1
            scheduler.step()

        total_loss += loss
        total_tokens += batch.ntokens
        tokens += batch.ntokens
        if i % 40 == 1 and (mode == "train" or mode == "train+log"):
            lr = optimizer.param_groups[0]["lr"]
            elapsed = time.time() - start
            print(
                ("Epoch Step: %6d | Accumulation Step: %3d | Loss: %6.2f "
                 + "| Tokens / Sec: %7.1f | Learning Rate: %6.1e")
                % (i, n_accum, loss / batch.ntokens, tokens / elapsed, lr)
            )
            start = time.time()
            tokens = 0
        del loss
        del loss_node
        return total_loss

    calls = 0

    def run_epoch(data_iter, model, loss_compute, optimizer, scheduler, mode="train", accum_iter=1,
                  train_state=TrainState()):
        nonlocal start, total_tokens, total_loss, tokens, n_accum, calls
        start = time.time()
        total_tokens = 0
        total_loss = 0
        tokens = 0
        n_accum = 0
        for i, batch in enumerate(data_iter):
            if calls == steps:
                break
            tl = run_batch(i, batch, model, loss_compute, optimizer, scheduler, mode, accum_iter, train_state)
            calls += 1
            sg.log((tl, total_tokens, tokens, n_accum, train_state.step, train_state.accum_step,
                    train_state.samples, train_state.tokens, optimizer.param_groups[0]["lr"]))
        return total_loss / total_tokens, train_state

    batch_size = 8
    epoch = 0
    while calls < steps:
        model.train()
        run_epoch(data_gen(V, batch_size, N_TRAIN_BATCHES, device), model,
                  SimpleLossCompute(model.generator, criterion), optimizer, lr_scheduler, mode="train")
        if calls == steps:
            break
        model.eval()
        sg.log(run_epoch(data_gen(V, batch_size, N_EVAL_BATCHES, device), model,
                         SimpleLossCompute(model.generator, criterion), DummyOptimizer(), DummyScheduler(),
                         mode="eval")[0])
        epoch += 1
