"""pytorch/examples word_language_model: an LSTM language model trained with hand-written SGD
(``p.data.add_(p.grad, alpha=-lr)``, ``lr`` a module-level float annealed by the epoch loop),
gradient clipping, hidden state carried (detached) across batches, evaluation between epochs.

Model: vendor/pytorch_examples/word_language_model_model.py (verbatim). Loop: main.py's
``train()`` body (lines 163-194) and its epoch loop (``lr /= 4.0`` when validation loss does
not improve), on synthetic token data.
"""
import torch
import torch.nn as nn

from clients.vendor.pytorch_examples.word_language_model_model import RNNModel

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/word_language_model/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("rnn", "lstm", "lm", "global-lr", "manual-sgd", "clip")


class args:  # argparse defaults of main.py, scaled down
    model = "LSTM"; emsize = 32; nhid = 32; nlayers = 2; lr = 20.0; clip = 0.25
    bptt = 12; dropout = 0.2; tied = False; batch_size = 4


ntokens = 50
model = None
criterion = None
lr = args.lr


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""

    if isinstance(h, torch.Tensor):
        return h.detach()
    else:
        return tuple(repackage_hidden(v) for v in h)


def evaluate(data_source, eval_batch_size):
    model.eval()
    total_loss = 0.
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        output, hidden = model(data_source[:-1], hidden)
        total_loss += len(data_source) * criterion(output, data_source[1:].view(-1)).item()
    return total_loss / (len(data_source) - 1)


def main(sg, steps=8, device="cpu", amp=None):
    global model, criterion, lr
    model = RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout, args.tied).to(device)
    criterion = nn.NLLLoss()
    sg.track(model=model)

    @sg.compile
    def train_step(data, targets, hidden):
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        return loss, hidden

    g = torch.Generator().manual_seed(1)
    stream = torch.randint(0, ntokens, (steps * args.bptt + 1, args.batch_size), generator=g).to(device)
    val = torch.randint(0, ntokens, (args.bptt + 1, 2), generator=g).to(device)
    best_val_loss = None
    per_epoch = 3
    hidden = model.init_hidden(args.batch_size)
    for it in range(steps):
        if it % per_epoch == 0:
            model.train()
        i = it * args.bptt
        data, targets = stream[i:i + args.bptt], stream[i + 1:i + 1 + args.bptt].reshape(-1)
        loss, hidden = train_step(data, targets, hidden)
        sg.log(loss)
        if it % per_epoch == per_epoch - 1:  # end of an "epoch"
            val_loss = evaluate(val, 2)
            if not best_val_loss or val_loss < best_val_loss:
                best_val_loss = val_loss
            else:
                # Anneal the learning rate if no improvement has been seen in the validation dataset.
                lr /= 4.0
            if it == 2:
                lr /= 4.0  # (the synthetic data always improves: anneal once as a long run would)
