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
from collections import defaultdict, deque

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


def _sched_pair(make_sched):
    (m, o), (m2, o2) = _pair()
    return (m, o, make_sched(o)), (m2, o2, make_sched(o2))


@pytest.mark.parametrize("make_sched", [
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda x: (1 - x / 20) ** 0.9),   # torchvision's poly
    lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
], ids=["poly", "steplr"])
def test_a_scheduler_stepped_in_the_step_sets_the_next_lr(make_sched):
    """``optimizer.step(); lr_scheduler.step()`` in the step (torchvision's segmentation body): the
    lr the scheduler set was also written back after each replay as a constant of the graph (the
    capture's lr), over the scheduler's own redone step: every replay trained at the capture's lr."""
    def make(m, o, s):
        def step(x, y):
            loss = torch.nn.functional.cross_entropy(m(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
            s.step()
            return loss
        return step
    (m, o, s), (m2, o2, s2) = _sched_pair(make_sched)
    sg, eager = stepgraph.compile(make(m, o, s)), make(m2, o2, s2)
    for x, y in _batches(7):
        assert torch.equal(sg(x, y), eager(x, y))
        assert o.param_groups[0]["lr"] == o2.param_groups[0]["lr"]
    _same_state(m, o, m2, o2)
    assert sg.stats.captures == 1 and sg.stats.replays == 5, sg.stats


class SmoothedValue:   # torchvision references/*/utils.py's meter, in short
    def __init__(self, window_size=20):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n


class MetricLogger:
    def __init__(self):
        self.meters = defaultdict(SmoothedValue)

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            self.meters[k].update(v)


def test_a_metric_logger_of_deque_meters_updated_in_the_step():
    """``metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])`` after
    ``lr_scheduler.step()`` (torchvision's references; DeiT, MAE, DETR copy it), a new logger each
    epoch: its meters (deques in a defaultdict, reached by a key the code computes) were updated
    at capture only (warned): a replay appended nothing. The call, a statement on an object of the
    user's class holding no model, optimizer or tensor, is now redone after each replay as a
    library's is (the lr it is given is the group's entry, read then); the logger is keyed by
    type, so a new one each epoch is no new graph."""
    def make(m, o, s, box):
        def step(x, y):
            loss = torch.nn.functional.cross_entropy(m(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
            s.step()
            box["ml"].update(loss=loss.item(), lr=o.param_groups[0]["lr"])
            return loss
        return step
    poly = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda x: (1 - x / 20) ** 0.9)  # noqa: E731
    (m, o, s), (m2, o2, s2) = _sched_pair(poly)
    mine, theirs = {}, {}
    sg, eager = stepgraph.compile(make(m, o, s, mine)), make(m2, o2, s2, theirs)
    batches = _batches(8)
    for epoch in range(2):
        mine["ml"], theirs["ml"] = MetricLogger(), MetricLogger()
        for x, y in batches[epoch * 4:(epoch + 1) * 4]:
            assert torch.equal(sg(x, y), eager(x, y))
        for k in ("loss", "lr"):
            a, b = mine["ml"].meters[k], theirs["ml"].meters[k]
            assert list(a.deque) == list(b.deque) and (a.count, a.total) == (b.count, b.total), k
            assert all(type(v) is float for v in a.deque)
    _same_state(m, o, m2, o2)
    assert sg.stats.captures == 1 and sg.stats.replays == 6, sg.stats
