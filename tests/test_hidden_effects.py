"""Python state the step changes in code it calls, out of its own code's sight: a replay buffer's
``memory.put(transition)`` appending to ``self.buffer`` (a deque) inside the step. A replay runs
no Python code, so it would not append again: before, every replay silently skipped it (the
buffer stopped growing while eager's grew) and the trace left its own proxies of the argument's
numbers in the user's deque. Now the change is refused (CaptureError, the call's state eager's),
and proxies the trace stored inside a tuple are replaced by plain numbers (sinks.scrub)."""
import collections

import pytest
import torch
import torch.nn as nn

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class Buffer:
    def __init__(self):
        self.buffer = collections.deque(maxlen=100)

    def put(self, transition):
        self.buffer.append(transition)


def _net():
    torch.manual_seed(0)
    q = nn.Linear(3, 2)
    return q, torch.optim.SGD(q.parameters(), lr=1e-2)


def train(q, memory, optimizer, x, transition):
    memory.put(transition)
    loss = q(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_a_container_the_step_fills_through_a_method_is_refused_not_silently_skipped():
    (q1, o1), (q2, o2) = _net(), _net()
    m1, m2 = Buffer(), Buffer()
    sg = stepgraph.compile(train)
    refused = 0
    for call in range(5):
        x, t = torch.randn(4, 3), ([0.1 * call, 0.2], call)
        try:
            sg(q1, m1, o1, x, t)
        except stepgraph.CaptureError as e:
            refused += 1
            assert "memory.buffer" in str(e) and "deque" in str(e), str(e)
        train(q2, m2, o2, x, t)
        assert len(m1.buffer) == len(m2.buffer) == call + 1
        assert list(m1.buffer) == list(m2.buffer)
        assert all(type(b[1]) is int for b in m1.buffer), list(m1.buffer)   # no proxy left behind
        for p, q in zip(q1.parameters(), q2.parameters()):
            assert torch.equal(p, q)
    assert refused == 4 and sg.stats.replays == 0, sg.stats
