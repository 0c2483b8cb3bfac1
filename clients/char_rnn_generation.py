"""PyTorch's "NLP From Scratch: Generating Names with a Character-Level RNN" tutorial
(intermediate_source/char_rnn_generation_tutorial.py): a hand-written RNN conditioned on a
one-hot language category -- ``i2h`` and ``i2o`` on ``cat(category, input, hidden)``, ``o2o`` on
``cat(hidden, output)``, dropout 0.1, ``LogSoftmax(dim=1)`` -- trained one name at a time.

The step is the tutorial's ``train(category_tensor, input_line_tensor, target_line_tensor)``
itself, decorated where a user would decorate it: ``target_line_tensor.unsqueeze_(-1)`` (in
place, on the argument), ``hidden = rnn.initHidden()``, ``rnn.zero_grad()``, ``loss = 0`` and a
Python loop over the name's letters accumulating ``loss += l`` of ``nn.NLLLoss``, ``loss.backward()``,
hand-written SGD ``p.data.add_(p.grad.data, alpha=-learning_rate)``, and ``return output,
loss.item() / input_line_tensor.size(0)``. The loop around it is the tutorial's: a random
(category, name) pair per iteration (``randomTrainingExample``, Python ``random`` outside the
step), ``total_loss += loss``, a print every ``print_every`` and an ``all_losses`` point every
``plot_every`` iterations; then ``sample()`` (no_grad, ``topk``, stop at EOS) after training.

Names have different lengths, so the step's input shapes change with the name drawn: the length
of ``input_line_tensor`` sets how many times the loop runs.

Restated after the tutorial (same module, names, ops and semantics), not copied: the lookup
service this was written with does not allow committing its text. The stored tutorial revision
below writes the update in the deprecated ``p.data.add_(-learning_rate, p.grad.data)`` form; the
current tutorial (and this restatement) writes ``add_(p.grad.data, alpha=-learning_rate)``, the same
operation. Scaled down: data/names/*.txt (18 languages) replaced by 4 synthetic "languages" of 6
names each, 3 to 6 letters (so lengths repeat within a few steps); hidden size 16 (128);
print_every 4 (5000), plot_every 2 (500).
"""
import random
import string

import torch
import torch.nn as nn

SOURCE = ("https://github.com/pytorch/tutorials/blob/4ce8b871ef249dfacc1b389108842a0c2c0805b7/"
          "intermediate_source/char_rnn_generation_tutorial.py")
LICENSE = "BSD-3-Clause"
TAGS = ("rnn", "hand-written-rnn", "python-unrolled", "variable-length", "manual-sgd", "nll",
        "loss-accumulated-from-int", "item-in-step", "inplace-on-argument", "dropout")

all_letters = string.ascii_letters + " .,;'-"
n_letters = len(all_letters) + 1   # plus the EOS marker

all_categories = ["Arvian", "Belish", "Corese", "Dunnic"]
n_categories = len(all_categories)
category_lines = {}


def _synthetic_names(seed=7):
    g = random.Random(seed)
    for c in all_categories:
        # each "language" favours a few letters, so there is something to learn
        letters = g.sample(string.ascii_lowercase, 8)
        category_lines[c] = [(g.choice(string.ascii_uppercase)
                              + "".join(g.choice(letters) for _ in range(g.randrange(2, 6))))
                             for _ in range(6)]


class RNN(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super(RNN, self).__init__()
        self.hidden_size = hidden_size
        self.i2h = nn.Linear(n_categories + input_size + hidden_size, hidden_size)
        self.i2o = nn.Linear(n_categories + input_size + hidden_size, output_size)
        self.o2o = nn.Linear(hidden_size + output_size, output_size)
        self.dropout = nn.Dropout(0.1)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, category, input, hidden):
        input_combined = torch.cat((category, input, hidden), 1)
        hidden = self.i2h(input_combined)
        output = self.i2o(input_combined)
        output_combined = torch.cat((hidden, output), 1)
        output = self.o2o(output_combined)
        output = self.dropout(output)
        output = self.softmax(output)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, self.hidden_size)


# ---- the tutorial's data helpers (restated) ---------------------------------------------------
def randomChoice(l):
    return l[random.randint(0, len(l) - 1)]


def randomTrainingPair():
    category = randomChoice(all_categories)
    line = randomChoice(category_lines[category])
    return category, line


def categoryTensor(category):
    li = all_categories.index(category)
    tensor = torch.zeros(1, n_categories)
    tensor[0][li] = 1
    return tensor


def inputTensor(line):
    # one-hot, first to last letter (no EOS): [len, 1, n_letters]
    tensor = torch.zeros(len(line), 1, n_letters)
    for li in range(len(line)):
        letter = line[li]
        tensor[li][0][all_letters.find(letter)] = 1
    return tensor


def targetTensor(line):
    # second letter to the end, then EOS
    letter_indexes = [all_letters.find(line[li]) for li in range(1, len(line))]
    letter_indexes.append(n_letters - 1)
    return torch.LongTensor(letter_indexes)


def randomTrainingExample():
    category, line = randomTrainingPair()
    category_tensor = categoryTensor(category)
    input_line_tensor = inputTensor(line)
    target_line_tensor = targetTensor(line)
    return category_tensor, input_line_tensor, target_line_tensor


criterion = nn.NLLLoss()
learning_rate = 0.0005
rnn = None
max_length = 20


def sample(category, start_letter='A'):
    with torch.no_grad():
        category_tensor = categoryTensor(category)
        input = inputTensor(start_letter)
        hidden = rnn.initHidden()
        output_name = start_letter
        for i in range(max_length):
            output, hidden = rnn(category_tensor, input[0], hidden)
            topv, topi = output.topk(1)
            topi = topi[0][0]
            if topi == n_letters - 1:
                break
            else:
                letter = all_letters[topi]
                output_name += letter
            input = inputTensor(letter)
        return output_name


def main(sg, steps=8, device="cpu", amp=None):
    global rnn
    _synthetic_names()
    rnn = RNN(n_letters, 16, n_letters)
    sg.track(rnn=rnn)

    @sg.compile
    def train(category_tensor, input_line_tensor, target_line_tensor):
        target_line_tensor.unsqueeze_(-1)
        hidden = rnn.initHidden()

        rnn.zero_grad()

        loss = 0

        for i in range(input_line_tensor.size(0)):
            output, hidden = rnn(category_tensor, input_line_tensor[i], hidden)
            l = criterion(output, target_line_tensor[i])
            loss += l

        loss.backward()

        for p in rnn.parameters():
            p.data.add_(p.grad.data, alpha=-learning_rate)

        return output, loss.item() / input_line_tensor.size(0)

    n_iters = steps
    print_every = 4
    plot_every = 2
    all_losses = []
    total_loss = 0   # reset every plot_every iterations
    lengths = []
    for iter in range(1, n_iters + 1):
        example = randomTrainingExample()
        lengths.append(example[1].size(0))
        output, loss = train(*example)
        sg.log((output, loss, tuple(example[2].shape)))
        total_loss += loss
        if iter % print_every == 0:
            pass   # print('%s (%d %d%%) %.4f' % (timeSince(start), iter, iter / n_iters * 100, loss))
        if iter % plot_every == 0:
            all_losses.append(total_loss / plot_every)
            total_loss = 0
    sg.log(all_losses)
    sg.log(lengths)
    sg.log([sample(c, c[0]) for c in all_categories])
