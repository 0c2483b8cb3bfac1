"""LayerDrop as transformers writes it (wav2vec2, HuBERT, Whisper, BART with layerdrop > 0):
``torch.rand([]) < layerdrop`` per layer decides in Python whether the layer runs. 12 layers are
2**12 paths: each call captured a new graph (seconds each) until max_captures, then ran eagerly
with a fix for code the user does not own (a probe found it). Refused at the first capture now,
with the fix that applies; a single coin (a self-conditioning coin) stays a guarded decision."""
from __future__ import annotations

import pytest
import torch

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class Encoder(torch.nn.Module):
    def __init__(self, layers, layerdrop=0.1):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))
        self.layerdrop = layerdrop
        self.inp = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:   # (modeling_wav2vec2.py's encoder loop)
            skip = False
            if self.training and self.layerdrop > 0.0:
                skip = torch.rand([]) < self.layerdrop
            if not skip:
                x = x + torch.tanh(layer(x))
        return x


def _step(m):
    opt = torch.optim.AdamW(m.parameters(), 1e-3)

    def step(x):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def test_many_layerdrop_coins_are_refused_at_the_first_capture_with_the_fix():
    torch.manual_seed(0)
    sg = stepgraph.compile(_step(Encoder(6)))
    x = torch.randn(4, 8)
    sg(x)
    with pytest.raises(stepgraph.CaptureError, match=r"(?s)6 random coins.*layerdrop = 0\.0"):
        sg(x)
    assert sg.stats.captures == 0


def test_one_coin_stays_a_decision_and_matches_eager():
    torch.manual_seed(0)
    m = Encoder(1, layerdrop=0.5)
    twin = Encoder(1, layerdrop=0.5)
    twin.load_state_dict(m.state_dict())
    sg, eager = stepgraph.compile(_step(m)), _step(twin)
    for i in range(8):
        x = torch.randn(4, 8)
        torch.manual_seed(100 + i)
        want = eager(x)
        torch.manual_seed(100 + i)
        assert torch.equal(want, sg(x)), i
    assert sg.stats.captures <= 3 and sg.stats.replays >= 3, sg.stats.recaptures   # (state of a skipped layer: one more)


_LIBRARY = '''
import random
import torch


class Stack(torch.nn.Module):   # (x-transformers' ``layer_dropout``: ``random() < p`` per layer)
    def __init__(self, layers=4, p=0.1):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))
        self.p = p

    def forward(self, x):
        for layer in self.layers:
            if self.training and random.random() < self.p:
                continue
            x = x + torch.tanh(layer(x))
        if self.training:   # (ResidualVQ's quantize dropout: a randint read on the host)
            keep = torch.randint(1, len(self.layers) + 1, ()).item()
            x = x * keep
        return x
'''


@pytest.mark.parametrize("draw", ["random", "torch"])
def test_a_draw_inside_library_code_names_the_library_line_and_a_fix_the_user_can_apply(draw, as_library):
    """Refused before with fixes for the user's own code ("draw them in the loop outside the
    step", "build what the random draw selects outside ... get_batch") that x-transformers'
    layer_dropout and vector-quantize's quantize_dropout users cannot apply (helper-88)."""
    lib = as_library("drawlib", _LIBRARY)
    torch.manual_seed(0)
    model = lib.Stack(layers=6 if draw == "random" else 1, p=0.2 if draw == "random" else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @stepgraph.compile
    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    with pytest.raises(stepgraph.CaptureError) as e:
        for _ in range(3):   # (a warm-up, another for the grads' new state, the capture)
            step(torch.randn(4, 8))
    assert step.stats.captures == 0, step.stats
    assert "the draw is inside drawlib.py:" in e.value.fix and "graph_module" in e.value.fix, e.value
    assert "test_random_coins.py" in e.value.where, e.value.where


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_coins_their_threshold_decides_are_no_paths(p):
    """PEFT's LoHa/LoKr draw ``torch.rand(1) > module_dropout`` in each adapted layer; at the
    default ``module_dropout=0.0`` the coin always says keep. 12 such coins were refused as 2**12
    LayerDrop paths (helper-89); now each keeps its guard and the step replays, as eager."""
    class Adapted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(12))

        def forward(self, x):
            for layer in self.layers:
                if self.training and (torch.rand(1) > p):
                    x = x + torch.tanh(layer(x))
            return x

    def make():
        torch.manual_seed(0)
        m = Adapted()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x):
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return m, step
    (me, fe), (mc, fc) = make(), make()
    sg = stepgraph.compile(fc)
    for i in range(6):
        x = torch.randn(4, 8)
        torch.manual_seed(10 + i)
        want = fe(x)
        torch.manual_seed(10 + i)
        if p > 0 and i >= 1:
            with pytest.raises(stepgraph.CaptureError, match="12 random coins"):
                sg(x)
            return
        assert torch.equal(sg(x), want), i
        assert all(torch.equal(a, b) for a, b in zip(me.parameters(), mc.parameters())), i
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats
