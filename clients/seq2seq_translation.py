"""PyTorch's "NLP From Scratch: Translation with a Sequence to Sequence Network and Attention"
tutorial (intermediate_source/seq2seq_translation_tutorial.py, the batched 2023 rewrite): an
``EncoderRNN`` (embedding, dropout, ``nn.GRU(batch_first=True)``) and an ``AttnDecoderRNN`` with
Bahdanau (additive) attention that unrolls ``MAX_LENGTH`` steps in Python, feeding the target
token back (teacher forcing) when ``target_tensor`` is given and ``topk(1)`` of its own output
otherwise; two Adam optimizers (encoder, decoder) and ``nn.NLLLoss`` on the log-softmax outputs.
The step is ``train_epoch``'s loop body: both ``zero_grad()``, encoder, decoder, loss, backward,
both ``step()``; ``total_loss += loss.item()`` stays in the epoch loop.

In this version training always passes ``target_tensor`` (teacher forcing on every step), so the
decoder loop is static; the ``topk`` branch runs only in ``evaluate`` (no_grad, after training,
as the tutorial does). The earlier per-sentence version, with a random teacher-forcing choice and
a ``.item() == EOS_token`` break inside ``train()``, is ``seq2seq_translation_legacy``.

The model classes are restated here after the tutorial (same layers, same forward computation,
same names), not copied: the lookup service this was written with does not allow committing its
text. Scaled down: hidden_size 16 (128), 36 synthetic sentence pairs over 30/26-word
vocabularies instead of eng-fra.txt (lengths 2..9, EOS appended, zero-padded to MAX_LENGTH = 10
by ``get_dataloader`` as in the tutorial), batch_size 8 (32): the last batch of each epoch has 4
pairs, a second input shape.
"""
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

SOURCE = "https://github.com/pytorch/tutorials/blob/main/intermediate_source/seq2seq_translation_tutorial.py"
LICENSE = "BSD-3-Clause"
TAGS = ("rnn", "gru", "seq2seq", "attention", "teacher-forcing", "python-unrolled",
        "two-optimizers", "adam", "nll", "dataloader")

SOS_token = 0
EOS_token = 1
MAX_LENGTH = 10
device = None


# ---- the tutorial's model (restated) -------------------------------------------------------
class EncoderRNN(nn.Module):
    def __init__(self, input_size, hidden_size, dropout_p=0.1):
        super(EncoderRNN, self).__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size, batch_first=True)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, input):
        embedded = self.dropout(self.embedding(input))
        output, hidden = self.gru(embedded)
        return output, hidden


class BahdanauAttention(nn.Module):
    def __init__(self, hidden_size):
        super(BahdanauAttention, self).__init__()
        self.Wa = nn.Linear(hidden_size, hidden_size)
        self.Ua = nn.Linear(hidden_size, hidden_size)
        self.Va = nn.Linear(hidden_size, 1)

    def forward(self, query, keys):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys)))
        scores = scores.squeeze(2).unsqueeze(1)
        weights = F.softmax(scores, dim=-1)
        context = torch.bmm(weights, keys)
        return context, weights


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size, dropout_p=0.1):
        super(AttnDecoderRNN, self).__init__()
        self.embedding = nn.Embedding(output_size, hidden_size)
        self.attention = BahdanauAttention(hidden_size)
        self.gru = nn.GRU(2 * hidden_size, hidden_size, batch_first=True)
        self.out = nn.Linear(hidden_size, output_size)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, encoder_outputs, encoder_hidden, target_tensor=None):
        batch_size = encoder_outputs.size(0)
        decoder_input = torch.empty(batch_size, 1, dtype=torch.long, device=device).fill_(SOS_token)
        decoder_hidden = encoder_hidden
        decoder_outputs = []
        attentions = []

        for i in range(MAX_LENGTH):
            decoder_output, decoder_hidden, attn_weights = self.forward_step(
                decoder_input, decoder_hidden, encoder_outputs
            )
            decoder_outputs.append(decoder_output)
            attentions.append(attn_weights)

            if target_tensor is not None:
                # teacher forcing: the target is the next input
                decoder_input = target_tensor[:, i].unsqueeze(1)
            else:
                # its own prediction is the next input
                _, topi = decoder_output.topk(1)
                decoder_input = topi.squeeze(-1).detach()

        decoder_outputs = torch.cat(decoder_outputs, dim=1)
        decoder_outputs = F.log_softmax(decoder_outputs, dim=-1)
        attentions = torch.cat(attentions, dim=1)
        return decoder_outputs, decoder_hidden, attentions

    def forward_step(self, input, hidden, encoder_outputs):
        embedded = self.dropout(self.embedding(input))
        query = hidden.permute(1, 0, 2)
        context, attn_weights = self.attention(query, encoder_outputs)
        input_gru = torch.cat((embedded, context), dim=2)
        output, hidden = self.gru(input_gru, hidden)
        output = self.out(output)
        return output, hidden, attn_weights


# ---- data: the tutorial's get_dataloader on synthetic pairs --------------------------------
def synthetic_pairs(n, n_in, n_out, seed=3):
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a = [rng.randrange(2, n_in) for _ in range(rng.randrange(2, MAX_LENGTH))]
        b = [rng.randrange(2, n_out) for _ in range(rng.randrange(2, MAX_LENGTH))]
        pairs.append((a, b))
    return pairs


def get_dataloader(batch_size, pairs):
    n = len(pairs)
    input_ids = np.zeros((n, MAX_LENGTH), dtype=np.int32)
    target_ids = np.zeros((n, MAX_LENGTH), dtype=np.int32)
    for idx, (inp_ids, tgt_ids) in enumerate(pairs):
        inp_ids = inp_ids + [EOS_token]
        tgt_ids = tgt_ids + [EOS_token]
        input_ids[idx, :len(inp_ids)] = inp_ids
        target_ids[idx, :len(tgt_ids)] = tgt_ids
    train_data = TensorDataset(torch.LongTensor(input_ids).to(device),
                               torch.LongTensor(target_ids).to(device))
    train_sampler = RandomSampler(train_data)
    return DataLoader(train_data, sampler=train_sampler, batch_size=batch_size)


def _set_device(name):
    global device
    device = torch.device(name)


def main(sg, steps=8, device="cpu", amp=None):
    _set_device(device)
    device = globals()["device"]
    hidden_size, batch_size = 16, 8
    n_in, n_out = 30, 26
    train_dataloader = get_dataloader(batch_size, synthetic_pairs(36, n_in, n_out))

    encoder = EncoderRNN(n_in, hidden_size).to(device)
    decoder = AttnDecoderRNN(hidden_size, n_out).to(device)

    # train(train_dataloader, encoder, decoder, n_epochs, learning_rate=0.001, ...)
    learning_rate = 0.001
    encoder_optimizer = optim.Adam(encoder.parameters(), lr=learning_rate)
    decoder_optimizer = optim.Adam(decoder.parameters(), lr=learning_rate)
    criterion = nn.NLLLoss()
    sg.track(encoder=encoder, decoder=decoder, encoder_optimizer=encoder_optimizer,
             decoder_optimizer=decoder_optimizer)

    @sg.compile
    def train_step(input_tensor, target_tensor):  # train_epoch's loop body
        encoder_optimizer.zero_grad()
        decoder_optimizer.zero_grad()

        encoder_outputs, encoder_hidden = encoder(input_tensor)
        decoder_outputs, _, _ = decoder(encoder_outputs, encoder_hidden, target_tensor)

        loss = criterion(
            decoder_outputs.view(-1, decoder_outputs.size(-1)),
            target_tensor.view(-1)
        )
        loss.backward()

        encoder_optimizer.step()
        decoder_optimizer.step()
        return loss

    done = 0
    plot_losses = []
    while done < steps:  # for epoch in range(1, n_epochs + 1): loss = train_epoch(...)
        total_loss = 0
        n = 0
        for data in train_dataloader:
            if done == steps:
                break
            input_tensor, target_tensor = data
            loss = train_step(input_tensor, target_tensor)
            sg.log(loss)
            total_loss += loss.item()
            n += 1
            done += 1
        plot_losses.append(total_loss / max(n, 1))
    sg.log(plot_losses)

    # evaluate: no target, so the decoder feeds back its own topk(1)
    encoder.eval()
    decoder.eval()
    with torch.no_grad():
        input_tensor = next(iter(train_dataloader))[0][:1]
        encoder_outputs, encoder_hidden = encoder(input_tensor)
        decoder_outputs, decoder_hidden, decoder_attn = decoder(encoder_outputs, encoder_hidden)
        _, topi = decoder_outputs.topk(1)
        decoded_ids = topi.squeeze()
        decoded_words = []
        for idx in decoded_ids:
            if idx.item() == EOS_token:
                decoded_words.append('<EOS>')
                break
            decoded_words.append(idx.item())
    sg.log(decoded_words)
