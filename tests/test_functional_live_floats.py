"""A float a module attribute holds, annealed between calls, reaching a Python-written
functional: wav2vec2 pretraining's ``model.set_gumbel_temperature(t)`` every step, read by
``F.gumbel_softmax(logits, tau=self.temperature, hard=True)`` (Gumbel-softmax VAEs anneal it the
same way). The functional was one call to the trace's mode, which baked the number (autograd
saves it for the backward): a capture at every call until ``max_captures``, then eager. Now its
body runs under the mode, whose elementwise ops keep it live: one recapture, then replays --
each call compared bitwise with eager, on the CPU and (when present) on CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class Quantizer(nn.Module):   # transformers' Wav2Vec2GumbelVectorQuantizer, trimmed
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.codevectors = nn.Parameter(torch.randn(16, 4))
        self.temperature = 2.0

    def forward(self, x, hard):
        probs = F.gumbel_softmax(self.proj(x).float(), tau=self.temperature, hard=hard)
        return probs @ self.codevectors


def _world(device):
    torch.manual_seed(0)
    q = Quantizer().to(device)
    return q, torch.optim.AdamW(q.parameters(), 1e-2)


def _body(q, opt, x, hard):
    loss = q(x, hard).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("hard", [True, False])
def test_an_annealed_gumbel_temperature_is_read_live(device, hard):
    (qe, oe), (qc, oc) = _world(device), _world(device)
    step = stepgraph.compile(lambda x: _body(qc, oc, x, hard))
    for i in range(8):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(device)
        torch.manual_seed(100 + i)
        want = _body(qe, oe, x, hard)
        torch.manual_seed(100 + i)
        got = step(x)
        assert torch.equal(got, want), i
        for (n, a), b in zip(qc.named_parameters(), qe.parameters()):
            assert torch.equal(a, b), (i, n)
        t = max(2.0 * 0.9 ** i, 0.5)   # (the loop anneals it after each step)
        qe.temperature = qc.temperature = t
    assert step.stats.captures <= 2, step.stats.recaptures
    assert step.stats.replays >= 5
