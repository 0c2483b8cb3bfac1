"""seq2seq_translation_legacy with the fix its CLEAR-ERROR names applied: the teacher-forcing
coin (``random.random() < teacher_forcing_ratio``) is drawn in ``trainIters``' loop and passed to
``train()`` as an argument; everything else as the tutorial writes it, including the greedy
decoder loop's ``if decoder_input.item() == EOS_token: break`` (a decision on a value read on the
host, guarded by its outcome: one graph per path taken, not per predicted token).
"""
import random

import torch
import torch.nn as nn
from torch import optim

from clients.seq2seq_translation_legacy import (EOS_token, MAX_LENGTH, SOS_token, AttnDecoderRNN, EncoderRNN,
                                                teacher_forcing_ratio, tensorFromIndexes)
from clients import seq2seq_translation_legacy as legacy

SOURCE = legacy.SOURCE
LICENSE = legacy.LICENSE
TAGS = legacy.TAGS + ("fix-applied",)


def _set_device(name):
    legacy._set_device(name)
    global device
    device = legacy.device


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
              criterion, use_teacher_forcing, max_length=MAX_LENGTH):
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

        use_teacher_forcing = True if random.random() < teacher_forcing_ratio else False
        loss = train(input_tensor, target_tensor, encoder1,
                     attn_decoder1, encoder_optimizer, decoder_optimizer, criterion, use_teacher_forcing)
        sg.log(loss)
        print_loss_total += loss
    sg.log(print_loss_total)
