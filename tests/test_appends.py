"""Lists the step appends to (``history.append(loss.detach())``, ``losses.append(loss.item())``):
each replay appends this call's value, as eager does (the zero-to-GANs ``fit_one_cycle`` and
Keras-style history loops). Before, replays appended nothing, warned only."""
import copy
import warnings

import pytest
import torch

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")

history = []


def _pair():
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 3)
    m2 = copy.deepcopy(m)
    return (m, torch.optim.SGD(m.parameters(), lr=0.1)), (m2, torch.optim.SGD(m2.parameters(), lr=0.1))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _train(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _appending_to_history(model, opt):
    """A step that appends its detached loss to the module-global list ``history``."""
    def step(x, y):
        loss = _train(model, opt, x, y)
        history.append(loss.detach())
        return loss.detach()
    return step


def test_a_global_list_of_detached_losses_grows_at_each_replay():
    make = _appending_to_history
    global history
    (m, o), (m2, o2) = _pair()
    sg, eager = stepgraph.compile(make(m, o)), make(m2, o2)
    mine, theirs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "replays will not add to it" warning any more
        for x, y in _batches(6):
            history = mine
            sg(x, y)
            history = theirs
            eager(x, y)
    assert sg.stats.replays == 4, sg.stats
    assert len(mine) == len(theirs) == 6
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert len({id(t) for t in mine}) == 6   # each replay appends its own tensor
    assert "appended to after each replay" in sg.explain()


def test_a_closure_list_of_host_read_losses_and_a_rebound_list():
    def make(model, opt):
        losses = []

        def step(x, y):
            loss = _train(model, opt, x, y)
            losses.append(loss.item())
            return loss.detach()
        return step, losses
    (m, o), (m2, o2) = _pair()
    (f, mine), (g, theirs) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(f)
    for x, y in _batches(6):
        sg(x, y)
        g(x, y)
    assert sg.stats.replays == 4, sg.stats
    assert mine == theirs and all(type(v) is float for v in mine)


def test_a_list_given_other_python_values_is_still_only_warned():
    log = []

    def make(model, opt):
        def step(x, y):
            loss = _train(model, opt, x, y)
            log.append("stepped")
            return loss.detach()
        return step
    (m, o), _ = _pair()
    sg = stepgraph.compile(make(m, o))
    with pytest.warns(UserWarning, match="will not add to it"):
        for x, y in _batches(3):
            sg(x, y)
    assert log == ["stepped", "stepped"]   # warm-up and capture ran Python; the replay did not


def test_a_failed_trace_leaves_the_list_as_one_eager_call_would(monkeypatch):
    from stepgraph import pipeline

    make = _appending_to_history
    global history
    history = []
    (m, o), _ = _pair()
    sg = stepgraph.compile(make(m, o), on_capture_error="eager")
    real = pipeline.clean

    def broken(*a, **k):
        raise RuntimeError("injected")
    monkeypatch.setattr(pipeline, "clean", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in _batches(2):
            sg(x, y)
    monkeypatch.setattr(pipeline, "clean", real)
    assert len(history) == 2, len(history)


def test_a_list_extended_with_plus_equals_is_replayed():
    """CleanRL's ppo.py: ``clipfracs += [((ratio - 1.0).abs() > clip).float().mean().item()]``
    (``nonlocal clipfracs``). An in-place add on a list is ``clipfracs.extend(...)``: replayed
    like an append. Before, it read as a rebinding and was refused."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m2 = copy.deepcopy(m)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)

    def make(model, opt):
        fracs = []

        def step(x):
            nonlocal fracs
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            fracs += [(model(x) > 0).float().mean().item()]
            return loss.detach()
        return step, lambda: fracs
    (sg, got), (eager, want) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(sg)
    for k in range(5):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(k))
        sg(x)
        eager(x)
    assert got() == want() and len(got()) == 5, (got(), want())
    assert sg.stats.captures == 1 and sg.stats.replays == 3, sg.stats


def test_a_new_list_each_epoch_is_the_same_graph():
    """``losses = []`` at each epoch's start, ``losses.append(loss.item())`` in the step (CleanRL's
    ``clipfracs``, most epoch loops): the list is only appended to, so a new one is no new graph
    (it was keyed by identity: a recapture per epoch)."""
    def run(compiled):
        (m, o), _ = _pair()
        box = {}

        def step(x, y):
            loss = _train(m, o, x, y)
            box["losses"].append(loss.item())
            return loss.detach()
        f = stepgraph.compile(step) if compiled else step
        epochs = []
        batches = _batches(12)
        for e in range(4):
            box["losses"] = []
            for x, y in batches[3 * e:3 * e + 3]:
                f(x, y)
            epochs.append(box["losses"])
        return epochs, f
    (mine, sg), (theirs, _) = run(True), run(False)
    assert mine == theirs and all(len(e) == 3 for e in mine)
    assert sg.stats.captures == 1 and sg.stats.replays == 10, sg.stats


def test_a_list_the_step_also_reads_is_not_append_only():
    """A list the step appends to *and* reads (its length scales the input): refused as a
    Python value the step changes, not replayed as a mere append."""
    (m, o), _ = _pair()
    box = {"seen": []}

    def step(x, y):
        box["seen"].append(1)
        return _train(m, o, x * len(box["seen"]), y).detach()
    f = stepgraph.compile(step)
    batches = _batches(2)
    f(*batches[0])
    with pytest.raises(stepgraph.CaptureError, match=r"box\['seen'\]"):
        f(*batches[1])
