"""Idioms of vision training recipes (clients/torchvision_segmentation, knowledge_distillation,
activation_checkpointing), each as a small step compared with eager PyTorch on fresh batches:
loss, parameters, grads, optimizer state, and what the program keeps on the host (meters).

* A callable record (haitongli/knowledge-distillation-pytorch's ``RunningAverage``: numbers only,
  ``update(val)`` does ``total += val; steps += 1``, ``__call__`` returns the mean) updated in
  the step: the ``__call__`` made its attributes numbers of their own *and* record attributes;
  ``steps += 1`` was then replayed as the former but checked as the latter, and the capture was
  refused ("rebinds ... to a value it did not compute") with a fix the user had already applied.
"""
import copy

import pytest
import torch

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(make_model=lambda: torch.nn.Linear(8, 3)):
    torch.manual_seed(0)
    m = make_model()
    m2 = copy.deepcopy(m)
    return (m, torch.optim.Adam(m.parameters(), lr=0.01)), (m2, torch.optim.Adam(m2.parameters(), lr=0.01))


def _batches(n, shape=(16, 8), classes=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g))
            for _ in range(n)]


def _same_state(m, o, m2, o2):
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), n
        assert (p.grad is None) == (p2.grad is None) and (p.grad is None or torch.equal(p.grad, p2.grad)), n
    sd, sd2 = o.state_dict(), o2.state_dict()
    for k in sd["state"]:
        for name, v in sd["state"][k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd2["state"][k][name])), (k, name)


class RunningAverage():
    def __init__(self):
        self.steps = 0
        self.total = 0

    def update(self, val):
        self.total += val
        self.steps += 1

    def __call__(self):
        return self.total / float(self.steps)


def test_a_callable_running_average_updated_in_the_step():
    def make(model, opt, state):
        def step(x, y):
            loss_avg = state["loss_avg"]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_avg.update(loss.item())
            return loss
        return step
    (m, o), (m2, o2) = _pair()
    mine, theirs = {}, {}
    sg, eager = stepgraph.compile(make(m, o, mine)), make(m2, o2, theirs)
    batches = _batches(8)
    for epoch in range(2):   # a new RunningAverage each epoch, as train_kd makes one
        mine["loss_avg"], theirs["loss_avg"] = RunningAverage(), RunningAverage()
        for x, y in batches[epoch * 4:(epoch + 1) * 4]:
            a, b = sg(x, y), eager(x, y)
            assert torch.equal(a, b)
            ra, rb = mine["loss_avg"], theirs["loss_avg"]
            assert (ra.steps, ra.total, ra()) == (rb.steps, rb.total, rb())
            assert type(ra.steps) is int and type(ra.total) is float
    _same_state(m, o, m2, o2)
    assert sg.stats.replays >= 5 and sg.stats.captures == 1, sg.stats
