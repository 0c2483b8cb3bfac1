"""pytorch/examples time_sequence_prediction: two stacked ``nn.LSTMCell`` s unrolled in Python over
the sequence (float64 throughout, ``seq.double()``), ``nn.MSELoss``, trained with ``optim.LBFGS``
(lr 0.8, default max_iter 20) through a closure: each iteration defines ``closure()``
(``optimizer.zero_grad()``, forward, loss, ``print('loss:', loss.item())``, ``backward()``, return
loss) and calls ``optimizer.step(closure)``, which evaluates it up to 25 times with data-dependent
early exits. The step function is that loop body: it defines the closure and calls
``optimizer.step(closure)``. After each step: a ``no_grad`` prediction of ``future`` extra points.

Model: vendor/pytorch_examples/time_sequence_prediction_train.py (``class Sequence``, verbatim).
Loop: train.py lines 41-74. The closure's ``print('loss:', loss.item())`` is kept inside the step
(the host read is the program's), writing to a list instead of stdout. Scaled down: the sine-wave
data of generate_sine_wave.py (same formula, T = 20, from a seeded numpy generator) with N = 8
sequences (3 test, 5 train) of length L = 6 instead of 100 x 1000 (stepgraph traces every one of an
LBFGS step's up-to-25 closure evaluations, about half a second each here even at this length);
``future`` 20 instead of 1000; no plotting. The vendored forward allocates its LSTM states with
``torch.zeros(..., dtype=torch.double)`` on the default device, so like train.py (which never moves
anything off the CPU) it runs on the CPU only: with device="cuda" the model and data are moved as
asked and the forward fails as it would.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

from clients.vendor.pytorch_examples.time_sequence_prediction_train import Sequence

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/time_sequence_prediction/train.py"
LICENSE = "BSD-3-Clause"
DEVICES = ("cpu",)  # the vendored Sequence builds its LSTM states on the default device
TAGS = ("rnn", "lstmcell", "float64", "lbfgs", "closure", "item-in-step", "python-unrolled")


def generate_sine_wave(T=20, L=6, N=8, seed=2):  # generate_sine_wave.py, scaled down
    rng = np.random.RandomState(seed)
    x = np.empty((N, L), 'int64')
    x[:] = np.array(range(L)) + rng.randint(-4 * T, 4 * T, N).reshape(N, 1)
    return np.sin(x / 1.0 / T).astype('float64')


printed = []


def main(sg, steps=8, device="cpu", amp=None):
    # load data and make training set
    data = generate_sine_wave()
    input = torch.from_numpy(data[3:, :-1]).to(device)
    target = torch.from_numpy(data[3:, 1:]).to(device)
    test_input = torch.from_numpy(data[:3, :-1]).to(device)
    test_target = torch.from_numpy(data[:3, 1:]).to(device)
    # build the model
    seq = Sequence().to(device)
    seq.double()
    criterion = nn.MSELoss()
    # use LBFGS as optimizer since we can load the whole data to train
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8)
    sg.track(seq=seq, optimizer=optimizer)

    @sg.compile
    def train_step():
        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            printed.append(('loss:', loss.item()))  # print('loss:', loss.item())
            loss.backward()
            return loss
        return optimizer.step(closure)

    #begin to train
    for i in range(steps):
        printed.append(('STEP: ', i))
        loss = train_step()
        sg.log(loss)
        # begin to predict, no need to track gradient here
        with torch.no_grad():
            future = 20
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            printed.append(('test loss:', loss.item()))
            y = pred.detach().numpy()
        sg.log(pred)
        # (draw the result: matplotlib plots of y saved as predict%d.pdf)
    sg.log(printed)
