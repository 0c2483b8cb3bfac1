"""Python variables of the training loop that the step accumulates into (issue 14).

``total_loss += loss.detach().float()`` (the Hugging Face no_trainer scripts) and
``train_loss += loss.item()`` (kuangliu's CIFAR script) were refused as Python side effects.
A replay now reads such a variable live and writes the step's new value back, as eager's
Python would. Each test runs the client's pattern eager and under stepgraph on the same
batches and compares the variable after every call, the parameters and the loss.
"""
from __future__ import annotations

import copy

import pytest
import torch

import stepgraph
from stepgraph.errors import CaptureError

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    m2 = copy.deepcopy(m)
    return (m, torch.optim.SGD(m.parameters(), lr=0.1)), (m2, torch.optim.SGD(m2.parameters(), lr=0.1))


def _same_params(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _cell_accumulator(model, opt):
    """hf_bert_classification / hf_t5: a closure cell reset to 0 each epoch, += a tensor."""
    box = {}
    total_loss = 0

    def step(x, y):
        nonlocal total_loss
        loss = torch.nn.functional.cross_entropy(model(x), y)
        total_loss += loss.detach().float()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def reset(v=0):
        nonlocal total_loss
        total_loss = v

    box["step"], box["reset"], box["get"] = step, reset, lambda: total_loss
    return box


def test_tensor_accumulated_into_a_closure_cell_is_written_back_each_replay():
    (m, o), (m2, o2) = _pair()
    a, b = _cell_accumulator(m, o), _cell_accumulator(m2, o2)
    sg = stepgraph.compile(a["step"])
    ends = []    # the user keeps each epoch's tensor: a later replay must not overwrite it
    for epoch in range(3):
        a["reset"](), b["reset"]()
        for _ in range(4):
            x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
            assert torch.equal(sg(x, y), b["step"](x, y))
            assert torch.equal(a["get"](), b["get"]()), epoch
        ends.append((a["get"](), b["get"]().clone()))
    for got, want in ends:
        assert torch.equal(got, want)
    assert _same_params(m, m2)
    # One graph for "0 -> tensor" (each epoch's first call), one for "tensor -> tensor".
    assert sg.stats.captures == 2 and sg.stats.replays == 9, sg.stats


def test_accumulator_of_another_dtype_or_shape_recaptures_and_stays_equal():
    (m, o), (m2, o2) = _pair()
    a, b = _cell_accumulator(m, o), _cell_accumulator(m2, o2)
    sg = stepgraph.compile(a["step"])
    starts = [0, 0, torch.zeros((), dtype=torch.float64), torch.zeros(2), 0]
    for start in starts:
        a["reset"](start.clone() if isinstance(start, torch.Tensor) else start)
        b["reset"](start.clone() if isinstance(start, torch.Tensor) else start)
        for _ in range(3):
            x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
            assert torch.equal(sg(x, y), b["step"](x, y))
            got, want = a["get"](), b["get"]()
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert _same_params(m, m2)
    assert any("total_loss" in r for r in sg.stats.recaptures), sg.stats.recaptures


TOTAL = 0


def _global_step(model, opt):
    def step(x, y):
        global TOTAL
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        TOTAL = TOTAL + loss.detach() * 2   # rebinding to a new tensor every call
        return loss.detach()
    return step


def test_tensor_accumulated_into_a_global_is_written_back_each_replay():
    global TOTAL
    (m, o), (m2, o2) = _pair()
    sg, eager = stepgraph.compile(_global_step(m, o)), _global_step(m2, o2)
    for _ in range(2):
        TOTAL = 0
        want = 0
        for _ in range(4):
            x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
            saved = TOTAL
            sg(x, y)
            got, TOTAL = TOTAL, saved
            eager(x, y)
            want, TOTAL = TOTAL, got
            assert torch.equal(got, want)
    assert _same_params(m, m2)
    assert sg.stats.captures == 2, sg.stats


def test_swapping_two_tensor_variables_is_replayed():
    """``cur, nxt = nxt, cur``: both are graph inputs, so each replay hands them back swapped."""
    def make(m, o):
        cur, nxt = torch.zeros(3), torch.ones(3)

        def step(x):
            nonlocal cur, nxt
            loss = (m(x) * cur).sum() + nxt.sum()
            loss.backward()
            o.step()
            o.zero_grad()
            cur, nxt = nxt, cur
            return loss.detach()
        return step, lambda: (cur, nxt)
    (m, o), (m2, o2) = _pair()
    (f, get), (g, get2) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(f)
    for _ in range(6):
        x = torch.randn(2, 4)
        assert torch.equal(sg(x), g(x))
        assert all(torch.equal(a, b) for a, b in zip(get(), get2()))
    assert _same_params(m, m2)
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats


def test_rebinding_to_a_tensor_from_before_the_step_is_refused():
    """A variable rebound to a tensor the graph neither computed nor read (picked from a list
    by a computed index) is no graph output: a replay could not redo it, so it is a clear
    error, never a silent replay."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    pool = [torch.zeros(3), torch.ones(3)]
    cur = pool[0]

    def step(x, i):
        nonlocal cur
        loss = m(x).sum()
        loss.backward()
        o.step()
        o.zero_grad()
        cur = pool[i % 2]
        return loss.detach()
    sg = stepgraph.compile(step)
    sg(torch.randn(2, 4), 0)
    with pytest.raises(CaptureError, match="cur"):
        sg(torch.randn(2, 4), 1)
    assert cur is pool[1]



train_loss = correct = total = 0


def _cifar_step(model, opt):
    """kuangliu/pytorch-cifar's train(): globals accumulated with host reads in the step."""
    def step(inputs, targets):
        global train_loss, correct, total
        opt.zero_grad()
        outputs = model(inputs)
        loss = torch.nn.functional.cross_entropy(outputs, targets)
        loss.backward()
        opt.step()
        train_loss += loss.item()
        _, predicted = outputs.max(1)
        total += targets.size(0)
        correct += predicted.eq(targets).sum().item()
        return loss.detach()
    return step


def _run_cifar(sg, eager, epochs=3, steps=4, n=16):
    global train_loss, correct, total
    for _ in range(epochs):
        train_loss = correct = total = 0
        mine = theirs = (0, 0, 0)
        for _ in range(steps):
            x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
            train_loss, correct, total = mine
            a = sg(x, y)
            mine = (train_loss, correct, total)
            train_loss, correct, total = theirs
            b = eager(x, y)
            theirs = (train_loss, correct, total)
            assert torch.equal(a, b)
            assert mine == theirs and [type(v) for v in mine] == [type(v) for v in theirs], (mine, theirs)


def test_host_read_accumulated_into_globals_is_written_back_each_replay():
    (m, o), (m2, o2) = _pair()
    sg, eager = stepgraph.compile(_cifar_step(m, o)), _cifar_step(m2, o2)
    _run_cifar(sg, eager)
    assert _same_params(m, m2)
    # the int accumulator's first value of each epoch (0) is its own graph: at most two
    assert sg.stats.captures <= 2 and sg.stats.replays >= 9, (sg.stats, sg.stats.recaptures)


def test_an_int_read_the_step_also_uses_by_value_stays_guarded():
    """``correct += n`` alone is replayed from the graph's read; when ``n`` also sizes a tensor
    (a use by value) it is guarded where it is used: a new value misses and captures again,
    never replays the old one."""
    def make(model, opt):
        correct = 0

        def step(x, y):
            nonlocal correct
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            n = out.argmax(1).eq(y).sum().item()
            correct += n
            return loss.detach() + torch.ones(n + 1).sum()
        return step, lambda: correct
    (m, o), (m2, o2) = _pair()
    (f, s1), (g, s2) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(f, max_captures=3)
    for _ in range(10):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        assert torch.equal(sg(x, y), g(x, y))
        assert s1() == s2()
    assert _same_params(m, m2)
    assert sg.stats.recaptures and all("item()" in r for r in sg.stats.recaptures), sg.stats.recaptures


class AverageMeter:
    """torchvision's references/classification/train.py (and the ImageNet example) meter."""
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def _meter_step(model, opt):
    meters = {}

    def step(x, y):
        losses, top1 = meters["losses"], meters["top1"]
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        acc1 = out.argmax(1).eq(y).float().mean(0, keepdim=True) * 100
        losses.update(loss.item(), x.size(0))
        top1.update(acc1[0], x.size(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    return step, meters


def _same_meter(a, b) -> bool:
    va, vb = vars(a), vars(b)
    return va.keys() == vb.keys() and all(
        type(va[k]) is type(vb[k]) and torch.equal(torch.as_tensor(va[k]), torch.as_tensor(vb[k])) for k in va)


def test_meters_made_each_epoch_are_found_by_path_and_replayed():
    """A new meter each epoch, updated with a read loss and a tensor accuracy inside the step:
    the meter is keyed by its structure (numbers, or tensors by metadata), its tensors are
    graph inputs and its new values are written back to the meter the step reads *now*. Two
    graphs (fresh meter, meter holding tensors) serve every epoch; each meter equals eager's."""
    (m, o), (m2, o2) = _pair()
    (f, mine), (g, theirs) = _meter_step(m, o), _meter_step(m2, o2)
    sg = stepgraph.compile(f)
    for epoch in range(3):
        for d in (mine, theirs):
            d.update(losses=AverageMeter(), top1=AverageMeter())
        for _ in range(4):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            assert torch.equal(sg(x, y), g(x, y))
            for k in ("losses", "top1"):
                assert _same_meter(mine[k], theirs[k]), (epoch, k, vars(mine[k]), vars(theirs[k]))
    assert _same_params(m, m2)
    assert sg.stats.captures == 2 and sg.stats.replays == 9, sg.stats
    assert "meters['top1'].val a tensor float32[] -> a Python number" in sg.stats.recaptures[0], sg.stats.recaptures


def test_a_meter_whose_tensor_changes_dtype_recaptures():
    (m, o), (m2, o2) = _pair()
    (f, mine), (g, theirs) = _meter_step(m, o), _meter_step(m2, o2)
    sg = stepgraph.compile(f)
    for epoch in range(3):
        for d in (mine, theirs):
            d.update(losses=AverageMeter(), top1=AverageMeter())
            if epoch == 2:
                d["top1"].sum = torch.zeros((), dtype=torch.float64)
        for _ in range(3):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            assert torch.equal(sg(x, y), g(x, y))
            for k in ("losses", "top1"):
                assert _same_meter(mine[k], theirs[k]), (epoch, k, vars(mine[k]), vars(theirs[k]))
    assert any("float64" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_trace_failing_after_the_step_ran_puts_the_variables_back(monkeypatch):
    """stepgraph's own failure once the step's Python has run (here: make_fx's final pass):
    the call runs eagerly from its start, so the loop variables must be as before it, or the
    eager rerun adds the step twice."""
    (m, o), (m2, o2) = _pair()
    a, b = _cell_accumulator(m, o), _cell_accumulator(m2, o2)
    (f, mine), (g, theirs) = _meter_step(m, o), _meter_step(m2, o2)
    for d in (mine, theirs):
        d.update(losses=AverageMeter(), top1=AverageMeter())

    def both(x, y):
        f(x, y)
        return a["step"](x, y)

    def both_eager(x, y):
        g(x, y)
        return b["step"](x, y)
    sg = stepgraph.compile(both)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    sg(x, y), both_eager(x, y)

    scope: dict = {}   # (raised from "<injected>": not the user's code, as a stepgraph fault is)
    exec(compile("def broken(self, *a, **k):\n    raise RuntimeError('injected')", "<injected>", "exec"), scope)
    broken = scope["broken"]
    monkeypatch.setattr(torch.fx.Graph, "eliminate_dead_code", broken)
    with pytest.warns(UserWarning, match="could not be captured"):
        got = sg(x, y)
    assert torch.equal(got, both_eager(x, y))
    assert torch.equal(a["get"](), b["get"]())
    for k in ("losses", "top1"):
        assert _same_meter(mine[k], theirs[k]), (k, vars(mine[k]), vars(theirs[k]))
    assert _same_params(m, m2)


class _Stats:
    def __init__(self):
        self.history, self.last = [], 0   # (a list: no record, keyed by identity)


def test_an_int_read_stored_in_a_python_object_stays_guarded():
    """``stats.last = n`` of an int read, on an object the guards key by identity: a replay
    would not assign it, so the value is guarded (as before int reads were tracked): a new
    value captures again, never leaves the object stale."""
    def make(model, opt, stats):
        def step(x, y):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats.last = out.argmax(1).eq(y).sum().item()
            return loss.detach()
        return step
    (m, o), (m2, o2) = _pair()
    s1, s2 = _Stats(), _Stats()
    sg, eager = stepgraph.compile(make(m, o, s1), max_captures=3), make(m2, o2, s2)
    for _ in range(10):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        assert torch.equal(sg(x, y), eager(x, y))
        assert s1.last == s2.last and type(s1.last) is int
    assert _same_params(m, m2)


def _ema_of_item(model, opt):
    """TeaPearce's conditional DDPM (clients/ddpm.py): ``loss_ema`` is None at each epoch's start,
    then the step sets it from ``loss.item()`` and smooths it after."""
    box = {}
    loss_ema = None

    def step(x, y):
        nonlocal loss_ema
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if loss_ema is None:
            loss_ema = loss.item()
        else:
            loss_ema = 0.95 * loss_ema + 0.05 * loss.item()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def reset():
        nonlocal loss_ema
        loss_ema = None

    box["step"], box["reset"], box["get"] = step, reset, lambda: loss_ema
    return box


def test_a_live_float_reset_to_none_each_epoch_is_keyed_by_value_again():
    """A float the step reads is read live at each replay; reset to None by the loop, the
    replay read None (TypeError inside the graph: the program died), or a capture crashed
    turning it into a live float. A live variable holding no float is keyed by value: the
    None branch is a graph of its own, the float one is replayed."""
    (m, o), (m2, o2) = _pair()
    a, b = _ema_of_item(m, o), _ema_of_item(m2, o2)
    sg = stepgraph.compile(a["step"])
    g = torch.Generator().manual_seed(0)
    for epoch in range(3):
        a["reset"](), b["reset"]()
        for _ in range(3):
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
            assert torch.equal(sg(x, y), b["step"](x, y))
            assert a["get"]() == b["get"](), epoch
    assert _same_params(m, m2)
    assert sg.stats.captures == 2 and sg.stats.replays == 6 and sg.stats.failed_captures == 0, sg.stats


def test_a_rollout_rebound_to_a_view_each_iteration_is_an_input_not_a_new_graph():
    """CleanRL's ppo.py (clients/ppo_cleanrl.py): each iteration rebinds ``b_obs =
    obs.reshape(...)`` (a view of the rollout storage) and the minibatch step indexes it. A view
    was keyed by identity, so every iteration recaptured; like a plain tensor it is a graph
    input keyed by dtype/shape/stride (not a view of model or optimizer state)."""
    (m, o), (m2, o2) = _pair()

    def make(model, opt):
        box = {"b_obs": None}
        b_obs = None

        def step(idx):
            loss = model(b_obs[idx]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        def rebind(storage):
            nonlocal b_obs
            b_obs = storage.reshape(-1, 4)
        box["step"], box["rebind"] = step, rebind
        return box
    a, b = make(m, o), make(m2, o2)
    sg = stepgraph.compile(a["step"])
    g = torch.Generator().manual_seed(0)
    for iteration in range(4):
        storage = torch.randn(8, 2, 4, generator=g)
        a["rebind"](storage), b["rebind"](storage.clone())
        for _ in range(3):
            idx = torch.randperm(16, generator=g)[:4]
            assert torch.equal(sg(idx), b["step"](idx))
    assert _same_params(m, m2)
    assert sg.stats.captures == 1 and sg.stats.replays == 10, sg.stats


def test_a_first_optimizer_step_after_warm_up_counts_as_its_warm_up():
    """MAE's ``update_grad=(i + 1) % accum_iter == 0``: the warm-up call does not step, so the
    first update's trace creates the optimizer state. Its graph, keyed by no state, could never
    replay: each later path missed it once ("optimizer.state: entries 0 -> 2"). That call counts
    as the state's warm-up: two graphs (accumulate, update), every call equal to eager."""
    import copy
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    twin = copy.deepcopy(model)
    opt, topt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(twin.parameters(), lr=1e-3)

    def mk(m, o):
        def step(x, i):
            loss = m(x).square().mean() / 2
            loss.backward()
            if (i + 1) % 2 == 0:
                o.step()
                o.zero_grad()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(model, opt)), mk(twin, topt)
    for i in range(8):
        x = torch.randn(4, 8)
        assert torch.equal(sg(x, i), eager(x, i)), i
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters())), i
    s = sg.stats
    assert (s.eager_calls, s.new_state_warmups, s.captures, s.replays) == (2, 1, 2, 4), s
    assert not any("optimizer.state" in r or "opt.state" in r for r in s.recaptures), s.recaptures


@pytest.mark.parametrize("start", [0, 0.0])
def test_a_count_read_from_a_tensor_added_to_a_float_meter_replays(start):
    """``self.epoch_state["accuracy"] += accuracy.sum().item()`` with the meter started as 0.0
    (davda54/sam's Log): the int read met a live float and was used by value, a graph per count
    (7 captures, 32 guard misses in 12 calls, then eager); started as 0 it replayed (helper-91 F5)."""
    (m, o), (m2, o2) = _pair()
    meters = [{"correct": start}, {"correct": start}]

    def make(model, opt, meter):
        def step(x, y):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            meter["correct"] += (out.argmax(1) == y).sum().item()
            return loss.detach()
        return step
    eager, sg = make(m, o, meters[0]), stepgraph.compile(make(m2, o2, meters[1]))
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
        assert torch.equal(eager(x, y), sg(x, y))
        assert meters[0]["correct"] == meters[1]["correct"] and type(meters[1]["correct"]) is type(start)
    assert _same_params(m, m2)
    assert sg.stats.captures == 1 and sg.stats.replays == 10, sg.stats.recaptures
