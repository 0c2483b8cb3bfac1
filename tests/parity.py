"""Shared harness: drive a stepgraph step and an eager twin with the same fresh batches."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import stepgraph
from stepgraph.tools import models

OPTIMIZERS = {
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **kw),
    "rmsprop": lambda ps, **kw: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True, **kw),
    "adagrad": lambda ps, **kw: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=1e-3, **kw),
}
FORMS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
HAS_FUSED = {"sgd", "adam", "adamw", "adagrad"}


@dataclass
class ParityReport:
    steps: int
    max_rel: dict = field(default_factory=dict)   # what -> max relative error seen
    stats: object = None

    def worst(self) -> float:
        return max(self.max_rel.values(), default=0.0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    # (b moves to a's device: on CUDA, stepgraph's optimizer holds its step counter on the GPU
    # (capturable form) where an eager twin keeps it on the CPU)
    a, b = a.detach().double(), b.detach().double().to(a.device)
    if torch.equal(a, b):
        return 0.0
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def ce_step(model, opt):
    """A classification step ``cross_entropy(model(x), y)`` -> backward -> step -> zero_grad."""
    return models.train_step(model, lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y), opt)


def make_step(case, opt):
    return models.train_step(case.model, case.loss_fn, opt)


def run_parity(family: str, opt_name: str, form: str = "default", *, steps: int = 7, device="cpu",
               backend="auto", config=None, rtol=0.0, same_config=True) -> ParityReport:
    """Capture on batch 1, replay on fresh batches; compare every step with an eager twin.

    ``rtol=0`` demands bitwise equality; otherwise a relative tolerance per tensor.
    """
    config = dict(config or {}, device=device)
    case = models.build(family, **config)
    twin = case.fresh()
    kw = FORMS[form]
    opt = OPTIMIZERS[opt_name](case.model.parameters(), **kw)
    opt2 = OPTIMIZERS[opt_name](twin.model.parameters(), **kw)
    step = stepgraph.compile(make_step(case, opt), backend=backend)
    eager = make_step(twin, opt2)
    if device == "cuda" and same_config:
        # Give the eager twin the optimizer form stepgraph switches to on the GPU (PyTorch's
        # capturable path, tensor lr), so the comparison is kernel for kernel.
        from stepgraph.optimizers import same_form
        twin_prepared = [False]

        def eager(*batch, _inner=eager):
            if not twin_prepared[0] and step.stats.captures:
                same_form(opt2)
                twin_prepared[0] = True
            return _inner(*batch)
    rep = ParityReport(steps)

    def note(what, a, b):
        e = rel_err(a, b)
        rep.max_rel[what] = max(rep.max_rel.get(what, 0.0), e)
        assert e <= rtol, f"{family}/{opt_name}/{form}: {what} differs from eager by {e:.3g} (rtol {rtol})"

    for i in range(steps):
        batch = case.make_batch(1000 + i)  # a fresh batch every step
        if backend == "inductor" and i == 3:
            # Steps 1-2 ran while Inductor compiled in the background (capture, then one
            # unfused replay); from here on the fused graph runs.
            assert step.wait_compiled(), step.explain()
        out = step(*batch)
        ref = eager(*batch)
        note("loss", out, ref)
    for (n, p), p2 in zip(case.model.named_parameters(), twin.model.parameters()):
        note(f"param {n}", p, p2)
        if p2.grad is not None or p.grad is not None:
            assert p.grad is not None and p2.grad is not None, f"grad presence differs for {n}"
            note(f"grad {n}", p.grad, p2.grad)
    for (n, b), b2 in zip(case.model.named_buffers(), twin.model.buffers()):
        note(f"buffer {n}", b, b2)
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        assert s1.keys() == s2.keys()
        for k in s1:
            if isinstance(s1[k], torch.Tensor):
                note(f"opt state {k}", s1[k].to(s2[k].device), s2[k])
    st = step.stats
    assert st.eager_calls == 1 and st.captures == 1 and st.replays == steps - 2, (st, step.explain())
    rep.stats = st
    return rep


@pytest.fixture
def deterministic_cudnn():
    """GPU parity tests: cuDNN's conv weight-gradient kernels may use atomics, so eager vs
    eager would differ run to run; pin deterministic algorithms for the test."""
    prev = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev
