"""Python numbers a step reads are guarded only where the captured computation uses them
(capture/tracked.py): an ``epoch`` argument that is only printed, a meter made anew each epoch
that only logs, a global step counter passed along and ignored -- no recapture. Where the
number is used (arithmetic into the loss, a list index, ``math.cos``, a string used as a key,
a returned value, a branch) the graph keeps a check and a new value recaptures. Every call is
compared bitwise with eager PyTorch on a twin model."""
import copy
import logging
import math

import pytest

import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

log = logging.getLogger("test_tracked_numbers")


def batch(k):
    g = torch.Generator().manual_seed(900 + k)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


class Twin:
    """``body(model, opt, x, y, *extra)`` compiled on one model, eager on its twin."""

    def __init__(self, body, model=None):
        torch.manual_seed(0)
        self.m1 = model or nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.m2 = copy.deepcopy(self.m1)
        self.o1 = torch.optim.SGD(self.m1.parameters(), lr=0.1, momentum=0.9)
        self.o2 = torch.optim.SGD(self.m2.parameters(), lr=0.1, momentum=0.9)
        self.body = body
        self.step = stepgraph.compile(lambda x, y, *extra: body(self.m1, self.o1, x, y, *extra))

    def __call__(self, k, *extra, eager_extra=None):
        got = self.step(*batch(k), *extra)
        want = self.body(self.m2, self.o2, *batch(k), *(extra if eager_extra is None else eager_extra))
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else (a == b and type(a) is type(b))), (k, a, b)
        for p, q in zip(self.m1.parameters(), self.m2.parameters()):
            assert torch.equal(p, q), k
        return got

    @property
    def stats(self):
        return self.step.stats


def sgd(m, o, x, y, scale=1):
    loss = F.cross_entropy(m(x), y) * scale
    loss.backward()
    o.step()
    o.zero_grad()
    return loss


def test_an_epoch_argument_only_printed_or_logged_never_recaptures(capsys):
    def body(m, o, x, y, epoch):
        loss = sgd(m, o, x, y)
        print('Epoch: {:04d}'.format(epoch + 1), f"epoch {epoch:03d} ({epoch / 10:.1f})")
        print("epoch", epoch)
        log.info("epoch %d", epoch)
        return loss
    t = Twin(body)
    for e in range(6):
        t(e, e)
    assert (t.stats.captures, t.stats.replays, t.stats.recaptures) == (1, 4, []), t.stats
    assert "Epoch: 0002" in capsys.readouterr().out   # (the capture printed, as before)
    assert "not used by the graph (no guard): extra" in t.step.explain(), t.step.explain()


def test_an_argument_used_in_the_loss_recaptures_with_the_expression():
    t = Twin(lambda m, o, x, y, epoch: sgd(m, o, x, y, scale=epoch + 1))
    for e in [1, 2, 2, 3, 2]:
        t(e, e)   # 2 captured, 2 replayed, 3 captured, 2 replays its graph
    assert t.stats.captures == 2 and t.stats.replays == 2, t.stats
    assert " + 1 3 -> 4 (at " in t.stats.recaptures[0], t.stats.recaptures


def test_a_number_reaching_c_code_directly_is_used():
    # A list index, range(), math.cos: C code that an int subclass would slip through unseen.
    scales = [0.5, 1.0, 2.0]

    def body(m, o, x, y, i, n):
        s = scales[i % 3] * math.cos(math.pi * i / 8)
        for _ in range(n):
            s = s * 1.5
        return sgd(m, o, x, y, scale=s)
    t = Twin(body)
    for k, (i, n) in enumerate([(0, 1), (1, 1), (1, 1), (2, 1), (2, 2), (2, 2), (1, 1)]):
        t(k, i, n)
    assert t.stats.captures == 3 and t.stats.replays == 3, t.stats


def test_text_made_from_a_number_and_used_as_a_key_is_used():
    heads = nn.ModuleDict({"h0": nn.Linear(8, 4), "h1": nn.Linear(8, 4)})

    def body(m, o, x, y, task):
        name = f"h{task}"
        loss = F.cross_entropy(m[name](x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss
    t = Twin(body, model=heads)
    for k, task in enumerate([0, 1, 0, 1, 0, 1, 1, 0]):
        t(k, task)
    # Task 1's first call creates h1's optimizer state: a warm-up of it (its graph, keyed by the
    # state before, could never replay); then a graph per task (the check on ``task`` failed).
    assert (t.stats.captures, t.stats.replays, t.stats.new_state_warmups) == (2, 4, 1), t.stats
    assert " 0 -> 1 (at " in t.stats.recaptures[0], t.stats.recaptures


def test_a_branch_on_the_epoch_keeps_one_graph_per_outcome(capsys):
    def body(m, o, x, y, epoch, every):
        loss = sgd(m, o, x, y)
        if epoch % every == 0:
            print(f"epoch {epoch}: {loss.item():.3f}")
        return loss
    t = Twin(body)
    for e in range(1, 13):
        t(e, e, 4)
    assert (t.stats.captures, t.stats.replays) == (2, 9), t.stats
    assert len(t.stats.recaptures) == 1 and "== 0 False -> True" in t.stats.recaptures[0], t.stats.recaptures


def test_a_returned_number_is_computed_again_at_each_replay():
    # (it was checked: each new epoch recaptured)
    t = Twin(lambda m, o, x, y, epoch: (sgd(m, o, x, y), epoch * 2))
    for e in range(6):
        assert t(e, e)[1] == 2 * e
    assert (t.stats.captures, t.stats.replays) == (1, 4), t.stats


def test_isinstance_of_a_number_is_checked():
    def body(m, o, x, y, s):
        return sgd(m, o, x, y, scale=2.0 if isinstance(s, float) else 1.0)
    t = Twin(body)
    for k, s in enumerate([1, 2, 3.0, 4.0, 5]):
        t(k, s)
    assert t.stats.captures == 2 and t.stats.replays == 2, t.stats


COUNTER = 0
WEIGHT = 1


def _global_step(m, o, x, y):
    loss = sgd(m, o, x, y, scale=WEIGHT)
    log.info("global step %s", COUNTER)   # only logged
    return loss


def test_a_global_only_logged_is_free_and_a_global_used_recaptures():
    global COUNTER, WEIGHT
    t = Twin(lambda m, o, x, y: _global_step(m, o, x, y))
    for k in range(6):
        COUNTER += 7
        WEIGHT = 1 if k < 4 else 3
        t(k)
    assert t.stats.captures == 2 and t.stats.replays == 3, t.stats
    assert "WEIGHT 1 -> 3" in t.stats.recaptures[0], t.stats.recaptures


class Meter:
    def __init__(self):
        self.name, self.val, self.sum, self.count = "loss", 0, 0, 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n


def test_a_meter_made_each_epoch_that_only_logs_needs_no_recapture():
    meters = {}

    def body(m, o, x, y):
        loss = sgd(m, o, x, y)
        meters["loss"].update(loss.item(), x.shape[0])
        return loss
    t = Twin(body)
    for k in range(8):
        if k % 3 == 0:
            meters["loss"] = Meter()
        t(k)
    assert (t.stats.captures, t.stats.replays) == (1, 6), t.stats
    assert type(meters["loss"].count) is int and type(meters["loss"].sum) is float  # no proxy left


def test_a_meter_value_used_in_the_loss_is_checked():
    meters = {}

    def body(m, o, x, y):
        return sgd(m, o, x, y, scale=1.0 / meters["cfg"].count)
    t = Twin(body)
    for k in range(6):
        if k % 2 == 0:
            meters["cfg"] = Meter()
            meters["cfg"].count = 1 + k // 4
        t(k)
    assert t.stats.captures == 2 and t.stats.replays == 3, t.stats
    assert "meters['cfg'].count" in t.stats.recaptures[0], t.stats.recaptures


def test_a_number_stored_by_the_step_is_left_plain():
    seen = {}

    def body(m, o, x, y, epoch):
        seen["epoch"], seen["next"] = epoch, [epoch + 1]
        return sgd(m, o, x, y)
    t = Twin(body)
    t(0, 0)
    # (a list built from the step's number, stored into the dict: no replay would store it again,
    # so the capture is refused -- a recapture per call while the dict's items went unseen; the
    # refused call ran eagerly, storing plain numbers all the same)
    with pytest.raises(stepgraph.CaptureError, match=r"seen\['next'\]"):
        t(1, 1)
    assert type(seen["epoch"]) is int and type(seen["next"][0]) is int, seen


class _Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.calls = nn.Linear(8, 4), 0

    def forward(self, x):
        self.calls += 1                 # a counter the model's forward keeps
        return self.l(x)


class _Trainer:
    """A training loop written as a class (fairseq, Lightning-free trainers): the step is a
    bound method whose ``self`` holds the model and optimizer and counts steps."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = _Counted()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.global_step, self.model.num_updates = 0, 0

    def train_step(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.global_step += 1
        self.model.num_updates += 1
        return loss


def test_counters_on_the_trainer_and_the_model_are_replayed():
    # Before, ``self.x += 1`` on an object holding modules (the bound method's self, the model,
    # the model's forward) was keyed by the object's identity only: each replay dropped it (2
    # after 6 calls, silently).
    a, b = _Trainer(), _Trainer()
    step = stepgraph.compile(a.train_step)
    for k in range(6):
        assert torch.equal(step(*batch(k)), b.train_step(*batch(k)))
        assert (a.global_step, a.model.num_updates, a.model.calls) == (b.global_step, b.model.num_updates,
                                                                        b.model.calls) == (k + 1,) * 3, k
    assert (step.stats.captures, step.stats.replays) == (1, 4), step.stats.recaptures


def test_a_counter_on_a_simple_namespace_is_replayed():
    import types
    ns, ns2 = types.SimpleNamespace(n=0), types.SimpleNamespace(n=0)

    def body(m, o, x, y):
        s = ns if m is t.m1 else ns2
        loss = sgd(m, o, x, y)
        s.n = s.n + 1      # (was refused: "the step changes the Python value s.n")
        return loss
    t = Twin(body)
    for k in range(5):
        t(k)
        assert ns.n == ns2.n == k + 1
    assert t.stats.replays == 3, t.stats


def test_sizes_given_one_by_one_from_a_tracked_number():
    """``torch.empty(world * x.shape[0], d)`` (a gather buffer), ``x.new_zeros(n, d)``,
    ``t.expand(n, -1)``: torch's parser takes such sizes only as ints, so the trace crashed on
    the proxy ("empty() takes 1 positional argument but 2 were given"). They are uses: a new
    value is a new graph, the same value replays."""
    world = 2

    def body(m, o, x, y, n):
        buf = torch.zeros(world * x.shape[0], 4)
        pad = x.new_zeros(n, 8)
        bias = torch.ones(1, 4).expand(n * world, -1)
        out = m(torch.cat([x, pad]))
        loss = F.cross_entropy(out[:x.shape[0]], y) + buf.sum() + bias.sum() * 1e-3 + torch.randn(n, 1).sum() * 0
        loss.backward()
        o.step()
        o.zero_grad()
        return loss
    t = Twin(body)
    for k, n in enumerate([2, 2, 2, 2, 3, 3]):
        t(k, n)
    assert t.step.stats.captures == 2, t.step.stats.recaptures
    assert any("2 -> 3" in r for r in t.step.stats.recaptures), t.step.stats.recaptures


def test_tracked_numbers_reach_numpy_as_plain_numbers():
    """YOLOv5's ``np.interp(ni, xi, ...)`` and GraphSAGE's ``labels[np.array(batch_nodes)]`` got a
    proxy numpy did not know (an object array: TypeError, the step ran eagerly, "please report");
    a prioritized replay's ``weights ** -beta`` with a float32 array promoted to float64."""
    import numpy as np
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    w32 = np.array([0.5, 0.25], dtype=np.float32)
    seen = []

    def step(i, beta, x):
        scale = float(np.interp(i, [0, 10], [1.0, 2.0]))
        nodes = np.array([i, i + 1])
        weights = w32 ** (-beta)
        seen.append((nodes.dtype, weights.dtype))
        loss = lin(x).square().mean() * scale * float(weights.sum()) + float(nodes.sum()) * 0.0
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    f = stepgraph.compile(step)
    for k in range(4):
        f(2, 0.4, torch.randn(3, 4))
    assert f.stats.replays == 2 and f.stats.failed_captures == 0
    assert all(d == (np.dtype(np.int64), np.dtype(np.float32)) for d in seen), seen


def test_a_closure_number_that_turns_from_int_to_float_is_a_new_key():
    """YOLOv5: ``accumulate = max(1, np.interp(...).round())`` is the int 1, then 2.0; the step
    branches on ``ni - last_opt_step >= accumulate``. Re-keying the graphs captured before the
    comparison was recorded raised IndexError on the int's key, and the step ran eagerly."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    x = torch.randn(8, 4)
    state = {"last": -1, "acc": 1}

    def step(ni):
        loss = lin(x).pow(2).mean()
        loss.backward()
        if ni - state["last"] >= state["acc"]:
            opt.step()
            opt.zero_grad()
            state["last"] = ni
        return loss.detach()
    f = stepgraph.compile(step)
    for ni in range(8):
        state["acc"] = 1 if ni < 3 else float(2 + ni % 2)
        f(ni)
    assert f.stats.failed_captures == 0 and f.stats.replays >= 1, f.stats


def test_json_dumps_of_a_number_of_the_call_is_its_value():
    """``json.dumps({"loss": loss.item(), "step": i})`` in the step: json's C encoder took no
    tracked number ("Object of type int is not JSON serializable"), an internal failure that
    ran the step eagerly for good with a "please report" warning (probe s26_probeA)."""
    import json
    import warnings
    texts = []
    for use in (False, True):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        got = []

        def fn(x, i):
            loss = m(x).pow(2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
            return loss, json.dumps({"step": i, "n": 3})
        step = stepgraph.compile(fn) if use else fn
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for i in range(4):
                got.append(step(torch.randn(8, 4), i)[1])
        assert not [x for x in w if "could not be captured" in str(x.message)]
        texts.append(got)
    assert texts[0] == texts[1] == [json.dumps({"step": i, "n": 3}) for i in range(4)]
