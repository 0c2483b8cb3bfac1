"""bentrevett/pytorch-sentiment-analysis, notebook 2: "Upgraded Sentiment Analysis" (the
torchtext-legacy edition kept under ``legacy/``): IMDB sentiment with a 2-layer bidirectional
LSTM over packed padded sequences.

``RNN``: ``nn.Embedding(padding_idx=PAD_IDX)``, dropout, ``nn.utils.rnn.pack_padded_sequence(
embedded, text_lengths.to('cpu'))``, ``nn.LSTM(num_layers=2, bidirectional=True, dropout)``,
``pad_packed_sequence``, then the final forward and backward hidden states of the top layer
(``hidden[-2,:,:]``, ``hidden[-1,:,:]``) concatenated, dropout, ``Linear(hidden*2, 1)``. The
embedding is loaded from pretrained vectors (``weight.data.copy_``) with the ``<unk>`` and
``<pad>`` rows zeroed; Adam (defaults); ``BCEWithLogitsLoss``; ``binary_accuracy`` rounds
``sigmoid(preds)``. The step is ``train()``'s loop body (zero_grad, forward, ``squeeze(1)``, loss,
accuracy, backward, step); ``epoch_loss += loss.item()`` and ``epoch_acc += acc.item()`` stay in
the loop, ``evaluate()`` (no_grad) runs between epochs.

Lengths: the notebook's ``BucketIterator(sort_within_batch=True)`` pads each batch to its longest
review and hands the lengths sorted descending (``include_lengths=True``), on the device (hence
``.to('cpu')``). Here every batch has one review of the full length (9 tokens), so ``text`` has
the same shape [9, 4] at every step, and the other lengths vary from batch to batch (2..9, sorted
descending) -- the packed batch sizes differ per batch, as the program's do.

Restated after the notebook (same modules, names, ops, init and semantics), not copied: the
lookup service this was written with does not allow committing its text. Scaled down: IMDB and
GloVe 6B.100d replaced by synthetic reviews and N(0, 1) vectors (the notebook's ``unk_init``);
vocabulary 40 (25 002), EMBEDDING_DIM 10 (100), HIDDEN_DIM 8 (256), BATCH_SIZE 4 (64), 4 batches
an epoch.
"""
import random

import torch
import torch.nn as nn
import torch.optim as optim

SOURCE = ("https://github.com/bentrevett/pytorch-sentiment-analysis/blob/329f654b2cfaed22fee432569ebd7a2674584f79/"
          "legacy/2%20-%20Upgraded%20Sentiment%20Analysis.ipynb")
LICENSE = "MIT"
TAGS = ("rnn", "lstm", "bidirectional", "packed-sequence", "variable-lengths", "pretrained-embedding",
        "adam", "bce-with-logits", "accuracy-in-step")

UNK_IDX, PAD_IDX = 0, 1   # torchtext Field's specials


# ---- the notebook's model (restated) --------------------------------------------------------
class RNN(nn.Module):
    def __init__(self, vocab_size, embedding_dim, hidden_dim, output_dim, n_layers,
                 bidirectional, dropout, pad_idx):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=pad_idx)
        self.rnn = nn.LSTM(embedding_dim, hidden_dim, num_layers=n_layers,
                           bidirectional=bidirectional, dropout=dropout)
        self.fc = nn.Linear(hidden_dim * 2, output_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, text, text_lengths):
        # text: [sent len, batch]
        embedded = self.dropout(self.embedding(text))
        # the lengths must be a CPU tensor for packing
        packed_embedded = nn.utils.rnn.pack_padded_sequence(embedded, text_lengths.to('cpu'))
        packed_output, (hidden, cell) = self.rnn(packed_embedded)
        # back to a padded tensor (zeros past each length); unused below, as in the notebook
        output, output_lengths = nn.utils.rnn.pad_packed_sequence(packed_output)
        # last layer's final forward and backward states, concatenated, with dropout
        hidden = self.dropout(torch.cat((hidden[-2, :, :], hidden[-1, :, :]), dim=1))
        return self.fc(hidden)


def binary_accuracy(preds, y):
    """Accuracy per batch (8 right of 10 gives 0.8)."""
    rounded_preds = torch.round(torch.sigmoid(preds))
    correct = (rounded_preds == y).float()
    acc = correct.sum() / len(correct)
    return acc


# ---- data: BucketIterator-like batches ---------------------------------------------------------
def synthetic_batches(n, vocab, max_len, batch, seed, device):
    """(text [max_len, batch], lengths sorted descending, labels float) per batch."""
    g = random.Random(seed)
    out = []
    for _ in range(n):
        lengths = sorted([max_len] + [g.randrange(2, max_len + 1) for _ in range(batch - 1)], reverse=True)
        cols = [[g.randrange(2, vocab) for _ in range(k)] + [PAD_IDX] * (max_len - k) for k in lengths]
        text = torch.tensor(cols, dtype=torch.long).t().contiguous()
        label = torch.tensor([float(g.random() < 0.5) for _ in range(batch)])
        out.append((text.to(device), torch.tensor(lengths).to(device), label.to(device)))
    return out


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    INPUT_DIM = 40
    EMBEDDING_DIM = 10
    HIDDEN_DIM = 8
    OUTPUT_DIM = 1
    N_LAYERS = 2
    BIDIRECTIONAL = True
    DROPOUT = 0.5
    BATCH_SIZE, N_BATCHES, MAX_LEN = 4, 4, 9

    train_iterator = synthetic_batches(N_BATCHES, INPUT_DIM, MAX_LEN, BATCH_SIZE, 21, device)
    valid_iterator = synthetic_batches(2, INPUT_DIM, MAX_LEN, BATCH_SIZE, 22, device)

    model = RNN(INPUT_DIM, EMBEDDING_DIM, HIDDEN_DIM, OUTPUT_DIM, N_LAYERS, BIDIRECTIONAL, DROPOUT, PAD_IDX)

    # TEXT.vocab.vectors: GloVe rows, unknown words drawn with unk_init = Tensor.normal_
    pretrained_embeddings = torch.Tensor(INPUT_DIM, EMBEDDING_DIM).normal_()
    model.embedding.weight.data.copy_(pretrained_embeddings)
    model.embedding.weight.data[UNK_IDX] = torch.zeros(EMBEDDING_DIM)
    model.embedding.weight.data[PAD_IDX] = torch.zeros(EMBEDDING_DIM)

    optimizer = optim.Adam(model.parameters())
    criterion = nn.BCEWithLogitsLoss()
    model = model.to(device)
    criterion = criterion.to(device)
    sg.track(model=model, optimizer=optimizer)

    @sg.compile
    def train_step(text, text_lengths, label):   # train()'s loop body
        optimizer.zero_grad()
        predictions = model(text, text_lengths).squeeze(1)
        loss = criterion(predictions, label)
        acc = binary_accuracy(predictions, label)
        loss.backward()
        optimizer.step()
        return loss, acc

    def evaluate(iterator):
        epoch_loss = 0
        epoch_acc = 0
        model.eval()
        with torch.no_grad():
            for text, text_lengths, label in iterator:
                predictions = model(text, text_lengths).squeeze(1)
                loss = criterion(predictions, label)
                acc = binary_accuracy(predictions, label)
                epoch_loss += loss.item()
                epoch_acc += acc.item()
        return epoch_loss / len(iterator), epoch_acc / len(iterator)

    done = 0
    best_valid_loss = float('inf')
    while done < steps:   # for epoch in range(N_EPOCHS)
        epoch_loss = 0
        epoch_acc = 0
        model.train()
        for text, text_lengths, label in train_iterator:
            if done == steps:
                break
            loss, acc = train_step(text, text_lengths, label)
            sg.log((loss, acc))
            epoch_loss += loss.item()
            epoch_acc += acc.item()
            done += 1
        train_loss, train_acc = epoch_loss / len(train_iterator), epoch_acc / len(train_iterator)
        valid_loss, valid_acc = evaluate(valid_iterator)
        if valid_loss < best_valid_loss:
            best_valid_loss = valid_loss
        sg.log((train_loss, train_acc, valid_loss, valid_acc))
