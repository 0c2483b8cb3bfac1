"""A recurrent state the step rebinds to a tuple of tensors it computes (capture/pyeffects.py):
the word-language-model loop body with ``nonlocal hidden`` (an LSTM's ``(h, c)``, detached at
each call), Transformer-XL's ``loss, mems = ret[0], ret[1:]``. Each element is a graph input read
at each call, keyed by its metadata, and the new tuple is written back after each replay; before,
such a step was refused ("rebinds mems to a tuple of 3 tensors it computes"). Compared with the
same loop run eagerly, bitwise, hidden state included."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph
from carried import rnn_state_step, tuple_state_step

pytestmark = pytest.mark.usefixtures("one_thread")
V, H, T, B = 20, 16, 5, 3


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.out = nn.Embedding(V, H), nn.LSTM(H, H, 2), nn.Linear(H, V)

    def forward(self, x, hidden):
        y, hidden = self.rnn(self.emb(x), hidden)
        return self.out(y), hidden


def repackage_hidden(h):
    """pytorch/examples' word_language_model: detach the state from its history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def _train(compile_it, calls=8):
    model = LM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    hidden = (torch.zeros(2, B, H), torch.zeros(2, B, H))

    def train_step(data, targets):
        nonlocal hidden
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = F.cross_entropy(output.view(-1, V), targets.view(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        return loss.detach()
    step = stepgraph.compile(train_step) if compile_it else train_step
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(calls):
        data = torch.randint(0, V, (T, B), generator=g)
        out.append((step(data, torch.randint(0, V, (T, B), generator=g)), tuple(t.clone() for t in hidden)))
    return out, model, step


def test_lstm_hidden_rebound_in_the_step_is_carried_like_eager():
    got, m1, sg = _train(True)
    want, m2, _ = _train(False)
    assert sg.stats.replays >= 5 and sg.stats.captures == 1, sg.stats
    for (l1, h1), (l2, h2) in zip(got, want):
        assert torch.equal(l1, l2)
        assert all(torch.equal(a, b) for a, b in zip(h1, h2))
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert "tuple of 2 tensors" in sg.explain()


def test_a_state_that_starts_empty_gets_one_more_graph():
    """Transformer-XL's ``mems = tuple()`` before the first batch: the first call sees no memory,
    every later one a tuple of tensors the step made."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    def make():
        mems = ()

        def step(x):
            nonlocal mems
            h = lin(x + (mems[0] if mems else 0))
            loss = h.pow(2).mean()
            mems = (h.detach(), (2 * h).detach())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step, lambda: mems
    (sg, sg_mems), (eager, eager_mems) = make(), make()
    sg = stepgraph.compile(sg)
    w0 = [p.detach().clone() for p in lin.parameters()]
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 4, generator=g) for _ in range(7)]
    got = [sg(x) for x in xs]
    got_mems = sg_mems()
    with torch.no_grad():
        for p, w in zip(lin.parameters(), w0):
            p.copy_(w)
    want = [eager(x) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(got_mems) == 2 and all(torch.equal(a, b) for a, b in zip(got_mems, eager_mems()))
    assert sg.stats.replays >= 3, sg.stats


def test_a_carried_list_changed_in_place_is_refused():
    """A state list the step rebinds on one path and writes into on another (``mems[0] = h``):
    keyed by its tensors' metadata, an in-place change would go unseen, so it is refused."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mems = [torch.zeros(3, 4)]

    def step(x, reset):
        nonlocal mems
        if reset:
            mems = [torch.zeros(3, 4)]
        h = lin(x + mems[0])
        loss = h.pow(2).mean()
        mems[0] = h.detach()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    sg = stepgraph.compile(step)
    sg(torch.randn(3, 4), False)
    with pytest.raises(stepgraph.CaptureError, match="in place"):
        sg(torch.randn(3, 4), False)


def test_elements_the_step_reads_by_index_come_with_the_tuple():
    """``x + mems[0] - 0.5 * mems[1]``: the step's code reads the elements by index (Python values
    of their own); they are read with the carried tuple, not refused as rebound tensors."""
    (a, ma), (b, mb) = tuple_state_step(), tuple_state_step()
    sg = stepgraph.compile(a)
    g = torch.Generator().manual_seed(4)
    for _ in range(6):
        x = torch.randn(4, 8, generator=g)
        assert torch.equal(sg(x), b(x))
        assert all(torch.equal(p, q) for p, q in zip(ma(), mb()))
    assert sg.stats.replays == 4 and not sg.stats.recaptures


def test_a_gru_hidden_tensor_rebound_in_the_step_is_carried():
    """A single tensor state (``nonlocal hidden; hidden = hidden.detach(); out, hidden = gru(x,
    hidden)``): the eager warm-up leaves it with history, which the step detaches; an input too."""
    (a, ha), (b, hb) = rnn_state_step("gru"), rnn_state_step("gru")
    sg = stepgraph.compile(a)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        x, y = torch.randn(5, 2, 4, generator=g), torch.randn(5, 2, 4, generator=g)
        assert torch.equal(sg(x, y), b(x, y))
        assert torch.equal(ha(), hb())
    assert sg.stats.replays == 4


def test_an_lstm_under_no_grad_replays_bitwise():
    """An evaluation step running an LSTM under ``torch.no_grad()``: the replay ran the mkldnn
    RNN kernel in grad mode (as a training step needs, for its workspace), which rounds otherwise
    than eager's no-grad kernel (3.7e-8 apart); now it runs in the grad mode the trace saw."""
    torch.manual_seed(0)
    lstm = nn.LSTM(16, 16, 2)
    h0 = (torch.randn(2, 3, 16), torch.randn(2, 3, 16))

    def eval_step(x):
        with torch.no_grad():
            y, (h, c) = lstm(x, h0)
        return y, h
    sg = stepgraph.compile(eval_step)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(5, 3, 16, generator=g)
        a, b = sg(x), eval_step(x)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert sg.stats.replays == 2
