"""pytorch/examples language_translation: a German-to-English ``nn.Transformer`` (encoder-decoder,
post-norm layers, dropout 0.1) between token embeddings with a sinusoidal ``PositionalEncoding``
buffer and a vocabulary projection; masks built inside the step by ``create_mask`` (a float causal
mask from ``triu(...) == 1`` and ``masked_fill(-inf)``, an all-False bool source mask, key padding
masks from ``src == pad_idx``); ``CrossEntropyLoss(ignore_index=<pad>)``; Adam (lr 1e-4, betas (0.9,
0.98), eps 1e-9); ``validate()`` runs ``model.eval()`` without ``no_grad`` between epochs.

Model: vendor/pytorch_examples/language_translation_model.py (verbatim), masks:
language_translation_data.py (``create_mask``, verbatim). Loop: main.py ``train()`` (lines 116-144): the
step function is the per-batch body from ``src = src.to(DEVICE)`` to ``optim.step()``; ``losses +=
loss.item()`` after it runs in the loop on the returned loss; ``validate()`` (lines 153-181) and the
epoch loop of ``main()`` (lines 233-237) are kept. Scaled down: synthetic token batches (seeded),
sequence-first as ``pad_sequence`` makes them, 4-8 tokens between <bos> and <eos> padded to the
batch's longest (a new longest length is a new input shape), batch 8 instead of 128, vocabularies of
40 / 48 tokens, embed 32, 4 heads, 2 + 2 layers, feed-forward 64 instead of 512 / 8 / 5 + 5 / 512;
4 batches an epoch, a 1-batch validation set; no tqdm, no logging files, no checkpoint.
"""
import torch
from torch.nn.utils.rnn import pad_sequence

from clients.vendor.pytorch_examples.language_translation_data import create_mask
from clients.vendor.pytorch_examples.language_translation_model import Translator

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/language_translation/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("transformer", "nn-transformer", "seq2seq", "padding-mask", "causal-mask", "masks-in-step",
        "ignore-index", "adam", "dropout", "eval-with-grad")


class opts:  # argparse defaults of main.py, scaled down
    epochs = 2; lr = 1e-4; batch = 8; attn_heads = 4; enc_layers = 2; dec_layers = 2; embed_size = 32
    dim_feedforward = 64; dropout = 0.1; dry_run = False


special_symbols = {"<unk>": 0, "<pad>": 1, "<bos>": 2, "<eos>": 3}


def main(sg, steps=8, device="cpu", amp=None):
    DEVICE = torch.device(device)
    per_epoch = 4
    opts.epochs = (steps + per_epoch - 1) // per_epoch
    src_vocab_size, tgt_vocab_size = 40, 48
    g = torch.Generator().manual_seed(1)

    def sentence(vocab):  # (_tensor_transform: <bos> + token ids + <eos>)
        n = int(torch.randint(4, 9, (), generator=g))
        return torch.cat((torch.tensor([special_symbols["<bos>"]]), torch.randint(4, vocab, (n,), generator=g),
                          torch.tensor([special_symbols["<eos>"]])))

    def batch():  # (_collate_fn)
        src_batch = [sentence(src_vocab_size) for _ in range(opts.batch)]
        tgt_batch = [sentence(tgt_vocab_size) for _ in range(opts.batch)]
        return (pad_sequence(src_batch, padding_value=special_symbols["<pad>"]),
                pad_sequence(tgt_batch, padding_value=special_symbols["<pad>"]))
    train_dl = [batch() for _ in range(steps)]
    valid_dl = [batch()]

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

    # Set up our learning tools
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=special_symbols["<pad>"])

    # These special values are from the "Attention is all you need" paper
    optim = torch.optim.Adam(model.parameters(), lr=opts.lr, betas=(0.9, 0.98), eps=1e-9)
    sg.track(model=model, optim=optim)

    @sg.compile
    def train_step(src, tgt):
        src = src.to(DEVICE)
        tgt = tgt.to(DEVICE)

        # We need to reshape the input slightly to fit into the transformer
        tgt_input = tgt[:-1, :]

        # Create masks
        src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input, special_symbols["<pad>"], DEVICE)

        # Pass into model, get probability over the vocab out
        logits = model(src, tgt_input, src_mask, tgt_mask,src_padding_mask, tgt_padding_mask, src_padding_mask)

        # Reset gradients before we try to compute the gradients over the loss
        optim.zero_grad()

        # Get original shape back
        tgt_out = tgt[1:, :]

        # Compute loss and gradient over that loss
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
        loss.backward()

        # Step weights
        optim.step()
        return loss

    def train(model, train_dl, loss_fn, optim, special_symbols, opts):
        losses = 0
        model.train()
        for src, tgt in train_dl:
            loss = train_step(src, tgt)
            sg.log(loss)
            losses += loss.item()
            if opts.dry_run:
                break
        return losses / len(list(train_dl))

    def validate(model, valid_dl, loss_fn, special_symbols):
        losses = 0
        model.eval()
        for src, tgt in valid_dl:
            src = src.to(DEVICE)
            tgt = tgt.to(DEVICE)
            tgt_input = tgt[:-1, :]
            src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input, special_symbols["<pad>"], DEVICE)
            logits = model(src, tgt_input, src_mask, tgt_mask,src_padding_mask, tgt_padding_mask, src_padding_mask)
            tgt_out = tgt[1:, :]
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            losses += loss.item()
        return losses / len(list(valid_dl))

    best_val_loss = 1e6
    for idx, epoch in enumerate(range(1, opts.epochs+1)):
        train_loss = train(model, train_dl[idx * per_epoch:(idx + 1) * per_epoch], loss_fn, optim, special_symbols, opts)
        val_loss   = validate(model, valid_dl, loss_fn, special_symbols)
        sg.log((train_loss, val_loss))
        if val_loss < best_val_loss:
            best_val_loss = val_loss
