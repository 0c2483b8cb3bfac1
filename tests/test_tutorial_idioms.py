"""Idioms of classic tutorial training loops (clients/seq2seq_translation*, makemore_*,
transformer_tutorial, char_rnn_classification), each compared with eager PyTorch on fresh batches
per call: loss, parameters, grads and optimizer state."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)

EOS = 1


def _same(a, b):
    assert torch.equal(a, b), (a - b).abs().max()


def _compare_state(m1, m2, o1=None, o2=None):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        _same(a, b)
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            _same(a.grad, b.grad)
    if o1 is not None:
        for s1, s2 in zip(o1.state.values(), o2.state.values()):
            for k in s1:
                _same(torch.as_tensor(s1[k]), torch.as_tensor(s2[k]))


# ---- seq2seq (the pre-2023 tutorial's decoder loop) --------------------------------------
class Decoder(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.emb = nn.Embedding(6, 8)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(8, 6)

    def forward(self, tok):
        return F.log_softmax(self.out(self.drop(self.emb(tok))), dim=1)


def _greedy_step(dec, opt, target, compare):
    """The tutorial's loop without teacher forcing: feed back topk(1), stop at EOS, read on
    the host (``decoder_input.item() == EOS_token``, or ``bool(decoder_input == EOS)``)."""
    opt.zero_grad()
    inp = torch.tensor([0])
    loss = 0
    for di in range(target.size(0)):
        out = dec(inp)
        topv, topi = out.topk(1)
        inp = topi.squeeze(1).detach()
        loss += F.nll_loss(out, target[di:di + 1])
        if compare(inp):
            break
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize("form", ["item_eq", "eq_item"])
def test_decision_on_an_int_read_is_guarded_by_its_outcome_not_its_value(dropout, form):
    """``if decoder_input.item() == EOS_token: break``: the read int (a prediction) differs
    from call to call, the decision mostly not. Guarding the read by value captured again for
    each predicted token (and, behind dropout, refused the step as "a random value read on the
    host" with a get_batch fix that does not apply); the decision is what the graph assumed."""
    compare = {"item_eq": lambda t: t.item() == EOS, "eq_item": lambda t: (t == EOS).item()}[form]
    torch.manual_seed(0)
    d1 = Decoder(dropout)
    d2 = copy.deepcopy(d1)
    o1, o2 = torch.optim.Adam(d1.parameters(), lr=0.05), torch.optim.Adam(d2.parameters(), lr=0.05)
    step = stepgraph.compile(lambda t: _greedy_step(d1, o1, t, compare))
    g = torch.Generator().manual_seed(3)
    for i in range(10):
        target = torch.randint(2, 6, (4,), generator=g)   # EOS never in the target: no shape change
        torch.manual_seed(100 + i)
        l1 = step(target)
        torch.manual_seed(100 + i)
        l2 = _greedy_step(d2, o2, target, compare)
        _same(l1, l2)
        _compare_state(d1, d2, o1, o2)
    s = step.stats
    assert s.replays >= 5, s
    # One graph per number of decoder steps run (an outcome path), never one per token value.
    assert all("was" not in r or "True" in r or "False" in r for r in s.recaptures), s.recaptures


# ---- makemore (nn-zero-to-hero): bare tensors as the model -------------------------------
def test_grads_of_bare_leaf_tensors_the_step_reaches_are_rebound_after_each_replay():
    """makemore part 2: ``parameters = [C, W1, b1, W2, b2]`` are plain tensors with
    ``requires_grad = True`` (no nn.Module, no optimizer), reached through the step's globals;
    ``p.grad = None``, ``loss.backward()``, ``p.data += -lr * p.grad``. The parameters were
    right after a replay but their ``.grad`` stayed the captured call's (read by the lecture's
    update-to-data ratio plots): silently wrong."""
    g = torch.Generator().manual_seed(2147483647)
    C, W1, b1 = torch.randn((27, 4), generator=g), torch.randn((12, 16), generator=g), torch.randn(16, generator=g)
    W2, b2 = torch.randn((16, 27), generator=g), torch.randn(27, generator=g)
    params1 = [C, W1, b1, W2, b2]
    params2 = [p.clone() for p in params1]
    for p in params1 + params2:
        p.requires_grad = True
    X = torch.randint(0, 27, (200, 3), generator=g)
    Y = torch.randint(0, 27, (200,), generator=g)

    def body(parameters, i):
        C, W1, b1, W2, b2 = parameters
        ix = torch.randint(0, X.shape[0], (32,))
        emb = C[X[ix]]
        h = torch.tanh(emb.view(-1, 12) @ W1 + b1)
        loss = F.cross_entropy(h @ W2 + b2, Y[ix])
        for p in parameters:
            p.grad = None
        loss.backward()
        lr = 0.1 if i < 4 else 0.01
        for p in parameters:
            p.data += -lr * p.grad
        return loss

    step = stepgraph.compile(lambda i: body(params1, i))
    for i in range(8):
        torch.manual_seed(i)
        l1 = step(i)
        torch.manual_seed(i)
        l2 = body(params2, i)
        _same(l1, l2)
        for a, b in zip(params1, params2):
            _same(a, b)
            _same(a.grad, b.grad)
    assert step.stats.replays >= 4, step.stats


class _Lin:   # makemore part 3's layers: plain classes that keep their output on self.out
    def __init__(self, w):
        self.weight = w

    def __call__(self, x):
        self.out = x @ self.weight
        return self.out


class _BN:
    def __init__(self, dim, momentum=0.1):
        self.momentum, self.training = momentum, True
        self.gamma, self.beta = torch.ones(dim), torch.zeros(dim)
        self.running_mean, self.running_var = torch.zeros(dim), torch.ones(dim)

    def __call__(self, x):
        xmean, xvar = x.mean(0, keepdim=True), x.var(0, keepdim=True)
        self.out = self.gamma * (x - xmean) / torch.sqrt(xvar + 1e-5) + self.beta
        with torch.no_grad():
            self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * xmean
            self.running_var = (1 - self.momentum) * self.running_var + self.momentum * xvar
        return self.out


class _Tanh:
    def __call__(self, x):
        self.out = torch.tanh(x)
        return self.out


def _net(seed):
    g = torch.Generator().manual_seed(seed)
    layers = [_Lin(torch.randn(6, 8, generator=g)), _BN(8), _Tanh(), _Lin(torch.randn(8, 5, generator=g)), _BN(5)]
    params = [l.weight for l in layers if isinstance(l, _Lin)] + \
             [p for l in layers if isinstance(l, _BN) for p in (l.gamma, l.beta)]
    for p in params:
        p.requires_grad = True
    return layers, params


def _bn_body(layers, params, x, y):
    for layer in layers:
        x = layer(x)
    loss = F.cross_entropy(x, y)
    for layer in layers:
        layer.out.retain_grad()
    for p in params:
        p.grad = None
    loss.backward()
    for p in params:
        p.data += -0.1 * p.grad
    return loss


def test_tensors_stored_on_objects_the_step_iterates_are_written_back_after_each_replay():
    """makemore part 3: ``for layer in layers: x = layer(x)`` where each layer keeps
    ``self.out`` (and its retained ``.grad``) and a BatchNorm rebinds ``self.running_mean`` from
    itself under no_grad. No Source names these objects: replays left the captured call's
    tensors there, and every replay started again from the pre-capture running statistics."""
    l1, p1 = _net(0)
    l2, p2 = _net(0)
    step = stepgraph.compile(lambda x, y: _bn_body(l1, p1, x, y))
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 5, (16,), generator=g)
        _same(step(x, y), _bn_body(l2, p2, x, y))
        for a, b in zip(p1, p2):
            _same(a, b)
            _same(a.grad, b.grad)
        for a, b in zip(l1, l2):
            _same(a.out, b.out)
            _same(a.out.grad, b.out.grad)
            if isinstance(a, _BN):
                _same(a.running_mean, b.running_mean)
                _same(a.running_var, b.running_var)
    assert step.stats.replays >= 4, step.stats
