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

    def set_gumbel_temperature(self, t):   # (Wav2Vec2ForPreTraining's: the step never names it)
        self.temperature = t


def _world(device):
    torch.manual_seed(0)
    q = Quantizer().to(device)
    if device == "cuda":   # (a CUDA graph steps AdamW in its capturable form: not bitwise, README)
        return q, torch.optim.SGD(q.parameters(), 1e-2, momentum=0.9)
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
    for i in range(12):   # (on CUDA, 7 of 12 replays were a last bit off when ``x / tau`` divided)
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


class Trainer:
    completed_steps = 0


def _make_step(q, opt, t):
    # run_wav2vec2_pretraining_no_trainer.py: the temperature set at the end of each step from the
    # step count, down to a floor; the closure's floats are read live
    max_t, decay, min_t = 2.0, 0.7, 0.5   # (the floor from the 5th step on)

    def step(x):
        loss = q(x, True).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        q.set_gumbel_temperature(max(max_t * decay ** t.completed_steps, min_t))
        t.completed_steps += 1
        return loss.detach()
    return step


def test_a_temperature_the_step_sets_from_its_count_down_to_a_floor_is_eagers():
    """``max(max_t * decay ** n, min_t)`` compares two live floats: the comparison is guarded,
    not the count (it was keyed by value, a capture per call), and the floor's flip recaptures
    once. Before, the closure floats' keys taken while tracing compared the live floats, which
    baked them: the temperature's recapture said "an op bakes it" of a float read live."""
    (qe, oe), (qc, oc) = _world("cpu"), _world("cpu")
    eager, step = _make_step(qe, oe, Trainer()), stepgraph.compile(_make_step(qc, oc, Trainer()))
    for i in range(10):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        torch.manual_seed(100 + i)
        want = eager(x)
        torch.manual_seed(100 + i)
        assert torch.equal(step(x), want), i
        assert qc.temperature == qe.temperature, i
        for a, b in zip(qc.parameters(), qe.parameters()):
            assert torch.equal(a, b), i
    assert step.stats.captures <= 4, step.stats.recaptures
    assert not any("bakes" in r for r in step.stats.recaptures), step.stats.recaptures
    assert step.stats.replays >= 5


def _w2v(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                                      conv_dim=(8,), conv_stride=(2,), conv_kernel=(3,), codevector_dim=8,
                                      proj_codevector_dim=8, num_codevectors_per_group=4, num_codevector_groups=2)
    m = transformers.Wav2Vec2ForPreTraining(cfg).train()
    return m, torch.optim.AdamW(m.parameters(), 1e-2)


def _make_w2v_step(m, opt, t):
    max_t, min_t, decay = 2.0, 0.5, 0.7   # (run_wav2vec2_pretraining's max/min_gumbel_temperature)

    def step(feats):
        codevectors, perplexity = m.quantizer(feats)
        loss = codevectors.pow(2).mean() + 0.1 * perplexity
        loss.backward()
        opt.step()
        opt.zero_grad()
        m.set_gumbel_temperature(max(max_t * decay ** t.completed_steps, min_t))   # (transformers' setter)
        t.completed_steps += 1
        return loss.detach()
    return step


def test_wav2vec2s_gumbel_temperature_set_in_the_step_is_eagers():
    (me, oe), (mc, oc) = _w2v(), _w2v()
    eager, step = _make_w2v_step(me, oe, Trainer()), stepgraph.compile(_make_w2v_step(mc, oc, Trainer()))
    for i in range(9):
        feats = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(i))
        torch.manual_seed(100 + i)
        want = eager(feats)
        torch.manual_seed(100 + i)
        assert torch.equal(step(feats), want), i
        assert mc.quantizer.temperature == me.quantizer.temperature, i
        for a, b in zip(mc.parameters(), me.parameters()):
            assert torch.equal(a, b), i
    assert step.stats.captures <= 4, step.stats.recaptures
    assert not any("bakes" in r for r in step.stats.recaptures), step.stats.recaptures
    assert step.stats.replays >= 4, step.stats.recaptures


class LabelSmoothing(nn.Module):   # The Annotated Transformer's criterion, as it writes it
    def __init__(self, size, padding_idx, smoothing):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.padding_idx, self.confidence, self.smoothing, self.size = padding_idx, 1.0 - smoothing, smoothing, size

    def forward(self, x, target):
        true_dist = x.data.clone()
        true_dist.fill_(self.smoothing / (self.size - 2))
        true_dist.scatter_(1, target.data.unsqueeze(1), self.confidence)
        true_dist[:, self.padding_idx] = 0
        return self.criterion(x, torch.where(target.unsqueeze(1) == self.padding_idx, 0.0, true_dist).detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_literal_written_into_a_cuda_tensor_is_one_cuda_graph():
    """``true_dist[:, pad] = 0`` traces as ``fill_`` of a 0-dim CPU tensor made from the literal
    (and ``torch.where(m, 0.0, x)`` as ``where`` on one): counted as host work, the step fell
    back to ``replay`` on CUDA ("computes on 0-dim CPU tensors"), silently slower. A literal
    never changes: one CUDA graph, bitwise eager."""
    def world():
        torch.manual_seed(0)
        m = nn.Linear(8, 6).cuda()
        return m, torch.optim.SGD(m.parameters(), 0.1, momentum=0.9), LabelSmoothing(6, 0, 0.1)

    def body(m, opt, crit, x, y):
        loss = crit(m(x).log_softmax(-1), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    (me, oe, ce), (mc, oc, cc) = world(), world()
    step = stepgraph.compile(lambda x, y: body(mc, oc, cc, x, y))
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 8, generator=g).cuda(), torch.randint(0, 6, (16,), generator=g).cuda()
        assert torch.equal(step(x, y), body(me, oe, ce, x, y)), i
        for a, b in zip(mc.parameters(), me.parameters()):
            assert torch.equal(a, b), i
    assert step.captures[-1].backend == "cudagraph", step.explain()
    assert step.stats.replays == 3
