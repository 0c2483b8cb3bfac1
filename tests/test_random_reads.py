"""Values drawn at random and read on the host inside the step (nanoGPT's ``get_batch``:
``torch.randint`` indices, then Python slicing of a host array) differ at every call: refused
at the first capture with the user's line and a fix, instead of one capture per call until
max_captures. A random *decision* (a bool) takes two values and stays captured and guarded."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

DATA = np.arange(512, dtype=np.int64) % 7


def lm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(7, 16), nn.Linear(16, 7))


def get_batch():
    ix = torch.randint(len(DATA) - 9, (4,))
    x = torch.stack([torch.from_numpy(DATA[i:i + 8]) for i in ix])   # the random read
    y = torch.stack([torch.from_numpy(DATA[i + 1:i + 9]) for i in ix])
    return x, y


def train_step(m, o):
    x, y = get_batch()
    loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
    loss.backward()
    o.step()
    o.zero_grad()
    return loss


def test_batch_indices_drawn_in_the_step_are_refused_at_the_first_capture():
    m1 = lm()
    m2 = copy.deepcopy(m1)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    step = stepgraph.compile(lambda: train_step(m1, o1))
    torch.manual_seed(1)
    step()
    with pytest.raises(stepgraph.CaptureError) as e:
        step()
    err = e.value
    assert "random value" in str(err) and "randint" in str(err), err
    assert __file__ in err.where and "DATA[i:i + 8]" in err.where, err.where
    assert "outside the step" in err.fix and "arguments" in err.fix
    assert step.stats.captures == 0
    # The refused call ran to its end, as eager.
    torch.manual_seed(1)
    train_step(m2, o2), train_step(m2, o2)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_a_random_decision_stays_captured_with_one_graph_per_branch():
    def body(m, o, x, y):
        loss = F.cross_entropy(m(x), y)
        if torch.rand(()) < 0.5:      # stochastic: two values, both captured
            loss = loss * 2
        loss.backward()
        o.step()
        o.zero_grad()
        return loss
    torch.manual_seed(0)
    m1 = nn.Linear(8, 4)
    m2 = copy.deepcopy(m1)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    step = stepgraph.compile(lambda x, y: body(m1, o1, x, y))
    for k in range(10):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        torch.manual_seed(k)
        got = step(x, y)
        torch.manual_seed(k)
        assert torch.equal(got, body(m2, o2, x, y)), k
        assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters())), k
    assert step.stats.captures == 2 and step.stats.replays == 7, step.stats
