"""bentrevett/pytorch-seq2seq, notebook 3: "Neural Machine Translation by Jointly Learning to
Align and Translate" (Bahdanau et al.), the torchtext-legacy edition kept under ``legacy/``.

An ``Encoder`` (embedding, dropout, a bidirectional ``nn.GRU``; the last forward and backward
hidden states concatenated with ``torch.cat`` and passed through ``Linear`` + ``tanh`` to give the
decoder's first hidden state), an additive ``Attention`` (the decoder state repeated over the
source, ``torch.cat`` with the encoder outputs, ``Linear`` + ``tanh``, ``v`` without bias,
``softmax`` over the source), a ``Decoder`` that runs one GRU step per call on ``[embedded;
weighted context]`` and predicts from ``[output; weighted; embedded]`` (it also checks ``assert
(output == hidden).all()``), and ``Seq2Seq.forward``: a Python loop over the target positions
that stores each prediction in ``outputs[t]``, decides per time step ``teacher_force =
random.random() < teacher_forcing_ratio`` and feeds back ``trg[t]`` or ``top1 =
output.argmax(1)``. ``init_weights``: N(0, 0.01) weights, zero biases. Adam (defaults),
``CrossEntropyLoss(ignore_index=TRG_PAD_IDX)`` on ``output[1:].view(-1, output_dim)``,
``clip_grad_norm_(model.parameters(), CLIP)``.

The step is ``train()``'s loop body (zero_grad, forward, reshape, loss, backward, clip, step);
``epoch_loss += loss.item()`` stays in the loop, as ``evaluate()`` (teacher forcing 0, no_grad)
stays between epochs. The teacher-forcing coin is a host draw inside the model's forward, in
the step -- the program's own structure.

Restated after the notebook (same modules, names, ops, init and semantics), not copied: the
lookup service this was written with does not allow committing its text. Scaled down: Multi30k
de->en replaced by synthetic token sentences (``<sos>`` ... ``<eos>``, then ``<pad>``, torchtext's
specials ``<unk>``=0 ``<pad>``=1 ``<sos>``=2 ``<eos>``=3), every batch padded to the same
lengths (src 7, trg 6) so that input shapes repeat; vocabularies 24/20 (7853/5893), embeddings 8
(256), hidden 12 (512), BATCH_SIZE 4 (128), 4 batches an epoch.
"""
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

SOURCE = ("https://github.com/bentrevett/pytorch-seq2seq/blob/b3cd54c72cd6e4e63f672d334c795b4fe744ef92/"
          "legacy/3%20-%20Neural%20Machine%20Translation%20by%20Jointly%20Learning%20to%20Align%20and%20Translate.ipynb")
LICENSE = "MIT"
TAGS = ("rnn", "gru", "bidirectional", "seq2seq", "attention", "teacher-forcing", "python-random",
        "python-unrolled", "assert-in-step", "argmax-feedback", "adam", "clip", "cross-entropy-ignore-index")

UNK_IDX, PAD_IDX, SOS_IDX, EOS_IDX = 0, 1, 2, 3


# ---- the notebook's model (restated) --------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self, input_dim, emb_dim, enc_hid_dim, dec_hid_dim, dropout):
        super().__init__()
        self.embedding = nn.Embedding(input_dim, emb_dim)
        self.rnn = nn.GRU(emb_dim, enc_hid_dim, bidirectional=True)
        self.fc = nn.Linear(enc_hid_dim * 2, dec_hid_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src):
        # src: [src len, batch]
        embedded = self.dropout(self.embedding(src))
        outputs, hidden = self.rnn(embedded)
        # hidden[-2] / hidden[-1]: last forward / last backward state of the top layer;
        # together, through a linear layer and tanh, they start the decoder
        hidden = torch.tanh(self.fc(torch.cat((hidden[-2, :, :], hidden[-1, :, :]), dim=1)))
        return outputs, hidden


class Attention(nn.Module):
    def __init__(self, enc_hid_dim, dec_hid_dim):
        super().__init__()
        self.attn = nn.Linear((enc_hid_dim * 2) + dec_hid_dim, dec_hid_dim)
        self.v = nn.Linear(dec_hid_dim, 1, bias=False)

    def forward(self, hidden, encoder_outputs):
        # hidden: [batch, dec hid]; encoder_outputs: [src len, batch, enc hid * 2]
        batch_size = encoder_outputs.shape[1]
        src_len = encoder_outputs.shape[0]
        hidden = hidden.unsqueeze(1).repeat(1, src_len, 1)
        encoder_outputs = encoder_outputs.permute(1, 0, 2)
        energy = torch.tanh(self.attn(torch.cat((hidden, encoder_outputs), dim=2)))
        attention = self.v(energy).squeeze(2)
        return F.softmax(attention, dim=1)


class Decoder(nn.Module):
    def __init__(self, output_dim, emb_dim, enc_hid_dim, dec_hid_dim, dropout, attention):
        super().__init__()
        self.output_dim = output_dim
        self.attention = attention
        self.embedding = nn.Embedding(output_dim, emb_dim)
        self.rnn = nn.GRU((enc_hid_dim * 2) + emb_dim, dec_hid_dim)
        self.fc_out = nn.Linear((enc_hid_dim * 2) + dec_hid_dim + emb_dim, output_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input, hidden, encoder_outputs):
        # input: [batch]; hidden: [batch, dec hid]
        input = input.unsqueeze(0)
        embedded = self.dropout(self.embedding(input))
        a = self.attention(hidden, encoder_outputs).unsqueeze(1)
        encoder_outputs = encoder_outputs.permute(1, 0, 2)
        weighted = torch.bmm(a, encoder_outputs).permute(1, 0, 2)
        rnn_input = torch.cat((embedded, weighted), dim=2)
        output, hidden = self.rnn(rnn_input, hidden.unsqueeze(0))
        # one layer, one direction, one position: the output is the hidden state
        assert (output == hidden).all()
        embedded = embedded.squeeze(0)
        output = output.squeeze(0)
        weighted = weighted.squeeze(0)
        prediction = self.fc_out(torch.cat((output, weighted, embedded), dim=1))
        return prediction, hidden.squeeze(0)


class Seq2Seq(nn.Module):
    def __init__(self, encoder, decoder, device):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.device = device

    def forward(self, src, trg, teacher_forcing_ratio=0.5):
        batch_size = src.shape[1]
        trg_len = trg.shape[0]
        trg_vocab_size = self.decoder.output_dim
        outputs = torch.zeros(trg_len, batch_size, trg_vocab_size).to(self.device)
        encoder_outputs, hidden = self.encoder(src)
        input = trg[0, :]   # the <sos> tokens
        for t in range(1, trg_len):
            output, hidden = self.decoder(input, hidden, encoder_outputs)
            outputs[t] = output
            teacher_force = random.random() < teacher_forcing_ratio
            top1 = output.argmax(1)
            input = trg[t] if teacher_force else top1
        return outputs


def init_weights(m):
    for name, param in m.named_parameters():
        if 'weight' in name:
            nn.init.normal_(param.data, mean=0, std=0.01)
        else:
            nn.init.constant_(param.data, 0)


# ---- data: BucketIterator-like batches of synthetic sentences --------------------------------
def synthetic_batches(n, vocab, max_len, batch, seed):
    """``n`` batches [max_len, batch] of ``<sos> w... <eos> <pad>...``; every batch holds one
    sentence of the full length, so every batch has the same shape."""
    g = random.Random(seed)
    out = []
    for _ in range(n):
        cols = []
        for b in range(batch):
            k = max_len - 2 if b == 0 else g.randrange(2, max_len - 1)
            cols.append([SOS_IDX] + [g.randrange(4, vocab) for _ in range(k)] + [EOS_IDX]
                        + [PAD_IDX] * (max_len - 2 - k))
        out.append(torch.tensor(cols, dtype=torch.long).t().contiguous())
    return out


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    INPUT_DIM, OUTPUT_DIM = 24, 20
    ENC_EMB_DIM = DEC_EMB_DIM = 8
    ENC_HID_DIM = DEC_HID_DIM = 12
    ENC_DROPOUT = DEC_DROPOUT = 0.5
    BATCH_SIZE, N_BATCHES, CLIP = 4, 4, 1
    SRC_LEN, TRG_LEN = 7, 6

    train_iterator = list(zip(synthetic_batches(N_BATCHES, INPUT_DIM, SRC_LEN, BATCH_SIZE, 11),
                              synthetic_batches(N_BATCHES, OUTPUT_DIM, TRG_LEN, BATCH_SIZE, 12)))
    valid_iterator = list(zip(synthetic_batches(1, INPUT_DIM, SRC_LEN, BATCH_SIZE, 13),
                              synthetic_batches(1, OUTPUT_DIM, TRG_LEN, BATCH_SIZE, 14)))

    attn = Attention(ENC_HID_DIM, DEC_HID_DIM)
    enc = Encoder(INPUT_DIM, ENC_EMB_DIM, ENC_HID_DIM, DEC_HID_DIM, ENC_DROPOUT)
    dec = Decoder(OUTPUT_DIM, DEC_EMB_DIM, ENC_HID_DIM, DEC_HID_DIM, DEC_DROPOUT, attn)
    model = Seq2Seq(enc, dec, device).to(device)
    model.apply(init_weights)

    optimizer = optim.Adam(model.parameters())
    TRG_PAD_IDX = PAD_IDX
    criterion = nn.CrossEntropyLoss(ignore_index=TRG_PAD_IDX)
    sg.track(model=model, optimizer=optimizer)

    @sg.compile
    def train_step(src, trg):   # train()'s loop body
        optimizer.zero_grad()
        output = model(src, trg)
        output_dim = output.shape[-1]
        output = output[1:].view(-1, output_dim)
        trg = trg[1:].view(-1)
        loss = criterion(output, trg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        return loss

    def evaluate(iterator):
        model.eval()
        epoch_loss = 0
        with torch.no_grad():
            for src, trg in iterator:
                src, trg = src.to(device), trg.to(device)
                output = model(src, trg, 0)   # teacher forcing off
                output_dim = output.shape[-1]
                output = output[1:].view(-1, output_dim)
                trg = trg[1:].view(-1)
                epoch_loss += criterion(output, trg).item()
        return epoch_loss / len(iterator)

    done = 0
    best_valid_loss = float('inf')
    while done < steps:   # for epoch in range(N_EPOCHS)
        model.train()
        epoch_loss = 0
        for src, trg in train_iterator:
            if done == steps:
                break
            loss = train_step(src.to(device), trg.to(device))
            sg.log(loss)
            epoch_loss += loss.item()
            done += 1
        train_loss = epoch_loss / len(train_iterator)
        valid_loss = evaluate(valid_iterator)
        if valid_loss < best_valid_loss:
            best_valid_loss = valid_loss
        sg.log((train_loss, math.exp(train_loss), valid_loss, math.exp(valid_loss)))
