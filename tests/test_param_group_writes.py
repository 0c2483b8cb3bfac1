"""What a step leaves in its optimizers' param groups, after every replay as after eager's call
(a probe of schedulers and optimizer libraries found each case silently wrong):

- a chainable LR scheduler stepped in the step on a tensor lr (``fused=True``, ``lr=torch.tensor``):
  its ``group['lr'].fill_`` was recorded in the graph *and* run again after the replay, so
  ExponentialLR decayed twice per call;
- an optimizer's own code that stores a literal in a group (Lookahead's ``counter = 0`` every k
  steps; schedule-free's ``train_mode = True``): the replay left the old value;
- a betas tuple the step assigns from its iteration argument: the capture's tuple stayed;
- a float lr replaced by the user's tensor between calls: replayed as a float, the graph raised
  half-way through the update.
Each is compared bitwise with an eager twin."""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")
S = torch.optim.lr_scheduler


def _batches(n=7):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _plain_step(m, o, sched=None):
    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        if sched is not None:
            sched.step()
        return loss.detach()
    return step


def _same(m1, m2, o1, o2):
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    for g1, g2 in zip(o1.param_groups, o2.param_groups):
        for k in g1:
            if k != "params":
                a, b = g1[k], g2[k]
                assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (k, a, b)


@pytest.mark.parametrize("sched", ["exp", "step", "linear", "cosine"])
def test_a_chainable_scheduler_stepped_in_the_step_on_a_tensor_lr_steps_once_per_call(sched):
    make = {"exp": lambda o: S.ExponentialLR(o, 0.8), "step": lambda o: S.StepLR(o, 1, 0.5),
            "linear": lambda o: S.LinearLR(o, 0.1, total_iters=5), "cosine": lambda o: S.CosineAnnealingLR(o, 6)}[sched]
    m1 = _net()
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2), fused=True) for m in (m1, m2))
    s1, s2 = make(o1), make(o2)
    eager, sg = _plain_step(m1, o1, s1), stepgraph.compile(_plain_step(m2, o2, s2))
    for x, y in _batches():
        assert torch.equal(eager(x, y), sg(x, y))
        _same(m1, m2, o1, o2)
    assert sg.stats.replays >= 4, sg.stats.recaptures


class Lookahead(torch.optim.Optimizer):
    """pytorch_optimizer's Lookahead, reduced: a wrapper whose step (patched by torch as every
    optimizer's is) counts ``group['counter']`` and resets it to a literal every k steps."""

    def __init__(self, optimizer, k=3, alpha=0.5):
        self.optimizer, self.k, self.alpha = optimizer, k, alpha
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        self._patch_step_function()
        self.state, self.defaults = {}, optimizer.defaults
        self.slow = {p: p.detach().clone() for g in self.param_groups for p in g["params"]}
        for g in self.param_groups:
            g.setdefault("counter", 0)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        for group in self.param_groups:
            group["counter"] += 1
            if group["counter"] >= self.k:
                group["counter"] = 0
                with torch.no_grad():
                    for p in group["params"]:
                        self.slow[p].add_(p - self.slow[p], alpha=self.alpha)
                        p.copy_(self.slow[p])
        return loss


class TrainModeAdam(torch.optim.Adam):
    """Schedule-free's shape: ``train()`` / ``eval()`` swap the parameters and flag the group."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        for g in self.param_groups:
            g["train_mode"] = False

    @torch.no_grad()
    def train(self):
        for g in self.param_groups:
            if not g["train_mode"]:
                for p in g["params"]:
                    p.mul_(2.0)
            g["train_mode"] = True

    @torch.no_grad()
    def eval(self):
        for g in self.param_groups:
            if g["train_mode"]:
                for p in g["params"]:
                    p.mul_(0.5)
            g["train_mode"] = False


@pytest.mark.parametrize("kind", ["lookahead", "train_mode", "betas"])
def test_what_the_step_leaves_in_a_param_group_is_there_after_each_replay(kind):
    m1 = _net()
    m2 = copy.deepcopy(m1)
    make = {"lookahead": lambda m: Lookahead(torch.optim.AdamW(m.parameters(), lr=1e-2)),
            "train_mode": lambda m: TrainModeAdam(m.parameters(), lr=1e-2),
            "betas": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)}[kind]
    o1, o2 = make(m1), make(m2)

    def mk(m, o):
        def step(x, y, it):
            if kind == "train_mode":
                o.train()
            if kind == "betas":
                for g in o.param_groups:
                    g["betas"] = (0.95 - 0.005 * it, 0.999)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss.detach()
        return step
    eager, sg = mk(m1, o1), stepgraph.compile(mk(m2, o2))
    for it, (x, y) in enumerate(_batches(9)):
        assert torch.equal(eager(x, y, it), sg(x, y, it)), (it, sg.stats.recaptures)
        _same(m1, m2, o1, o2)
        if kind == "train_mode":
            o1.eval(), o2.eval()   # (evaluation between calls)
            _same(m1, m2, o1, o2)
    assert sg.stats.replays >= 3, sg.stats.recaptures


def test_a_float_lr_replaced_by_a_tensor_between_calls_is_no_replay_of_the_float_graph():
    m1 = _net()
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (m1, m2))
    eager, sg = _plain_step(m1, o1), stepgraph.compile(_plain_step(m2, o2))
    for it, (x, y) in enumerate(_batches(5)):
        if it == 3:
            o1.param_groups[0]["lr"], o2.param_groups[0]["lr"] = torch.tensor(5e-3), torch.tensor(5e-3)
        eager(x, y)
        try:
            sg(x, y)
        except stepgraph.CaptureError as e:   # (Adam reads a tensor lr on the host: refused, clearly)
            assert it >= 3 and "tensor lr" in str(e), e
        _same(m1, m2, o1, o2)


class Rectified(torch.optim.Optimizer):
    """pytorch_optimizer's rectified step (AdaBelief / Ranger) reduced: Python branches on a value
    of its step counter compared with another value of it. No capturable flag exists."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta2, step = group["betas"][1], group["step"]
            beta2_t = beta2 ** step
            n_sma = 2.0 / (1.0 - beta2) - 1.0 - 2 * step * beta2_t / (1.0 - beta2_t)
            rt = 0.5 if n_sma >= 5 + 0.0 * step else 1.0
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * rt)


def test_a_refused_counter_branch_of_an_optimizer_without_a_capturable_form_says_what_to_do():
    m = _net()
    o = Rectified(m.parameters())
    sg = stepgraph.compile(_plain_step(m, o))
    with pytest.raises(stepgraph.CaptureError, match="o has no capturable form: step it outside"):
        for x, y in _batches(3):
            sg(x, y)
