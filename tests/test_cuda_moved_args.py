"""A CUDA step called with CPU batches that it moves to the GPU itself — the DataLoader idiom
``def train_step(x, y): x, y = x.to(device), y.to(device)`` — is captured: the runtime moves those
arguments before the graph (passes/moved_arguments.py). Before, the step was refused ("runs on
CPU tensors inside a CUDA step") or, with a CPU tensor first among the arguments, taken for a
CPU step and never recorded into a CUDA graph."""
import copy

import pytest
import torch
import torch.nn.functional as F

import stepgraph
from stepgraph.optimizers import same_form

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pair():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).cuda()
    m2 = copy.deepcopy(m)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    return m, m2, o, o2


def _make(model, opt, non_blocking=False):
    def step(x, y):
        x, y = x.to("cuda", non_blocking=non_blocking), y.to("cuda", non_blocking=non_blocking)
        loss = F.cross_entropy(model(x.float()), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


@pytest.mark.parametrize("backend", ["auto", "cudagraph", "inductor"])
@pytest.mark.parametrize("pinned", [False, True])
def test_batches_moved_in_the_step(backend, pinned):
    m, m2, o, o2 = _pair()
    step = stepgraph.compile(_make(m, o, non_blocking=pinned), backend=backend)
    eager = _make(m2, o2)
    g = torch.Generator().manual_seed(1)
    for i in range(7):
        if i == 1:   # from the capture on, the eager twin runs the optimizer form stepgraph chose
            same_form(o2)
        x = torch.randn(8, 16, generator=g, dtype=torch.float64)   # (a dtype change in the move too)
        y = torch.randint(0, 3, (8,), generator=g)
        if pinned:
            x, y = x.pin_memory(), y.pin_memory()
        a, b = step(x, y), eager(x, y)
        if backend == "inductor":
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
        else:
            assert torch.equal(a, b)
    for p, q in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-5 if backend == "inductor" else 0, atol=1e-6 if backend == "inductor" else 0)
    assert (step.stats.captures, step.stats.replays) == (1, 5), step.stats
    e = step.captures[0]
    assert e.backend == ("cudagraph" if backend == "auto" else backend), e.backend
    assert [mv.index for mv in e.to_device] == [0, 1]
    assert "moved to the device at each call" in step.explain()


def test_a_cpu_argument_also_used_on_the_cpu_is_not_recorded():
    """Moved and used on the CPU too: a CUDA graph would copy only the capture's values, so
    auto runs that graph on the replay backend (warned), results as eager."""
    m, m2, o, o2 = _pair()

    def make(model, opt):
        def step(x, w):
            loss = F.mse_loss(model(x.to("cuda")), torch.zeros(8, 3, device="cuda")) * w.to("cuda")
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss, (w * 2).sum()
        return step
    step, eager = stepgraph.compile(make(m, o)), make(m2, o2)
    with pytest.warns(UserWarning):
        for _ in range(4):
            x, w = torch.randn(8, 16), torch.rand(())
            (a, c), (b, d) = step(x, w), eager(x, w)
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-7)
            assert torch.equal(c, d)
    assert step.captures[0].backend == "replay" and step.stats.replays == 2
