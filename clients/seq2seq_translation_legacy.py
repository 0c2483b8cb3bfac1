"""PyTorch's seq2seq translation tutorial as it stood before the 2023 batched rewrite
(intermediate_source/seq2seq_translation_tutorial.py at 803c1b1): one sentence pair per step,
an ``EncoderRNN`` run token by token in a Python loop writing ``encoder_outputs[ei] =
encoder_output[0, 0]`` into a ``torch.zeros(max_length, hidden)`` buffer, an ``AttnDecoderRNN``
with a ``Linear(2 * hidden, max_length)`` attention, ``loss = 0`` then ``loss += criterion(...)``
per target token, and the tutorial's teacher forcing: ``use_teacher_forcing = True if
random.random() < teacher_forcing_ratio else False``; without it the decoder feeds back
``topk(1)`` and stops at ``if decoder_input.item() == EOS_token: break``. Two SGD optimizers,
``nn.NLLLoss``; ``train()`` returns ``loss.item() / target_length``.

The step is the tutorial's ``train()`` itself (what ``trainIters`` calls per pair), decorated
where a user would decorate it. The data-dependent parts are the program's: a host random draw
and a host read of the decoder's own prediction decide how many decoder steps run.

Models restated after the tutorial (same layers and computation), not copied: the lookup service
this was written with does not allow committing its text. Scaled down: hidden_size 16 (256),
synthetic pairs of 3 or 4 words (EOS appended) over 20/18-word vocabularies instead of
eng-fra.txt, so that input shapes repeat within a few steps.
"""
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import optim

SOURCE = "https://github.com/pytorch/tutorials/blob/803c1b1/intermediate_source/seq2seq_translation_tutorial.py"
LICENSE = "BSD-3-Clause"
TAGS = ("rnn", "gru", "seq2seq", "attention", "teacher-forcing", "python-random", "item-in-step",
        "data-dependent-loop", "two-optimizers", "sgd", "nll", "loss-accumulated-from-int")

SOS_token = 0
EOS_token = 1
MAX_LENGTH = 10
device = None
teacher_forcing_ratio = 0.5


class EncoderRNN(nn.Module):
    def __init__(self, input_size, hidden_size):
        super(EncoderRNN, self).__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)

    def forward(self, input, hidden):
        embedded = self.embedding(input).view(1, 1, -1)
        output = embedded
        output, hidden = self.gru(output, hidden)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, 1, self.hidden_size, device=device)


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size, dropout_p=0.1, max_length=MAX_LENGTH):
        super(AttnDecoderRNN, self).__init__()
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.dropout_p = dropout_p
        self.max_length = max_length
        self.embedding = nn.Embedding(self.output_size, self.hidden_size)
        self.attn = nn.Linear(self.hidden_size * 2, self.max_length)
        self.attn_combine = nn.Linear(self.hidden_size * 2, self.hidden_size)
        self.dropout = nn.Dropout(self.dropout_p)
        self.gru = nn.GRU(self.hidden_size, self.hidden_size)
        self.out = nn.Linear(self.hidden_size, self.output_size)

    def forward(self, input, hidden, encoder_outputs):
        embedded = self.embedding(input).view(1, 1, -1)
        embedded = self.dropout(embedded)
        attn_weights = F.softmax(self.attn(torch.cat((embedded[0], hidden[0]), 1)), dim=1)
        attn_applied = torch.bmm(attn_weights.unsqueeze(0), encoder_outputs.unsqueeze(0))
        output = torch.cat((embedded[0], attn_applied[0]), 1)
        output = self.attn_combine(output).unsqueeze(0)
        output = F.relu(output)
        output, hidden = self.gru(output, hidden)
        output = F.log_softmax(self.out(output[0]), dim=1)
        return output, hidden, attn_weights


def tensorFromIndexes(indexes):
    indexes = indexes + [EOS_token]
    return torch.tensor(indexes, dtype=torch.long, device=device).view(-1, 1)


def _set_device(name):
    global device
    device = torch.device(name)


def main(sg, steps=8, device="cpu", amp=None):
    _set_device(device)
    hidden_size = 16
    n_in, n_out = 20, 18
    rng = random.Random(5)
    pairs = [([rng.randrange(2, n_in) for _ in range(rng.choice((3, 4)))],
              [rng.randrange(2, n_out) for _ in range(rng.choice((3, 4)))]) for _ in range(12)]

    encoder1 = EncoderRNN(n_in, hidden_size).to(device)
    attn_decoder1 = AttnDecoderRNN(hidden_size, n_out, dropout_p=0.1).to(device)

    @sg.compile
    def train(input_tensor, target_tensor, encoder, decoder, encoder_optimizer, decoder_optimizer,
              criterion, max_length=MAX_LENGTH):
        encoder_hidden = encoder.initHidden()

        encoder_optimizer.zero_grad()
        decoder_optimizer.zero_grad()

        input_length = input_tensor.size(0)
        target_length = target_tensor.size(0)

        encoder_outputs = torch.zeros(max_length, encoder.hidden_size, device=device)

        loss = 0

        for ei in range(input_length):
            encoder_output, encoder_hidden = encoder(input_tensor[ei], encoder_hidden)
            encoder_outputs[ei] = encoder_output[0, 0]

        decoder_input = torch.tensor([[SOS_token]], device=device)

        decoder_hidden = encoder_hidden

        use_teacher_forcing = True if random.random() < teacher_forcing_ratio else False

        if use_teacher_forcing:
            # teacher forcing: the target is the next input
            for di in range(target_length):
                decoder_output, decoder_hidden, decoder_attention = decoder(
                    decoder_input, decoder_hidden, encoder_outputs)
                loss += criterion(decoder_output, target_tensor[di])
                decoder_input = target_tensor[di]
        else:
            # its own prediction is the next input
            for di in range(target_length):
                decoder_output, decoder_hidden, decoder_attention = decoder(
                    decoder_input, decoder_hidden, encoder_outputs)
                topv, topi = decoder_output.topk(1)
                decoder_input = topi.squeeze().detach()

                loss += criterion(decoder_output, target_tensor[di])
                if decoder_input.item() == EOS_token:
                    break

        loss.backward()

        encoder_optimizer.step()
        decoder_optimizer.step()

        return loss.item() / target_length

    # trainIters(encoder1, attn_decoder1, n_iters, print_every=...), learning_rate=0.01
    learning_rate = 0.01
    encoder_optimizer = optim.SGD(encoder1.parameters(), lr=learning_rate)
    decoder_optimizer = optim.SGD(attn_decoder1.parameters(), lr=learning_rate)
    training_pairs = [(tensorFromIndexes(a), tensorFromIndexes(b))
                      for a, b in (rng.choice(pairs) for i in range(steps))]
    criterion = nn.NLLLoss()
    sg.track(encoder=encoder1, decoder=attn_decoder1)

    print_loss_total = 0
    for iter in range(1, steps + 1):
        training_pair = training_pairs[iter - 1]
        input_tensor = training_pair[0]
        target_tensor = training_pair[1]

        loss = train(input_tensor, target_tensor, encoder1,
                     attn_decoder1, encoder_optimizer, decoder_optimizer, criterion)
        sg.log(loss)
        print_loss_total += loss
    sg.log(print_loss_total)
