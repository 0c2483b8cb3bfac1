"""A trace refused midway is undone and the call rerun eagerly from its start: the lists, dicts
and deques the step's code reads are put back first. A step that takes what the loop queued and
clears the queue (REINFORCE's ``del policy.rewards[:]``), then is refused (here: at the trace's end,
whatever failed), reran on an empty queue: ``torch.cat`` of nothing, the "this call then ran
eagerly from its start" promise broken."""
import collections

import pytest
import torch
from torch import nn

import stepgraph
from stepgraph import pipeline
from stepgraph.errors import CaptureError

pytestmark = pytest.mark.usefixtures("one_thread")


def _program(compiled, kind):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    pending = collections.deque() if kind == "deque" else []
    seen = {}

    def step():
        x = torch.cat(list(pending))
        pending.clear()   # (REINFORCE's ``del policy.rewards[:]``)
        seen["last"] = len(pending)
        out = model(x)
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    fn = stepgraph.compile(step, on_capture_error="eager") if compiled else step
    losses = []
    for _ in range(4):
        pending.extend(torch.randn(3, 4, generator=g) for _ in range(2))
        losses.append(fn())
    return losses, [p.detach().clone() for p in model.parameters()], len(pending), dict(seen)


@pytest.mark.parametrize("kind", ["list", "deque"])
def test_a_refused_call_reruns_on_the_queue_it_cleared(kind, monkeypatch):
    real = pipeline.trace_step

    def fails_at_its_end(*args, **kwargs):   # (whatever failed: here, after the step's last line)
        real(*args, **kwargs)
        raise CaptureError("refused at the trace's end (test)", op="test", where="", fix="none")
    monkeypatch.setattr(pipeline, "trace_step", fails_at_its_end)
    with pytest.warns(UserWarning):
        got = _program(True, kind)
    want = _program(False, kind)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert got[2:] == want[2:]
