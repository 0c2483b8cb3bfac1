"""pytorch/examples language_translation: a German->English ``nn.Transformer`` seq2seq trained on
Multi30k. Model (src/model.py): ``Translator`` -- ``src_embedding``/``tgt_embedding``
(``nn.Embedding``), ``PositionalEncoding`` (a sin/cos ``pos_embedding`` buffer of shape
(maxlen, 1, emb), dropout), ``nn.Transformer(d_model, nhead, num_encoder_layers,
num_decoder_layers, dim_feedforward, dropout)`` called positionally with ``src_mask``,
``tgt_mask``, ``memory_mask=None``, the two padding masks and ``memory_key_padding_mask`` (the
source padding mask), the output ``ff`` Linear; ``_init_weights``: xavier_uniform on every
parameter with ``dim() > 1``. Data (src/data.py): ``special_symbols`` <unk> 0, <pad> 1, <bos> 2,
<eos> 3; ``_seq_transform(tokenizer, vocab, _tensor_transform)`` (bos + ids + eos by
``torch.cat`` of ``torch.tensor``s); ``_collate_fn`` with ``pad_sequence(padding_value=<pad>)``
(sequence-first batches); ``generate_square_subsequent_mask`` (``triu(ones) == 1``, transposed,
``masked_fill`` to -inf / 0.0) and ``create_mask`` (``tgt_mask`` float causal, ``src_mask`` bool
zeros, ``src_padding_mask = (src == pad_idx).transpose(0, 1)``, the same for tgt).

Loop (main.py): ``loss_fn = CrossEntropyLoss(ignore_index=<pad>)``, ``Adam(lr, betas=(0.9, 0.98),
eps=1e-9)``; per epoch ``train()`` (``losses = 0``, ``model.train()``, ``for src, tgt in
tqdm(train_dl, ascii=True)``: ``.to(DEVICE)``, ``tgt_input = tgt[:-1, :]``, ``create_mask``, the
model, ``optim.zero_grad()``, ``tgt_out = tgt[1:, :]``, the loss on ``reshape(-1, ...)``,
``loss.backward()``, ``optim.step()``, ``losses += loss.item()``; returns ``losses /
len(list(train_dl))``), then ``validate()`` (``model.eval()``, the same forward without
backward -- main.py does not wrap it in no_grad -- ``losses += loss.item()``), the best-val
bookkeeping and the epoch log line (``logger.info``).

What a user of stepgraph changes: the per-batch body of ``train()`` is ``train_batch(src, tgt)``
decorated with ``sg.compile`` (= ``@stepgraph.compile``); ``losses``, the local of ``train()``
the body adds to, is a ``nonlocal`` of the function holding both.

Scaled down / replaced: Multi30k, spacy tokenizers and torchtext vocab are replaced by synthetic
"sentences" of 3-6 words (``str.split`` as the tokenizer, a dict lookup with <unk> default as the
vocab), 16 train / 8 valid pairs, batch 4 (128), so batches have a few padded lengths as real
data has; vocab 40 + 4 specials per language; enc_layers 2 (5), dec_layers 2 (5), embed_size 32
(512), attn_heads 4 (8), dim_feedforward 32 (512), dropout 0.1, lr 1e-4; 2 epochs = 8 calls;
no ``torch.save`` of best.pt / last.pt, logging to no file, the tqdm bars made with
``disable=True`` (they wrap the loaders, outside the step).

Source: https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/language_translation/main.py
(and src/model.py, src/data.py at that commit; BSD-3-Clause). Restated after the source, not
copied: same modules, names, ops, init and loop semantics.
"""
import logging
import math
from time import time

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(it, **kw):
        return it

SOURCE = ("https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/"
          "language_translation/main.py")
LICENSE = "BSD-3-Clause"
TAGS = ("transformer", "seq2seq", "nn-transformer", "translation", "padding-mask", "causal-mask",
        "ignore-index", "adam", "item-in-step", "dropout", "variable-length", "eval-mode", "tqdm")

DEVICE = torch.device("cpu")
logger = logging.getLogger(__name__)


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size, dropout, maxlen=5000):
        super(PositionalEncoding, self).__init__()
        den = torch.exp(- torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        pos_embedding = pos_embedding.unsqueeze(-2)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer('pos_embedding', pos_embedding)

    def forward(self, token_embedding):
        return self.dropout(token_embedding + self.pos_embedding[:token_embedding.size(0), :])


class Translator(nn.Module):
    def __init__(self, num_encoder_layers, num_decoder_layers, embed_size, num_heads,
                 src_vocab_size, tgt_vocab_size, dim_feedforward, dropout):
        super(Translator, self).__init__()
        self.src_embedding = nn.Embedding(src_vocab_size, embed_size)
        self.tgt_embedding = nn.Embedding(tgt_vocab_size, embed_size)
        self.pos_enc = PositionalEncoding(embed_size, dropout)
        self.transformer = nn.Transformer(
            d_model=embed_size,
            nhead=num_heads,
            num_encoder_layers=num_encoder_layers,
            num_decoder_layers=num_decoder_layers,
            dim_feedforward=dim_feedforward,
            dropout=dropout
        )
        self.ff = nn.Linear(embed_size, tgt_vocab_size)
        self._init_weights()

    def _init_weights(self):
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, memory_key_padding_mask):
        src_emb = self.pos_enc(self.src_embedding(src))
        tgt_emb = self.pos_enc(self.tgt_embedding(trg))
        outs = self.transformer(
            src_emb,
            tgt_emb,
            src_mask,
            tgt_mask,
            None,
            src_padding_mask,
            tgt_padding_mask,
            memory_key_padding_mask
        )
        return self.ff(outs)


# ---------------------------------------------------------------- src/data.py, over synthetic text

special_symbols = {"<unk>": 0, "<pad>": 1, "<bos>": 2, "<eos>": 3}


def synthetic_pairs(n, g, words=40):
    pairs = []
    for _ in range(n):
        ls = int(torch.randint(3, 7, (1,), generator=g))
        lt = int(torch.randint(3, 7, (1,), generator=g))
        src = " ".join(f"d{int(t)}" for t in torch.randint(0, words, (ls,), generator=g))
        tgt = " ".join(f"e{int(t)}" for t in torch.randint(0, words, (lt,), generator=g))
        pairs.append((src + "\n", tgt + "\n"))
    return pairs


def get_data(opts, g):
    train_iterator = synthetic_pairs(16, g)
    valid_iterator = synthetic_pairs(8, g)

    # (spacy tokenizers -> str.split; torchtext vocab -> a dict with <unk> as the default index)
    src_tokenizer = tgt_tokenizer = str.split
    src_stoi = {**special_symbols, **{f"d{i}": 4 + i for i in range(40)}}
    tgt_stoi = {**special_symbols, **{f"e{i}": 4 + i for i in range(40)}}

    def src_vocab(tokens):
        return [src_stoi.get(t, special_symbols["<unk>"]) for t in tokens]

    def tgt_vocab(tokens):
        return [tgt_stoi.get(t, special_symbols["<unk>"]) for t in tokens]

    def _seq_transform(*transforms):
        def func(txt_input):
            for transform in transforms:
                txt_input = transform(txt_input)
            return txt_input
        return func

    def _tensor_transform(token_ids):
        return torch.cat(
            (torch.tensor([special_symbols["<bos>"]]),
             torch.tensor(token_ids),
             torch.tensor([special_symbols["<eos>"]]))
        )

    src_lang_transform = _seq_transform(src_tokenizer, src_vocab, _tensor_transform)
    tgt_lang_transform = _seq_transform(tgt_tokenizer, tgt_vocab, _tensor_transform)

    def _collate_fn(batch):
        src_batch, tgt_batch = [], []
        for src_sample, tgt_sample in batch:
            src_batch.append(src_lang_transform(src_sample.rstrip("\n")))
            tgt_batch.append(tgt_lang_transform(tgt_sample.rstrip("\n")))
        src_batch = pad_sequence(src_batch, padding_value=special_symbols["<pad>"])
        tgt_batch = pad_sequence(tgt_batch, padding_value=special_symbols["<pad>"])
        return src_batch, tgt_batch

    train_dataloader = DataLoader(train_iterator, batch_size=opts.batch, collate_fn=_collate_fn)
    valid_dataloader = DataLoader(valid_iterator, batch_size=opts.batch, collate_fn=_collate_fn)
    return (train_dataloader, valid_dataloader, src_stoi, tgt_stoi, src_lang_transform,
            tgt_lang_transform, special_symbols)


def generate_square_subsequent_mask(size, device):
    mask = (torch.triu(torch.ones((size, size), device=device)) == 1).transpose(0, 1)
    mask = mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
    return mask


def create_mask(src, tgt, pad_idx, device):
    src_seq_len = src.shape[0]
    tgt_seq_len = tgt.shape[0]
    tgt_mask = generate_square_subsequent_mask(tgt_seq_len, device)
    src_mask = torch.zeros((src_seq_len, src_seq_len), device=device).type(torch.bool)
    src_padding_mask = (src == pad_idx).transpose(0, 1)
    tgt_padding_mask = (tgt == pad_idx).transpose(0, 1)
    return src_mask, tgt_mask, src_padding_mask, tgt_padding_mask


class opts:  # main.py's argparse values, scaled down
    src = "de"; tgt = "en"; epochs = 30; lr = 1e-4; batch = 4; backend = "cpu"
    attn_heads = 4; enc_layers = 2; dec_layers = 2; embed_size = 32; dim_feedforward = 32; dropout = 0.1
    dry_run = False


def main(sg, steps=8, device="cpu", amp=None):
    global DEVICE
    DEVICE = torch.device(device)

    g = torch.Generator().manual_seed(1)
    train_dl, valid_dl, src_vocab, tgt_vocab, _, _, special_symbols_ = get_data(opts, g)
    src_vocab_size = len(src_vocab)
    tgt_vocab_size = len(tgt_vocab)

    model = Translator(
        num_encoder_layers=opts.enc_layers,
        num_decoder_layers=opts.dec_layers,
        embed_size=opts.embed_size,
        num_heads=opts.attn_heads,
        src_vocab_size=src_vocab_size,
        tgt_vocab_size=tgt_vocab_size,
        dim_feedforward=opts.dim_feedforward,
        dropout=opts.dropout
    ).to(DEVICE)

    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=special_symbols_["<pad>"])
    # the "Attention is all you need" values
    optim = torch.optim.Adam(model.parameters(), lr=opts.lr, betas=(0.9, 0.98), eps=1e-9)
    sg.track(model=model, optim=optim)

    losses = 0
    calls = 0

    @sg.compile
    def train_batch(src, tgt):
        nonlocal losses
        src = src.to(DEVICE)
        tgt = tgt.to(DEVICE)
        tgt_input = tgt[:-1, :]
        src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input, special_symbols_["<pad>"], DEVICE)
        logits = model(src, tgt_input, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, src_padding_mask)
        optim.zero_grad()
        tgt_out = tgt[1:, :]
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
        loss.backward()
        optim.step()
        losses += loss.item()
        return loss

    def train(model, train_dl, loss_fn, optim, special_symbols, opts):
        nonlocal losses, calls
        losses = 0
        model.train()
        for src, tgt in tqdm(train_dl, ascii=True, disable=True):
            if calls >= steps:
                break
            loss = train_batch(src, tgt)
            calls += 1
            sg.log({"loss": loss, "losses": losses})
            if opts.dry_run:
                break
        return losses / len(list(train_dl))

    def validate(model, valid_dl, loss_fn, special_symbols):
        losses = 0
        model.eval()
        for src, tgt in tqdm(valid_dl, disable=True):
            src = src.to(DEVICE)
            tgt = tgt.to(DEVICE)
            tgt_input = tgt[:-1, :]
            src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input, special_symbols["<pad>"], DEVICE)
            logits = model(src, tgt_input, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, src_padding_mask)
            tgt_out = tgt[1:, :]
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            losses += loss.item()
        return losses / len(list(valid_dl))

    best_val_loss = 1e6
    for idx, epoch in enumerate(range(1, opts.epochs + 1)):
        if calls >= steps:
            break
        start_time = time()
        train_loss = train(model, train_dl, loss_fn, optim, special_symbols_, opts)
        epoch_time = time() - start_time
        val_loss = validate(model, valid_dl, loss_fn, special_symbols_)
        if val_loss < best_val_loss:
            best_val_loss = val_loss   # (main.py saves best.pt here)
        logger.info(f"Epoch: {epoch}\n\tTrain loss: {train_loss:.3f}\n\tVal loss: {val_loss:.3f}")
        sg.log({"train_loss": train_loss, "val_loss": val_loss})
