"""Issue "never silently wrong": every value a step reads is an argument, named state, or a
guarded / live Python value. Each test is a real program's idiom that replayed stale values
before (models passed as arguments, a global lr, Python-built tensors, returned floats)."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph


def batch(k, n=6, d=8, classes=4):
    g = torch.Generator().manual_seed(700 + k)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def net(dropout=0.5):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(dropout), nn.GELU(), nn.Linear(16, 4))


def same_params(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n} differs from eager"


def step_with_args(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_model_and_optimizer_passed_as_arguments_are_state_and_eval_is_guarded():
    m1, m2 = net(), net()
    o1, o2 = torch.optim.AdamW(m1.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)
    sg = stepgraph.compile(step_with_args)
    for k in range(8):
        if k == 4:
            m1.eval(), m2.eval()   # dropout off: replays must follow
        torch.manual_seed(k)
        got = sg(m1, o1, *batch(k))
        torch.manual_seed(k)
        want = step_with_args(m2, o2, *batch(k))
        assert torch.equal(got, want), k
        same_params(m1, m2)
    assert "model.training True -> False" in sg.stats.recaptures[0]
    assert "model" in sg.explain() and sg.stats.replays == 5


def test_a_second_model_passed_as_argument_gets_its_own_graph():
    ma, mb, ta, tb = net(0.0), net(0.0), net(0.0), net(0.0)
    with torch.no_grad():
        mb[0].weight.mul_(2), tb[0].weight.mul_(2)
    oa, ob = torch.optim.SGD(ma.parameters(), lr=0.1), torch.optim.SGD(mb.parameters(), lr=0.1)
    ota, otb = torch.optim.SGD(ta.parameters(), lr=0.1), torch.optim.SGD(tb.parameters(), lr=0.1)
    sg = stepgraph.compile(step_with_args)
    for k in range(6):
        for m, o, t, ot in ((ma, oa, ta, ota), (mb, ob, tb, otb)):
            assert torch.equal(sg(m, o, *batch(k)), step_with_args(t, ot, *batch(k)))
            same_params(m, t)
    assert sg.stats.captures == 2


LR = 20.0


def _manual_sgd(model):
    def train_step(x, y):
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)   # word_language_model's update, LR a global
        return loss
    return train_step


def test_global_lr_annealed_by_the_loop_is_read_live_on_cpu(monkeypatch):
    m, t = net(0.0), net(0.0)
    sg, eager = stepgraph.compile(_manual_sgd(m)), _manual_sgd(t)
    for k in range(10):
        if k in (4, 7):
            monkeypatch.setitem(globals(), "LR", globals()["LR"] / 4)
        assert torch.equal(sg(*batch(k)), eager(*batch(k)))
        same_params(m, t)
    assert sg.stats.captures == 1, sg.stats.recaptures   # read live from the first capture
    assert "global LR" in sg.explain()


def test_a_global_model_rebound_between_calls_recaptures():
    g = {"model": net(0.0)}
    exec("def step(x):\n    return model(x).sum()\n", g)
    sg = stepgraph.compile(g["step"])
    x, _ = batch(0)
    with torch.no_grad():
        sg(x), sg(x), sg(x)
        old = weakref.ref(g["model"])
        g["model"] = nn.Sequential(nn.Linear(8, 4))
        for _ in range(3):
            assert torch.equal(sg(x), g["model"](x).sum())
        kept = nn.Sequential(nn.Linear(8, 4))   # (rebound while the last one stays alive: a recapture)
        g["model"], kept = kept, g["model"]
        assert torch.equal(sg(x), g["model"](x).sum())
    assert old() is None   # (the rebound global's last model, its graph with it, is freed: test_weak_state.py)
    assert sg.stats.replays == 2 and "global model" in sg.stats.recaptures[-1], sg.stats


def test_tensor_with_history_from_before_the_step_is_refused():
    policy = net(0.0)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    saved, rewards = [], []

    def finish_episode():
        R, returns = 0.0, []
        for r in rewards[::-1]:
            R = r + 0.99 * R
            returns.insert(0, R)
        returns = torch.tensor(returns)
        loss = torch.stack([-lp * ret for lp, ret in zip(saved, returns)]).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        del saved[:]
        del rewards[:]
    sg = stepgraph.compile(finish_episode)
    for ep in range(2):
        for t in range(3):
            x, _ = batch(10 * ep + t, n=1)
            saved.append(torch.log_softmax(policy(x), -1)[0, 0])
            rewards.append(float(t + ep))
        if ep == 0:
            sg()
        else:
            with pytest.raises(stepgraph.CaptureError, match="computed before the step") as info:
                sg()
            assert "test_pyvalues.py" in info.value.where and "graph_module" in info.value.fix


def test_python_built_tensor_from_a_list_the_loop_changes_is_guarded_by_value():
    m, t = net(0.0), net(0.0)
    weights = [1.0, 1.0, 1.0, 1.0]

    def mk(model, opt):
        def step(x, y):
            w = torch.tensor(weights)
            loss = F.cross_entropy(model(x), y, weight=w)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    sg = stepgraph.compile(mk(m, torch.optim.SGD(m.parameters(), lr=0.1)))
    eager = mk(t, torch.optim.SGD(t.parameters(), lr=0.1))
    for k in range(6):
        if k == 3:
            weights[0] = 5.0
        assert torch.equal(sg(*batch(k)), eager(*batch(k)))
    assert "weights" in sg.stats.recaptures[0]


@pytest.mark.parametrize("read", ["get", "items", "index"])
def test_values_read_through_a_container_method_are_guarded_by_value(read):
    """``cfg.get("scale")`` (and ``.items()``, ``.index()``): a method call on a container made it
    keyed by identity only, as for ``history.append(x)``, so the graph baked the value read and
    kept replaying it after the loop changed the dict or list in place: silently wrong. Only
    methods that do not read the contents (append, extend, ...) key a container by identity."""
    m, t = net(0.0), net(0.0)
    cfg = {"scale": 1.0}
    order = [0.5, 1.0]

    def mk(model, opt):
        def step(x, y):
            if read == "get":
                scale = cfg.get("scale")
            elif read == "items":
                scale = sum(v for k, v in cfg.items())
            else:
                scale = order.index(1.0) + 1.0
            loss = F.cross_entropy(model(x), y) * scale
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    sg = stepgraph.compile(mk(m, torch.optim.SGD(m.parameters(), lr=0.1)))
    eager = mk(t, torch.optim.SGD(t.parameters(), lr=0.1))
    for k in range(6):
        if k == 3:
            cfg["scale"] = 3.0
            order.reverse()
        assert torch.equal(sg(*batch(k)), eager(*batch(k))), k
    assert sg.stats.captures == 2, sg.stats


def test_returned_lr_is_live_and_other_python_numbers_warn():
    m = net(0.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x, y):
        loss = step_with_args(m, opt, x, y)
        return {"loss": loss, "lr": opt.param_groups[0]["lr"]}
    sg = stepgraph.compile(step)
    lrs = []
    for k in range(6):
        lrs.append(sg(*batch(k))["lr"])
        sched.step()
    assert lrs == [0.1 * 0.5 ** k for k in range(6)]

    other = {"v": 0}

    def step2(x, y):
        return step_with_args(m, opt, x, y), len(other) / 3
    sg2 = stepgraph.compile(step2)
    sg2(*batch(0))
    with pytest.warns(UserWarning, match="returns Python number"):
        sg2(*batch(1))


_L = torch.optim.lr_scheduler
SCHEDULERS = {   # (the last three define their own step(): CosineAnnealingWarmRestarts resets the
    # cycle, SequentialLR passes a milestone; before, their own step was not replayed)
    "lambda": lambda o: _L.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "warm_restarts": lambda o: _L.CosineAnnealingWarmRestarts(o, T_0=3),
    "sequential": lambda o: _L.SequentialLR(o, [_L.LinearLR(o, 0.1, 1.0, 3), _L.ExponentialLR(o, 0.5)], milestones=[3]),
    "chained": lambda o: _L.ChainedScheduler([_L.ConstantLR(o, 0.5, 2), _L.ExponentialLR(o, 0.9)]),
}


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_scheduler_stepped_inside_the_step_runs_after_each_replay(kind):
    m, t = net(0.0), net(0.0)

    def mk(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = SCHEDULERS[kind](opt)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            sched.step()       # Hugging Face's loop body
            opt.zero_grad()
            return loss
        return step, opt, sched
    (sg, o1, s1), (eager, o2, s2) = mk(m), mk(t)
    sg = stepgraph.compile(sg)
    for k in range(8):
        assert torch.equal(sg(*batch(k)), eager(*batch(k)))
        same_params(m, t)
        assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"], k
    assert getattr(s1, "last_epoch", 0) == getattr(s2, "last_epoch", 0) and s1.get_last_lr() == s2.get_last_lr()
    assert sg.stats.replays >= 5


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
def test_recurrent_layers_replay_on_cpu(cell):
    torch.manual_seed(0)
    a = getattr(nn, cell)(4, 8, num_layers=2, bidirectional=True)
    b = copy.deepcopy(a)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)

    def mk(mod, opt):
        def step(x):
            out, _ = mod(x)
            loss = out.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(a, oa)), mk(b, ob)
    for k in range(5):
        x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(k))
        assert torch.equal(sg(x), eager(x))
    same_params(a, b)
    assert sg.stats.replays == 3


def test_lr_returned_after_a_scheduler_step_inside_the_step():
    """A scheduler stepped inside the step ran on the live lr: its epoch branch (StepLR's decay)
    was recorded into the graph and the returned lr came back decayed at every replay,
    silently. It now runs on plain floats; the returned lr is next call's, read live; a number
    computed from it is warned about (a replay cannot recompute it)."""
    import copy
    import warnings as w

    def run(scale):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        m2 = copy.deepcopy(m)
        o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
        s1, s2 = torch.optim.lr_scheduler.StepLR(o, 2, 0.5), torch.optim.lr_scheduler.StepLR(o2, 2, 0.5)

        def make(model, opt, sched):
            def step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                g = opt.param_groups[0]
                lr = g["lr"]
                return loss.detach(), (lr * 2.0 if scale else lr)
            return step
        sg, eager = stepgraph.compile(make(m, o, s1)), make(m2, o2, s2)
        got = []
        with w.catch_warnings(record=True) as caught:
            w.simplefilter("always")
            for _ in range(7):
                x = torch.randn(3, 4)
                a, b = sg(x), eager(x)
                assert torch.equal(a[0], b[0])
                got.append((a[1], b[1]))
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
        return got, [str(c.message) for c in caught]
    got, _ = run(False)
    assert all(a == b for a, b in got), got
    got, msgs = run(True)
    assert any("returns Python number" in m for m in msgs), msgs


def test_a_counter_the_step_increments_is_replayed():
    """``completed_steps += 1`` inside the step (the Hugging Face scripts' idiom) was refused
    as a Python side effect; the new value is arithmetic on tracked numbers, so each replay
    computes it again and writes it back: the counter ends where eager's does, one graph per
    branch of ``step % accum``."""
    import copy
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def make(model, opt):
        done = 0

        def step(x, i):
            nonlocal done
            loss = model(x).square().mean() / 2
            loss.backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
                done += 1
            return loss.detach()
        return step, lambda: done
    (f, done_sg), (g, done_eager) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(f)
    for i in range(10):
        x = torch.randn(3, 4)
        assert torch.equal(sg(x, i), g(x, i)), i
        assert done_sg() == done_eager(), (i, done_sg(), done_eager())
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    assert sg.stats.captures == 2 and sg.stats.replays == 7, sg.stats


def test_a_counter_in_a_list_slot_is_replayed():
    """``calls[0] += 1`` (a closure's one-element list, the pre-``nonlocal`` counter) was refused
    as a change to the whole list; the slot is a tracked number like a ``nonlocal`` one."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def make(model, opt):
        calls = [0, "tag"]

        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            calls[0] += 1
            return loss.detach()
        return step, calls
    (f, mine), (g, theirs) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(f)
    for i in range(6):
        x = torch.randn(3, 4)
        assert torch.equal(sg(x), g(x)), i
        assert mine == theirs, (i, mine, theirs)
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats


def _slot_pair():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    m2 = copy.deepcopy(m)
    return m, m2, torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)


def test_a_tensor_stored_in_a_constant_slot_is_written_after_each_replay():
    """``info['loss'] = loss.detach()`` and ``last[0] = ...``: each replay left the capture's
    tensor in the slot, silently (the container is keyed by identity). A constant slot is now a
    variable the step rebinds to a graph tensor, written back after each replay."""
    m, m2, o, o2 = _slot_pair()

    def make(model, opt):
        info, last = {"loss": None}, [None]

        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            info["loss"] = loss.detach()
            last[0] = loss.detach() * 2
            return loss.detach()
        return step, info, last
    (f, i1, l1), (g, i2, l2) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(f)
    for k in range(6):
        x = torch.randn(3, 4)
        assert torch.equal(sg(x), g(x)), k
        assert torch.equal(i1["loss"], i2["loss"]) and torch.equal(l1[0], l2[0]), k
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats


@pytest.mark.parametrize("how", ["update", "computed key"])
def test_a_slot_no_replay_writes_is_refused(how):
    """``d.update({'loss': t})`` or ``hist[key] = t`` with a key computed in the step: no replay
    would write the slot again, so the capture is refused, naming it (the call ran eagerly)."""
    m, m2, o, o2 = _slot_pair()

    def make(model, opt):
        d = {}

        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if how == "update":
                d.update({"loss": loss.detach()})
            else:
                d["loss_" + str(x.shape[0])] = loss.detach()
            return loss.detach()
        return step, d
    (f, d1), (g, d2) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(f)
    x = torch.randn(3, 4)
    sg(x), g(x)
    x = torch.randn(3, 4)
    with pytest.raises(stepgraph.CaptureError, match=r"stores a new value into d\['loss"):
        sg(x)
    g(x)
    assert all(torch.equal(d1[k], d2[k]) for k in d2) and d1.keys() == d2.keys()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


def test_a_recapture_names_why_the_newest_graph_missed():
    """With graphs for both sides of ``if it < 2``, a later miss is the newest graph's value
    check (``it - 2``, an index); the reason used to repeat the first graph's branch at every
    call. (A scale computed from ``it`` is read live once it moved: test_lr_in_step.py.)"""
    m, m2, o, o2 = _slot_pair()

    def make(model, opt):
        def step(x, it):
            scale = 1.0 if it < 2 else (0.5, 0.25, 0.125, 0.0625, 0.03125)[it - 2]
            loss = model(x).square().mean() * scale
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m, o), max_captures=4), make(m2, o2)
    with pytest.warns(UserWarning, match="keeps changing"):
        for it in range(7):
            x = torch.randn(3, 4)
            assert torch.equal(sg(x, it), eager(x, it)), it
    assert sg.stats.recaptures[0].startswith("it < 2"), sg.stats.recaptures
    assert all(r.startswith("it - 2") for r in sg.stats.recaptures[1:]), sg.stats.recaptures


@pytest.mark.parametrize("form", ["scalar", "list", "dtype"])
def test_a_tensor_made_from_a_live_float_stays_live(form):
    """``kl_weight = torch.tensor(beta)`` with ``beta`` a global the loop anneals (KL annealing):
    the 0-dim tensor is made from the live float in the graph, as in arithmetic; it used to be a
    baked constant guarded by value -- a recapture at every new beta, eager after max_captures."""
    make = {"scalar": lambda b: torch.tensor(b), "list": lambda b: torch.tensor([b, 1.0])[0],
            "dtype": lambda b: torch.tensor(b, dtype=torch.float64).float()}[form]

    def run(compiled):
        torch.manual_seed(0)
        m = nn.Linear(3, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        box = {"beta": 0.1}

        def step(x):
            loss = m(x).pow(2).mean() * make(box["beta"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        f = stepgraph.compile(step) if compiled else step
        g = torch.Generator().manual_seed(1)
        out = []
        for k in range(8):
            box["beta"] = 0.1 * (k + 1) ** 0.5
            out.append(f(torch.randn(4, 3, generator=g)).detach())
        return out, f
    got, f = run(True)
    want, _ = run(False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert f.stats.captures <= 2, f.stats.recaptures


GAE_GAMMA = 0.98


def test_a_live_global_float_meeting_a_numpy_scalar_is_guarded_by_value():
    """minimalRL's GAE: ``gamma * lmbda * advantage + delta_t[0]`` with ``delta_t[0]`` a
    numpy.float32. The global read live refused numpy's operand (a TypeError mid-trace, no
    CaptureError); now numpy's arithmetic runs on its value, guarded as float() guards it."""
    import numpy as np
    global GAE_GAMMA
    half = np.float32(0.5)
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    t = copy.deepcopy(m)

    def mk(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)

        def step(x):
            adv = GAE_GAMMA * 0.95 * 1.0 + half
            loss = (model(x) * float(adv)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(m)), mk(t)
    try:
        for i in range(6):
            GAE_GAMMA = 0.98 - 0.1 * (i // 2)
            x = torch.randn(3, 4)
            assert torch.equal(sg(x), eager(x)), i
    finally:
        GAE_GAMMA = 0.98
    assert sg.stats.captures == 3 and all("GAE_GAMMA" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_stateless_module_made_anew_at_each_call_is_keyed_by_its_settings():
    """``step(model, opt, nn.CrossEntropyLoss(), x, y)``: each new loss module was new state (a
    warm-up, then a capture): the step never replayed, with no warning. A module holding no
    tensors is keyed by its class and settings; another setting is another graph, named."""
    import copy
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def step(model, opt, crit, x, y):
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    sg = stepgraph.compile(step)
    g = torch.Generator().manual_seed(0)
    for k in range(6):
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        smooth = 0.1 if k == 5 else 0.0
        a = sg(m, o, nn.CrossEntropyLoss(label_smoothing=smooth), x, y)
        assert torch.equal(a, step(m2, o2, nn.CrossEntropyLoss(label_smoothing=smooth), x, y))
    assert sg.stats.captures == 2 and sg.stats.replays == 3, sg.stats
    assert "label_smoothing=0.1" in sg.stats.recaptures[0]
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


def test_a_step_that_returns_its_model_replays_and_returns_the_same_model():
    """davidmrau's mixture-of-experts example ends its train step with ``return model``: refused
    as an object holding computed tensors (its parameters are the graph's inputs). A model or
    optimizer returned as is is the same object at every replay."""
    import copy
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def make(model, opt):
        def train(x):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return model, loss.detach()
        return train
    sg, eager = stepgraph.compile(make(m, o)), make(m2, o2)
    for k in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        (ma, la), (_, lb) = sg(x), eager(x)
        assert ma is m and torch.equal(la, lb)
    assert sg.stats.replays == 3, sg.stats
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


def test_an_optimizer_subclass_that_never_ran_optimizer_init_is_no_state():
    """The Annotated Transformer's eval epoch passes ``DummyOptimizer()`` (an Optimizer subclass
    with ``param_groups = [{"lr": 0}]`` and no state) where training passes Adam: a bare
    KeyError: 'params' from the registry before."""
    class DummyOptimizer(torch.optim.Optimizer):
        def __init__(self):
            self.param_groups = [{"lr": 0}]

        def step(self):
            return None

        def zero_grad(self, set_to_none=False):
            return None
    torch.manual_seed(0)
    m = nn.Linear(4, 2)

    def run_batch(x, optimizer):
        loss = m(x).pow(2).sum()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()
    sg = stepgraph.compile(run_batch)
    dummy = DummyOptimizer()
    for k in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        assert torch.equal(sg(x, dummy), m(x).pow(2).sum().detach())
    assert sg.stats.replays == 2, sg.stats


def test_a_stateless_module_is_keyed_by_its_private_settings_too():
    """A loss module keeping its setting in a private attribute (``self._scale``): keyed without
    it, a new module with another scale replayed the graph of the old one (found in review)."""
    import copy

    class Scaled(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self._scale = scale

        def forward(self, a, b):
            return nn.functional.mse_loss(a * self._scale, b)
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def step(model, opt, crit, x, y):
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    sg = stepgraph.compile(step)
    g = torch.Generator().manual_seed(0)
    for k in range(6):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        scale = 2.0 if k == 5 else 1.0
        assert torch.equal(sg(m, o, Scaled(scale), x, y), step(m2, o2, Scaled(scale), x, y)), k
    assert sg.stats.captures == 2 and "_scale=2.0" in sg.stats.recaptures[0], sg.stats


def test_a_step_that_sets_train_mode_leaves_it_set_after_each_replay():
    """llm.c's step starts with ``model.train()``; the loop calls ``model.eval()`` for validation
    between steps. The graph for an eval-mode entry left the model in eval mode after each
    replay (the Python ``train()`` ran only at capture): a dropout forward after the step then
    differed from eager's."""
    import torch.nn.functional as F

    def run(use_sg):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x, y):
            model.train()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss
        f = stepgraph.compile(step) if use_sg else step
        g = torch.Generator().manual_seed(1)
        flags = []
        for it in range(8):
            if it % 3 == 0:
                model.eval()
            f(torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g))
            flags.append([m.training for m in model.modules()])
        return flags, [p.detach().clone() for p in model.parameters()], f

    want, wp, _ = run(False)
    got, gp, f = run(True)
    assert f.stats.replays >= 4
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(gp, wp))


@pytest.mark.parametrize("where", ["module_attr", "global_in_place"])
def test_a_dict_of_neighbour_sets_is_keyed_by_its_members(where):
    """GraphSAGE (helper Q): the aggregator's forward reads ``self.adj_lists[int(v)]`` inside a
    comprehension and builds index lists from the sets; the loop resamples them between calls.
    Forward reads in comprehensions were not found, and containers of containers were keyed by
    identity and length: the graph replayed the first call's neighbours, silently."""
    import random
    import torch.nn.functional as F
    N = 12

    class Agg(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.feats = torch.randn(N, 5)
            self.adj_lists = {}
            self.lin = torch.nn.Linear(5, 3)

        def forward(self, nodes):
            samp = [self.adj_lists[int(v)] for v in nodes]
            uniq = sorted(set.union(*samp))
            col = {u: i for i, u in enumerate(uniq)}
            mask = torch.zeros(len(samp), len(uniq))
            mask[[i for i, s in enumerate(samp) for _ in s], [col[u] for s in samp for u in s]] = 1
            return self.lin((mask / mask.sum(1, keepdim=True)).mm(self.feats[torch.LongTensor(uniq)]))

    def run(use_sg):
        torch.manual_seed(0)
        rng = random.Random(0)
        m = Agg()
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        y = torch.arange(N) % 3
        adj = {v: set() for v in range(N)}

        def step(nodes):
            loss = F.cross_entropy(m(nodes), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        f = stepgraph.compile(step, max_captures=16) if use_sg else step
        out = []
        for _ in range(6):
            new = {v: set(rng.sample([(v + k) % N for k in (-2, -1, 1, 2)], 2)) for v in range(N)}
            if where == "module_attr":
                m.adj_lists = new
            else:
                adj.update(new)            # the same dict, the same length, other members
                m.adj_lists = adj
            out.append(f(list(range(N))))
        return out, [p.detach().clone() for p in m.parameters()]

    (le, pe), (ls, ps) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(ls, le))
    assert all(torch.equal(a, b) for a, b in zip(ps, pe))


def test_an_rnn_state_the_step_detaches_is_carried_from_call_to_call():
    """``nonlocal hidden; hidden = tuple(h.detach() for h in hidden); out, hidden = rnn(x, hidden)``:
    the last call's state (with its history) was refused as any tensor from before the step; now
    a tuple the step's own code rebinds is a recurrent state: its tensors are inputs, the new
    tuple written back after each replay (pyeffects.live_tuple; tests/test_recurrent_state.py)."""
    from carried import rnn_state_step
    (a, ha), (b, hb) = rnn_state_step("lstm"), rnn_state_step("lstm")
    sg = stepgraph.compile(a)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, y = torch.randn(5, 2, 4, generator=g), torch.randn(5, 2, 4, generator=g)
        assert torch.equal(sg(x, y), b(x, y))
        assert all(torch.equal(p, q) for p, q in zip(ha(), hb()))
    assert sg.stats.replays >= 3


def test_a_parameters_grad_the_step_reads_by_name_is_state():
    """``gn = model.fc.weight.grad.norm()`` after ``backward()`` (a gradient-norm log): the chain
    ``model.fc.weight.grad`` was a Python value of the step, keyed by identity, and its new grad
    tensor at each call was refused as "the step rebinds model.fc.weight.grad to another
    tensor". A parameter's grad is state (its slot guards and writes it)."""
    def run(compiled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            gn = model[0].weight.grad.norm()
            opt.step()
            return loss.detach(), gn
        fn = stepgraph.compile(step) if compiled else step
        g = torch.Generator().manual_seed(1)
        return [fn(torch.randn(4, 3, generator=g)) for _ in range(6)], fn
    want, _ = run(False)
    got, fn = run(True)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    assert fn.stats.captures == 1 and fn.stats.replays == 4, fn.stats


class _Cfg:
    factor = 1.0


def _scaled_loss(c, out):
    return out.pow(2).mean() * c.factor


def test_values_a_functools_partial_binds_are_the_steps_too():
    """``loss_fn = functools.partial(scaled_loss, cfg)``, ``cfg.factor`` changed by the loop: the
    source finder did not look through the partial, so the factor of the capture was baked and
    every replay used it, silently (found by a probe, session 23)."""
    import functools
    cfg = _Cfg()
    loss_fn = functools.partial(_scaled_loss, cfg)

    def make():
        torch.manual_seed(0)
        lin = nn.Linear(4, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)

        def step(x):
            loss = loss_fn(lin(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make()), make()
    g = torch.Generator().manual_seed(0)
    for i in range(5):
        cfg.factor = 1.0 + i
        x = torch.randn(3, 4, generator=g)
        assert torch.equal(sg(x), eager(x)), i
    assert sg.stats.replays == 3


def test_a_defaultdict_key_the_step_reads_only_in_a_branch_is_not_made():
    """``meters = defaultdict(AverageMeter)``; the step updates ``meters["grad_norm"]`` only when
    it skips a step, which this loop never does: keying the step read ``meters["grad_norm"]``,
    and a defaultdict makes a missing key when read, so a phantom meter appeared (eager has none;
    the loop's summary then divided by its zero count). Found by a probe, session 23."""
    import collections

    class Meter:
        def __init__(self):
            self.sum, self.n = 0.0, 0

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meters = collections.defaultdict(Meter)

    def step(x, skip):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if skip:
            meters["grad_norm"].n += 1
        else:
            opt.step()
        return loss.detach()
    sg = stepgraph.compile(step)
    for _ in range(4):
        sg(torch.randn(3, 4), False)
    assert sg.stats.replays == 2 and list(meters) == []


def _epochs_with_fresh_defaultdict_meters(compiled: bool, epochs=3, steps=4):
    """torchvision's classification reference: a fresh ``MetricLogger`` per epoch whose
    ``meters`` is a ``defaultdict(SmoothedValue)``; the step updates ``meters["acc1"]`` and, through
    ``update(**kwargs)``, ``meters["loss"]``, so each epoch's first call makes those meters."""
    import collections

    class Meter:
        def __init__(self):
            self.total, self.count = 0.0, 0

        def update(self, v, n=1):
            self.total += v * n
            self.count += n

    class Logger:
        def __init__(self):
            self.meters = collections.defaultdict(Meter)

        def update(self, **kwargs):
            for k, v in kwargs.items():
                self.meters[k].update(v)

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logger = None

    def step(x):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        logger.update(loss=loss.item())
        logger.meters["acc1"].update(x.shape[0] * 1.0, n=x.shape[0])
        return loss.detach()
    fn = stepgraph.compile(step) if compiled else step
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(epochs):
        logger = Logger()
        logger.meters["lr"].update(0.1)
        for _ in range(steps):
            fn(torch.randn(3, 4, generator=g))
        seen.append({k: (m.total, m.count) for k, m in logger.meters.items()})
    return fn, seen, [p.detach().clone() for p in model.parameters()]


def test_a_fresh_defaultdict_the_step_fills_each_epoch_is_captured():
    """The step makes ``meters["loss"]`` and ``meters["acc1"]`` in each epoch's fresh defaultdict
    (eager does too): not a Python side effect a replay misses -- the graph replays on the dict that
    now has them. Refused as 'changes metric_logger.meters (length 2 -> 5)' after session 23 (the
    defaultdict read without making its keys, test above)."""
    sg, got, params = _epochs_with_fresh_defaultdict_meters(True)
    _, want, eager_params = _epochs_with_fresh_defaultdict_meters(False)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    assert sg.stats.replays >= 6, sg.stats


def test_a_defaultdict_the_step_grows_at_every_call_is_refused():
    """``counts[f"step{i}"] += 1``: a new key at every call, which no replay would make. One
    capture counts as the dict's warm-up (test above); the next sees it grow again and refuses,
    naming the dict; the user's dict holds what eager's holds."""
    import collections
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = collections.defaultdict(int)
    i = 0

    def step(x):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        counts[f"step{i}"] += 1
        return loss.detach()
    sg = stepgraph.compile(step, on_capture_error="eager")
    with pytest.warns(UserWarning, match="counts"):
        for i in range(5):
            sg(torch.randn(3, 4))
    assert dict(counts) == {f"step{k}": 1 for k in range(5)}
    assert sg.stats.replays == 0


class _Tempered(nn.Module):
    """A temperature the training loop anneals on the module (Wav2Vec2ForPreTraining's
    ``set_gumbel_temperature`` at every step, a distillation module's ``self.alpha``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.temperature = 2.0

    def forward(self, x):
        return (self.lin(x) / self.temperature).log_softmax(-1)


def test_a_module_float_the_loop_anneals_is_read_live_not_recaptured_per_value():
    """The forward's ``self.temperature`` was a value key of the module (forward_attrs.py) even
    once the step's own reading of it was live: every call recaptured and none replayed. A
    module float that changes is now read live from its first capture; bitwise with eager."""
    torch.manual_seed(0)
    m1 = _Tempered()
    m2 = copy.deepcopy(m1)
    o1, o2 = torch.optim.AdamW(m1.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)

    def make(m, o):
        def step(x, y):
            loss = F.nll_loss(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return step
    sg, eager = stepgraph.compile(make(m1, o1)), make(m2, o2)
    for k in range(7):
        m1.temperature = m2.temperature = max(2.0 * 0.9 ** k, 0.5)
        x, y = batch(k)
        assert torch.equal(sg(x, y), eager(x, y)), k
        same_params(m1, m2)
    assert (sg.stats.captures, sg.stats.replays) == (1, 5), sg.stats


def test_a_module_float_an_op_bakes_says_so_when_it_recaptures():
    """``model[1].negative_slope`` changed between calls: made live for the next capture, then
    baked by leaky_relu (no tensor form of its slope). The recapture said "now read live at each
    replay: no further recaptures for it", and each change captured again; it says what happens."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LeakyReLU(0.1), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    sg = stepgraph.compile(step)
    for k in range(5):
        model[1].negative_slope = 0.1 + 0.1 * max(0, k - 1)
        sg(torch.randn(3, 4))
    assert sg.stats.recaptures, sg.stats
    assert not any("no further recaptures" in r for r in sg.stats.recaptures), sg.stats.recaptures
    assert any("an op bakes it: keyed by its value" in r for r in sg.stats.recaptures), sg.stats.recaptures


class _ReadsTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(F.dropout(x, p=0.5, training=self.training))   # (PyTorch Geometric's models)


def test_model_train_in_the_step_with_a_forward_reading_self_training_is_no_side_effect():
    """PyTorch Geometric's gcn.py: ``def train(): model.train(); ...`` with ``model.eval()`` for the
    test between calls, and a forward that reads ``self.training`` in Python. The step's own
    ``self.training`` False -> True was refused as a Python side effect (helper-80); the mode is
    guarded at entry and set again after each replay."""
    def make():
        torch.manual_seed(0)
        m = _ReadsTraining()
        o = torch.optim.Adam(m.parameters(), lr=0.01)

        def step(x, y):
            m.train()
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            return loss.detach()
        return m, step
    (me, eager), (ms, sg) = make(), make()
    sg = stepgraph.compile(sg)
    for i in range(6):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        torch.manual_seed(i)
        a = eager(x, y)
        torch.manual_seed(i)
        assert torch.equal(a, sg(x, y)), i
        assert ms.training and all(torch.equal(p, q) for p, q in zip(me.parameters(), ms.parameters())), i
        me.eval()
        ms.eval()
    assert (sg.stats.captures, sg.stats.replays) == (1, 4), sg.stats


EPOCH_NOW = 0


def test_a_number_made_from_a_keyed_value_is_returned_without_a_false_warning():
    """``self.log("epoch_f", float(self.current_epoch))``: a number made from a value the graph is
    keyed by is right at every replay of that graph; it was warned as a frozen Python output, once
    per epoch, with a fix for code the user did not write (helper-92 F5)."""
    import warnings
    global EPOCH_NOW
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    @stepgraph.compile
    def step(x):
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return {"loss": loss.detach(), "epoch": float(EPOCH_NOW)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(9):
            EPOCH_NOW = k // 3
            assert step(torch.randn(3, 4))["epoch"] == float(k // 3)
    assert not [w for w in caught if "returns Python number" in str(w.message)]
