"""nn.LSTM / nn.GRU / nn.RNN on CUDA with cuDNN: captured as their decomposition into one CUDA
graph (capture/rnns.py) and compared with eager cuDNN over fresh batches (fp tolerance: other
kernels; TF32 off on both sides, see test_footguns.py (q)). Dropout between layers in training
is refused by default (cuDNN's dropout state draws masks no graph can); with
STEPGRAPH_CUDNN_RNN=decompose it is compared with eager on PyTorch's non-cuDNN kernels (the same
generator draws). Packed sequences in a CUDA step are refused with a clear error.

Skipped without CUDA; run with STEPGRAPH_TEST_CUDA=1 (scripts/device_suite.sh).
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import stepgraph
from parity import deterministic_cudnn  # noqa: F401  (fixture)
from parity import rel_err

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("deterministic_cudnn", "no_tf32")]

RTOL = 1e-3
CELLS = ["LSTM", "GRU", "RNN"]


@pytest.fixture
def no_tf32():
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev


def _one_cuda_graph(step):
    cap = step.captures[-1]
    assert cap.backend == "cudagraph" and type(cap.run).__name__ == "CudaGraphRunner", step.explain()
    assert step.stats.captures == 1, step.stats


def _close(what, a, b, worst):
    e = rel_err(a, b)
    worst[what] = max(worst.get(what, 0.0), e)
    assert e <= RTOL, f"{what} differs from eager by {e:.3g}"


def _pair(cell, **kw):
    torch.manual_seed(0)
    a = getattr(nn, cell)(16, 32, num_layers=2, **kw).cuda()
    head = nn.Linear(32 * (2 if kw.get("bidirectional") else 1), 5).cuda()
    mods = nn.ModuleList([a, head])
    twin = copy.deepcopy(mods)
    opt = torch.optim.Adam(mods.parameters(), lr=1e-2, capturable=True)
    topt = torch.optim.Adam(twin.parameters(), lr=1e-2, capturable=True)
    return mods, twin, opt, topt


def _body(mods, opt, batch_first):
    rnn, head = mods

    def step(x, y):
        out, _ = rnn(x)
        last = out[:, -1] if batch_first else out[-1]
        loss = F.cross_entropy(head(last), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _batches(n, batch_first, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (4, 7, 16) if batch_first else (7, 4, 16)
    return [(torch.randn(*shape, device="cuda", generator=g), torch.randint(0, 5, (4,), device="cuda", generator=g))
            for _ in range(n)]


def _compare(mods, twin, opt, topt, step, eager, batches, seeds=False):
    worst = {}
    for k, b in enumerate(batches):
        if seeds:
            torch.manual_seed(k)
        got = step(*b)
        if seeds:
            torch.manual_seed(k)
        _close("loss", got, eager(*b), worst)
    for (n, p), q in zip(mods.named_parameters(), twin.parameters()):
        _close(n, p, q, worst)
    for sa, sb in zip(opt.state.values(), topt.state.values()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            _close(key, sa[key], sb[key], worst)
    return worst


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_cudnn_rnn_captures_into_one_cuda_graph(cell, bidirectional):
    bf = bidirectional
    mods, twin, opt, topt = _pair(cell, bidirectional=bidirectional, batch_first=bf)
    step = stepgraph.compile(_body(mods, opt, bf), backend="cudagraph")
    worst = _compare(mods, twin, opt, topt, step, _body(twin, topt, bf), _batches(7, bf))
    print(f"{cell} bidirectional={bidirectional}: worst rel err {max(worst.values()):.2e}")
    _one_cuda_graph(step)
    assert step.stats.replays == 5, step.stats
    assert not any("cudnn" in str(n.target) for n in step.graph.graph.nodes)


def test_dropout_between_layers_is_refused_by_default():
    """cuDNN's masks come from its own dropout state: by default a step training such an RNN is
    refused before anything changed (it ran eagerly), naming the fixes."""
    mods, twin, opt, topt = _pair("LSTM", dropout=0.3)
    step = stepgraph.compile(_body(mods, opt, False), backend="cudagraph")
    b = _batches(2, False)
    step(*b[0])
    with pytest.raises(stepgraph.CaptureError, match="dropout") as e:
        step(*b[1])
    assert "cudnn.flags(enabled=False)" in str(e.value) and "STEPGRAPH_CUDNN_RNN=decompose" in str(e.value)


@pytest.mark.parametrize("cell", CELLS)
def test_dropout_between_layers_as_eager_without_cudnn(cell, monkeypatch):
    """With STEPGRAPH_CUDNN_RNN=decompose: eager cuDNN draws its dropout masks from its own
    state, so this compares with eager on PyTorch's non-cuDNN kernels, which draw from the same
    generator as the captured decomposition."""
    monkeypatch.setenv("STEPGRAPH_CUDNN_RNN", "decompose")
    mods, twin, opt, topt = _pair(cell, dropout=0.3)
    step = stepgraph.compile(_body(mods, opt, False), backend="cudagraph")
    eager = _body(twin, topt, False)

    def eager_no_cudnn(*b):
        with torch.backends.cudnn.flags(enabled=False):
            return eager(*b)

    def warm_up_without_cudnn(*b):
        # Call 1 is stepgraph's eager warm-up: with cuDNN on it would draw cuDNN's masks (5e-2
        # apart on an H100), so it runs as its eager twin does; calls 2.. are the decomposition.
        if step.stats.eager_calls == 0:
            with torch.backends.cudnn.flags(enabled=False):
                return step(*b)
        return step(*b)
    _compare(mods, twin, opt, topt, warm_up_without_cudnn, eager_no_cudnn, _batches(7, False), seeds=True)
    _one_cuda_graph(step)
    assert step.stats.replays == 5, step.stats


def test_packed_sequence_is_a_clear_error():
    mods, twin, opt, topt = _pair("LSTM", bidirectional=True)
    rnn, head = mods

    def step_fn(x, lengths, y):
        out, _ = rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        out, _ = pad_packed_sequence(out, total_length=x.shape[0])
        loss = F.cross_entropy(head(out[0]), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    step = stepgraph.compile(step_fn, backend="cudagraph")
    b = _batches(2, False)
    lengths = torch.tensor([7, 3, 5, 2])
    step(b[0][0], lengths, b[0][1])
    with pytest.raises(stepgraph.CaptureError, match="packed sequence") as e:
        step(b[1][0], lengths, b[1][1])
    assert "test_cuda_rnn.py" in e.value.where


def test_word_language_model_pattern():
    """clients/word_language_model.py: a 2-layer LSTM LM, bptt windows, the hidden state carried
    (repackaged) between calls, clip_grad_norm_, manual SGD on p.data."""
    from clients.vendor.pytorch_examples.word_language_model_model import RNNModel
    torch.manual_seed(0)
    ntokens, bptt, bsz, lr = 50, 12, 4, 20.0
    model = RNNModel("LSTM", ntokens, 32, 32, 2, 0.0).cuda()
    twin = copy.deepcopy(model)
    criterion = nn.NLLLoss()

    def repackage_hidden(h):
        return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)

    def body(m):
        def train_step(data, targets, hidden):
            m.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = m(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.25)
            for p in m.parameters():
                p.data.add_(p.grad, alpha=-lr)
            return loss, hidden
        return train_step
    step, eager = stepgraph.compile(body(model), backend="cudagraph"), body(twin)
    g = torch.Generator().manual_seed(1)
    stream = torch.randint(0, ntokens, (8 * bptt + 1, bsz), generator=g).cuda()
    h1, h2 = model.init_hidden(bsz), twin.init_hidden(bsz)
    worst = {}
    for it in range(8):
        i = it * bptt
        data, targets = stream[i:i + bptt], stream[i + 1:i + 1 + bptt].reshape(-1)
        (l1, h1), (l2, h2) = step(data, targets, h1), eager(data, targets, h2)
        _close("loss", l1, l2, worst)
        _close("hidden", h1[0], h2[0], worst)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        _close(n, p, q, worst)
        _close(n + ".grad", p.grad, q.grad, worst)
    print(f"word_language_model: worst rel err {max(worst.values()):.2e}")
    _one_cuda_graph(step)
    assert step.stats.replays == 6, step.stats
