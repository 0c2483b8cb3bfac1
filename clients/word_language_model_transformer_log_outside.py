"""pytorch/examples word_language_model ``--model Transformer`` as the corpus client
``word_language_model_transformer``, with the fix that stepgraph's CaptureError names applied
("update total_loss outside the step (in the loop around it)"): the per-batch body keeps
``total_loss += loss.item()``, and the ``log_interval`` block -- the progress print,
``total_loss = 0`` and ``start_time = time.time()`` -- moves from the compiled body to the loop of
``train()`` right after the call. Everything else (model, data, sizes, epoch loop) is
``word_language_model_transformer``'s.

Source: https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/word_language_model/main.py
(BSD-3-Clause). Restated after the source, not copied (the model file vendored verbatim).
"""
import math
import time

import torch
import torch.nn as nn

from clients.vendor.pytorch_examples.word_language_model_model import TransformerModel

SOURCE = ("https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/"
          "word_language_model/main.py")
LICENSE = "BSD-3-Clause"
TAGS = ("transformer", "lm", "nn-transformer", "src-mask-attr", "global-lr", "manual-sgd", "clip",
        "item-in-step", "print-in-step", "time-in-step", "dropout", "ragged-last-batch", "eval-mode", "fix-applied")


class args:  # main.py's argparse values, scaled down
    model = "Transformer"; emsize = 32; nhid = 32; nlayers = 2; lr = 20.0; clip = 0.25
    epochs = 40; batch_size = 4; bptt = 12; dropout = 0.2; tied = False; log_interval = 2
    nhead = 2; dry_run = False; use_optimizer = False


device = torch.device("cpu")
eval_batch_size = 10
ntokens = 50
model = criterion = train_data = val_data = None
lr = args.lr
epoch = 0


def batchify(data, bsz):
    # columns of the token stream, one per batch entry
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def evaluate(data_source):
    model.eval()
    total_loss = 0.
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output = model(data)
            output = output.view(-1, ntokens)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def main(sg, steps=8, device="cpu", amp=None):
    global model, criterion, train_data, val_data, lr, epoch
    globals()["device"] = torch.device(device)

    g = torch.Generator().manual_seed(1)
    train_stream = torch.randint(0, ntokens, (29 * args.batch_size + 3,), generator=g)
    val_stream = torch.randint(0, ntokens, (25 * eval_batch_size,), generator=g)
    train_data = batchify(train_stream, args.batch_size)
    val_data = batchify(val_stream, eval_batch_size)

    model = TransformerModel(ntokens, args.emsize, args.nhead, args.nhid, args.nlayers, args.dropout).to(device)
    criterion = nn.NLLLoss()
    optimizer = None
    if args.use_optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sg.track(model=model)
    if optimizer is not None:
        sg.track(optimizer=optimizer)

    total_loss = 0.
    start_time = time.time()
    calls = 0

    @sg.compile
    def train_batch(batch, i):
        nonlocal total_loss
        data, targets = get_batch(train_data, i)
        # (the LSTM path detaches its hidden state here)
        if args.use_optimizer:
            optimizer.zero_grad()
        else:
            model.zero_grad()
        output = model(data)
        output = output.view(-1, ntokens)
        loss = criterion(output, targets)
        loss.backward()

        # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if args.use_optimizer:
            optimizer.step()
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)

        total_loss += loss.item()
        return loss

    def train():
        nonlocal total_loss, start_time, calls
        model.train()
        total_loss = 0.
        start_time = time.time()
        for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
            if calls >= steps:
                return
            loss = train_batch(batch, i)
            calls += 1
            # (moved out of the compiled body: the fix stepgraph names)
            if batch % args.log_interval == 0 and batch > 0:
                cur_loss = total_loss / args.log_interval
                elapsed = time.time() - start_time
                print('| epoch {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | ms/batch {:5.2f} | '
                      'loss {:5.2f} | ppl {:8.2f}'.format(
                          epoch, batch, len(train_data) // args.bptt, lr,
                          elapsed * 1000 / args.log_interval, cur_loss, math.exp(cur_loss)))
                total_loss = 0
                start_time = time.time()
            sg.log({"loss": loss, "total_loss": total_loss})
            if args.dry_run:
                break

    best_val_loss = None
    for epoch in range(1, args.epochs + 1):
        if calls >= steps:
            break
        train()
        val_loss = evaluate(val_data)
        sg.log({"val_loss": val_loss, "lr": lr})
        if not best_val_loss or val_loss < best_val_loss:
            best_val_loss = val_loss   # (main.py saves the model here)
        else:
            # Anneal the learning rate if no improvement has been seen in the validation dataset.
            lr /= 4.0
        if epoch == 1 and lr == args.lr:
            lr /= 4.0  # (anneal once between epochs 1 and 2 as a long run would, so the step sees lr change)
