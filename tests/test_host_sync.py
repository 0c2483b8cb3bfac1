"""Host syncs inside a step: the capturing call raises CaptureError pointing at the user's line.

Each offending statement below carries a ``# SYNC`` marker; the test finds its line number
from this file's source and checks ``CaptureError.where`` names exactly that file and line.
The capture call runs the step to its end before raising, so the model and optimizer must
equal an eager twin that ran the same calls in full.
"""
import copy
import inspect
import os
import re

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph


# ---- harness -----------------------------------------------------------------------------
def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def batch(k, n=8):
    g = torch.Generator().manual_seed(2000 + k)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


class Pair:
    """``body(model, opt, *args)`` compiled on one model and run eagerly on a deepcopy."""

    def __init__(self, body, **compile_kw):
        self.model = make_model()
        self.twin = copy.deepcopy(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.topt = torch.optim.AdamW(self.twin.parameters(), lr=1e-3)
        model, opt, twin, topt = self.model, self.opt, self.twin, self.topt

        def step(x, y):
            return body(model, opt, x, y)

        self.step = stepgraph.compile(step, **compile_kw)
        self.eager = lambda x, y: body(twin, topt, x, y)

    def assert_state_equal(self):
        for (name, a), b in zip(self.model.named_parameters(), self.twin.parameters()):
            assert torch.equal(a, b), f"{name} differs from eager"
            assert (a.grad is None) == (b.grad is None), f"{name}.grad presence differs"
            if a.grad is not None:
                assert torch.equal(a.grad, b.grad), f"{name}.grad differs from eager"
        for a, b in zip(self.model.parameters(), self.twin.parameters()):
            sa, sb = self.opt.state.get(a, {}), self.topt.state.get(b, {})
            assert sa.keys() == sb.keys() and sa, "optimizer state missing"
            for k in sa:
                assert torch.equal(sa[k], sb[k]), f"optimizer state {k!r} differs from eager"


def sync_line(body) -> int:
    lines, start = inspect.getsourcelines(body)
    hits = [start + i for i, line in enumerate(lines) if line.rstrip().endswith("# SYNC")]
    assert len(hits) == 1
    return hits[0]


def parse_where(where: str):
    m = re.fullmatch(r"(.+):(\d+) \((.*)\)", where)
    assert m, f"unexpected .where format: {where!r}"
    return m.group(1), int(m.group(2)), m.group(3)


# ---- offending steps: forward, backward, the host sync, optimizer --------------------------
def _item(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    value = loss.item()  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


def _tolist(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    value = loss.tolist()  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


def _numpy(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    array = x.numpy()  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


def _print(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    print(loss)  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


def _fstring(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    text = f"{loss}"  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


def _if(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if loss > 0:  # SYNC
        pass
    opt.step()
    opt.zero_grad()
    return loss


def _float(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    value = float(loss)  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


def _nonzero(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    where = torch.nonzero(x)  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


def _bool_mask(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    positive = x[x > 0]  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


def _unique(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    values = torch.unique(x)  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


def _masked_select(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    m = x > 0
    selected = x.masked_select(m)  # SYNC
    opt.step()
    opt.zero_grad()
    return loss


CASES = [  # (body, a word the op name must contain)
    (_item, "item"), (_tolist, "tolist"), (_numpy, "numpy"), (_print, "print"),
    (_fstring, "format"), (_if, "bool"), (_float, "float"), (_nonzero, "nonzero"),
    (_bool_mask, "index"), (_unique, "unique"), (_masked_select, "masked_select"),
]


@pytest.mark.parametrize("body,op_word", CASES, ids=[b.__name__.strip("_") for b, _ in CASES])
def test_host_sync_raises_at_capture_with_user_line(body, op_word, capsys):
    # host_reads="error": the refusal contract (by default scalar reads are guarded or live:
    # tests/test_host_reads.py); data-dependent shapes, tolist and numpy are refused either way.
    p = Pair(body, host_reads="error")
    x, y = batch(0)
    p.step(x, y)  # warm-up: eager, no error
    p.eager(x, y)
    assert p.step.stats.eager_calls == 1
    x, y = batch(1)
    with pytest.raises(stepgraph.CaptureError) as info:
        p.step(x, y)
    p.eager(x, y)  # the twin runs call 2 in full
    err = info.value
    assert isinstance(err, stepgraph.StepGraphError)
    file, line, code = parse_where(err.where)
    assert os.path.abspath(file) == os.path.abspath(__file__)
    assert line == sync_line(body), f"{err.where} is not the # SYNC line {sync_line(body)}"
    with open(__file__) as f:
        assert code == f.read().splitlines()[line - 1].strip()  # "(code)" is that line's text
    assert op_word in err.op.lower(), err.op
    assert err.op in str(err)
    assert err.where in str(err)
    assert err.fix.strip() and err.fix in str(err)
    s = p.step.stats
    assert (s.eager_calls, s.captures, s.replays, s.failed_captures) == (1, 0, 0, 1)
    p.assert_state_equal()  # the capture call ran the whole step before raising


def test_message_does_not_blame_torch_for_a_direct_host_read():
    """``loss.item()`` is the user's own call: no ``(inside torch/...)`` frame in the message."""
    p = Pair(_item, host_reads="error")
    p.step(*batch(0))
    with pytest.raises(stepgraph.CaptureError) as info:
        p.step(*batch(1))
    head = str(info.value).splitlines()[0]
    assert "inside" not in head, head


def _raise_on_second_call(calls):
    # ``calls`` is an itertools.count: a counter the step reads and changes in a list would be
    # refused (a Python side effect); the step's exception is what this test is about.
    def body(model, opt, x, y):
        n = next(calls)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if n == 2:
            raise ValueError("boom")
        opt.step()
        opt.zero_grad()
        return loss
    return body


def test_user_exception_propagates_unchanged_and_step_recovers():
    p = Pair(_raise_on_second_call(itertools.count(1)))
    twin_calls = itertools.count(1)
    eager = _raise_on_second_call(twin_calls)
    p.eager = lambda x, y: eager(p.twin, p.topt, x, y)
    p.step(*batch(0))
    p.eager(*batch(0))
    with pytest.raises(ValueError, match="^boom$") as info:
        p.step(*batch(1))
    assert type(info.value) is ValueError
    with pytest.raises(ValueError, match="^boom$"):
        p.eager(*batch(1))
    p.assert_state_equal()  # params, grads (left from backward) and optimizer state
    assert all(q.grad is not None for q in p.model.parameters())
    assert p.step.stats.captures == 0 and p.step.stats.failed_captures == 1
    # The next calls work: call 3 accumulates into the grads call 2 left behind, exactly as eager.
    for k in range(2, 7):
        got, want = p.step(*batch(k)), p.eager(*batch(k))
        assert torch.equal(got, want)
        p.assert_state_equal()
    # Call 3 captures with the leftover grads as inputs; call 4 (grads now None) recaptures once;
    # calls 5-7 replay.
    s = p.step.stats
    assert (s.eager_calls, s.captures, s.replays, s.failed_captures) == (1, 2, 3, 1), s
    assert len(s.recaptures) == 1 and ".grad" in s.recaptures[0], s.recaptures


def test_on_capture_error_eager_falls_back_for_good():
    p = Pair(_item, on_capture_error="eager", host_reads="error")
    p.step(*batch(0))
    p.eager(*batch(0))
    # The failing call ran eagerly to its end: its result comes back with a warning, no raise.
    with pytest.warns(UserWarning, match="runs eagerly from now on"):
        got = p.step(*batch(1))
    assert torch.equal(got, p.eager(*batch(1)))
    p.assert_state_equal()
    for k in range(2, 6):
        got, want = p.step(*batch(k)), p.eager(*batch(k))
        assert torch.equal(got, want)
        assert got.grad_fn is not None  # an eager result, not a replay
        p.assert_state_equal()
    s = p.step.stats
    assert (s.eager_calls, s.captures, s.replays, s.failed_captures) == (5, 0, 0, 1)


def test_integer_tensor_indexing_is_captured():
    def body(model, opt, x, y, idx):
        loss = F.cross_entropy(model(x)[idx], y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    model = make_model()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    step = stepgraph.compile(lambda x, y, idx: body(model, opt, x, y, idx))
    for k in range(5):
        x, y = batch(k)
        idx = torch.randint(0, 8, (6,), generator=torch.Generator().manual_seed(k), dtype=torch.int64)
        got = step(x, y, idx)  # must not raise
        want = body(twin, topt, x, y, idx)
        assert torch.equal(got, want)  # replays read each call's idx values
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b)
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays, s.failed_captures) == (1, 1, 3, 0)
