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


def _twin_run(step_of, batches):
    """``step_of(model, opt)`` compiled on one model and eager on its twin, bitwise after each call."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1))
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.AdamW(m.parameters(), lr=1e-3), torch.optim.AdamW(m2.parameters(), lr=1e-3)
    sg, eager = stepgraph.compile(step_of(m, o)), step_of(m2, o2)
    for k, b in enumerate(batches):
        torch.manual_seed(k)
        got = sg(*b)
        torch.manual_seed(k)
        assert torch.equal(got, eager(*b)), k
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters())), k
    return sg


def test_a_shape_decided_by_lengths_is_not_random_behind_dropout():
    """CTC's output shape depends on the target lengths (integers from the batch), not on the
    log-probs behind dropout: guarded by its lengths, captured (Wav2Vec2ForCTC's loss). Before,
    the guard's every upstream op was searched, the dropout found, and the step refused."""
    def step_of(m, o):
        def step(x, targets, in_len, tgt_len):
            lp = m(x).log_softmax(-1).transpose(0, 1)
            loss = F.ctc_loss(lp, targets, in_len, tgt_len)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return step
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 20, 8, generator=g), torch.randint(1, 16, (2, 5), generator=g),
                torch.tensor([20, 20]), torch.tensor([5, 5])) for _ in range(5)]
    sg = _twin_run(step_of, batches)
    assert (sg.stats.captures, sg.stats.replays) == (1, 3), sg.stats


def test_attention_without_dropout_draws_nothing():
    """PyTorch tags every SDPA kernel as random; with ``dropout_p=0`` it draws nothing, so a
    shape decided downstream (``x[mask]``) is guarded, not refused as random."""
    def step_of(m, o):
        def step(x, keep):
            h = m[0](x)[:, None]                                 # (B, 1, T, 16): the flash kernel
            h = F.scaled_dot_product_attention(h, h, h)[:, 0]
            loss = h[(keep > 0) & (h.abs().sum(-1) >= 0)].square().mean()   # rows kept: values decide
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return step
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(2, 6, 8, generator=g), torch.tensor([[1, 0, 1, 1, 0, 1]] * 2)) for _ in range(5)]
    sg = _twin_run(step_of, batches)
    assert (sg.stats.captures, sg.stats.replays) == (1, 3), sg.stats


def test_a_library_draw_gets_a_fix_the_user_can_apply():
    """Wav2Vec2's SpecAugment draws its masks with numpy inside transformers: the user cannot
    move that draw, so the fix names the feature switch or calling that code outside."""
    pytest.importorskip("transformers")
    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices
    m = lm()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        mask = torch.from_numpy(_compute_mask_indices((2, 20), 0.5, 2))
        loss = m(x).mean() * mask.float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    sg = stepgraph.compile(step)
    x = torch.randint(0, 7, (2, 20))
    sg(x)
    with pytest.raises(stepgraph.CaptureError, match="mask_time_prob=0.0") as e:
        sg(x)
    assert "modeling_wav2vec2.py" in str(e.value), str(e.value)


def test_manual_seed_inside_the_step_reseeds_at_each_replay():
    """``torch.manual_seed(1234)`` at the top of the step (the same dropout mask and noise at
    every step): reseeded at each replay as eager reseeds. Before, replays drew on from the
    capture's seed (other masks, other losses, silently)."""
    def step_of(m, o):
        def step(x):
            torch.manual_seed(1234)
            loss = m(x + 0.1 * torch.randn(x.shape)).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return step
    g = torch.Generator().manual_seed(5)
    sg = _twin_run(step_of, [(torch.randn(4, 8, generator=g),) for _ in range(5)])
    assert sg.stats.replays == 3, sg.stats


def test_random_values_selected_by_a_batch_mask_are_no_random_read():
    """ELECTRA's discriminator loss, ``logits[active]`` and ``labels[active]`` with ``active =
    attention_mask == 1`` and labels from the generator's sampling (random): the count selected
    is the mask's. It was refused as "a random value read on the host"; now the shape is guarded
    by the mask and the step replays, bitwise with eager."""
    runs = []
    for compiled in (True, False):
        torch.manual_seed(0)
        m = nn.Linear(8, 1)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)

        def step(x, mask):
            fake = (torch.rand(x.shape[:2]) < 0.3).long()   # which tokens the generator replaced
            active = mask == 1
            loss = F.binary_cross_entropy_with_logits(m(x).squeeze(-1)[active], fake[active].float())
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        f = stepgraph.compile(step) if compiled else step
        mask = torch.ones(3, 5, dtype=torch.long)
        mask[1:, 3:] = 0
        out = []
        for k in range(5):
            torch.manual_seed(10 + k)
            out.append(f(torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(k)), mask.roll(k, 0)))
        runs.append((out, list(m.parameters()), f))
    (got, gp, f), (want, wp, _) = runs
    assert all(torch.equal(a, b) for a, b in zip(got + gp, want + wp))
    assert (f.stats.captures, f.stats.replays) == (1, 3), f.stats


def _float_loss_step(p):
    """PyTorch Geometric's gcn.py ``train()``: ``return float(loss)``, dropout ``p`` in the model."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    opt = torch.optim.Adam(lin.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))

    @stepgraph.compile
    def train():
        opt.zero_grad()
        loss = F.cross_entropy(lin(F.dropout(x, p=p)), y)
        loss.backward()
        opt.step()
        return float(loss)
    return train


def test_float_of_a_loss_behind_dropout_is_refused_with_a_fix_that_fits():
    """``return float(loss)`` with dropout in the model. The refusal said the step "compares" the
    value and to "return it from the step" -- which it already did (helper-80). It now names
    float() and says to return the tensor or ``loss.item()``."""
    train = _float_loss_step(0.5)
    train()
    with pytest.raises(stepgraph.CaptureError, match=r"calls float\(\) on a tensor") as e:
        train()
    assert "return the tensor" in e.value.fix and "item()" in e.value.fix


def test_float_of_a_loss_that_keeps_recapturing_says_to_return_the_tensor(caplog):
    """The same without dropout: a value guard on the loss, missed at every call; the first
    recapture's warning now says what to change."""
    train = _float_loss_step(0.0)
    with caplog.at_level("WARNING", logger="stepgraph"):
        for _ in range(3):
            train()
    assert any("return the tensor" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("draw", ["torch.seed", "Generator.seed"])
def test_a_fresh_seed_drawn_in_the_step_is_refused(draw):
    """HF Reformer reseeds in each layer's forward with a fresh seed (``self.attention_seed =
    int(torch.seed() % sys.maxsize); torch.manual_seed(self.attention_seed)``; on a GPU through
    ``torch.cuda.default_generators[i].seed()``). A replay reseeded with the capture's seed: the
    same dropout masks at every step, silently. Refused at the capture, the call eager's."""
    import sys

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        def forward(self):
            fresh = torch.seed() if draw == "torch.seed" else torch.default_generator.seed()
            self.seed = int(fresh % sys.maxsize)
            torch.manual_seed(self.seed)
            return F.dropout(self.w, 0.5, training=True)
    layer = Layer()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)

    def step():
        m = layer()
        m.sum().backward()
        opt.step()
        opt.zero_grad()
        return m.detach()
    f = stepgraph.compile(step)
    f()
    with pytest.raises(stepgraph.CaptureError, match="fresh random seed") as e:
        f()
    assert "test_random_reads.py" in e.value.where and "outside the step" in e.value.fix
    assert f.stats.replays == 0


@pytest.mark.parametrize("sizes", [(800,), (640, 800)])
def test_a_random_choice_among_one_is_no_random_read(sizes):
    """torchvision's detection transform picks a size with ``int(torch.empty(1).uniform_(0.0,
    float(len(k))).item())`` (``torch_choice``); with its default one-entry ``min_size`` that is
    0 at every call, yet it was refused as a random value, for every detection model. Among two
    it is random, and stays refused."""
    def world():
        torch.manual_seed(0)
        m = nn.Linear(4, 2)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def body(m, opt, x):
        index = int(torch.empty(1).uniform_(0.0, float(len(sizes))).item())
        loss = m(x * (sizes[index] / 800)).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    (me, oe), (mc, oc) = world(), world()
    f = stepgraph.compile(lambda x: body(mc, oc, x))
    for i in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        torch.manual_seed(i)
        want = body(me, oe, x)
        torch.manual_seed(i)
        if len(sizes) > 1 and i == 1:
            with pytest.raises(stepgraph.CaptureError, match="random value"):
                f(x)
            return
        assert torch.equal(f(x), want), i
        assert all(torch.equal(a, b) for a, b in zip(mc.parameters(), me.parameters())), i
    assert f.stats.captures == 1 and f.stats.replays == 3, f.stats
