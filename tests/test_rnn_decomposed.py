"""nn.LSTM / nn.GRU / nn.RNN captured as their decomposition (capture/rnns.py), the form a CUDA
step with cuDNN takes, forced on the CPU (``rnns._FORCE``) and compared with eager over fresh
batches: bidirectional, two layers, dropout between them, batch_first, packed sequences (their
batch sizes guarded by value: new lengths recapture). tests/test_cuda_rnn.py runs it on the GPU.
"""
import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import stepgraph
import stepgraph.capture.rnns as rnns

pytestmark = pytest.mark.usefixtures("one_thread")
CELLS = ["LSTM", "GRU", "RNN"]


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(rnns, "_FORCE", True)


def _pair(cell, **kw):
    torch.manual_seed(0)
    a = getattr(nn, cell)(4, 8, num_layers=2, **kw)
    b = copy.deepcopy(a)
    return a, b, torch.optim.Adam(a.parameters(), lr=0.01), torch.optim.Adam(b.parameters(), lr=0.01)


def _step(mod, opt, packed=False, batch_first=False):
    def step(x, lengths=None):
        if packed:
            x = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)
        out, h = mod(x)
        if packed:
            out, _ = pad_packed_sequence(out, batch_first=batch_first, total_length=5)
        h = h[0] if isinstance(h, tuple) else h
        loss = out.pow(2).mean() + h.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _compare(a, b, oa, ob, packed=False, batch_first=False, calls=6, lengths=None):
    sg, eager = stepgraph.compile(_step(a, oa, packed, batch_first)), _step(b, ob, packed, batch_first)
    for k in range(calls):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(*((3, 5, 4) if batch_first else (5, 3, 4)), generator=g)
        ln = lengths(k) if lengths else torch.tensor([2, 5, 3])
        torch.manual_seed(100 + k)   # dropout: both draw the same masks
        got = sg(x, ln)
        torch.manual_seed(100 + k)
        want = eager(x, ln)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-7)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for sa, sb in zip(oa.state.values(), ob.state.values()):
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    return sg


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_decomposed_rnn_matches_eager(forced, cell, bidirectional, packed):
    a, b, oa, ob = _pair(cell, bidirectional=bidirectional, batch_first=bidirectional)
    sg = _compare(a, b, oa, ob, packed, batch_first=bidirectional)
    assert sg.stats.replays == 4, sg.stats
    ops = {str(n.target) for n in sg.graph.graph.nodes if n.op == "call_function"} if sg.graph else set()
    assert not any("mkldnn_rnn" in o or "lstm.input" in o or "gru.input" in o for o in ops), ops


@pytest.mark.parametrize("cell", CELLS)
def test_dropout_between_layers_draws_as_eager(forced, cell):
    """PyTorch's own decomposition never applies it (its condition ``num_layers < i - 1``)."""
    a, b, oa, ob = _pair(cell, dropout=0.5)
    sg = _compare(a, b, oa, ob)
    assert sg.stats.replays == 4
    assert any("dropout" in str(n.target) or "bernoulli" in str(n.target) for n in sg.graph.graph.nodes)


def test_new_lengths_recapture_instead_of_replaying_wrong_rows(forced):
    a, b, oa, ob = _pair("LSTM", bidirectional=True)
    lens = [[2, 5, 3]] * 3 + [[5, 1, 4]] * 3
    sg = _compare(a, b, oa, ob, packed=True, lengths=lambda k: torch.tensor(lens[k]))
    assert sg.stats.replays == 3, sg.stats


def test_packed_lengths_guarded_on_native_kernels_too():
    """Not forced: the CPU's own packed kernels bake the batch sizes; a replay with other
    lengths crashed (or ran on the wrong rows) before the guard."""
    a, b, oa, ob = _pair("GRU", bidirectional=True)
    lens = [[2, 5, 3]] * 3 + [[5, 1, 4]] * 3
    _compare(a, b, oa, ob, packed=True, lengths=lambda k: torch.tensor(lens[k]))
