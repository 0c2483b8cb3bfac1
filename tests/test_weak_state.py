"""Models and optimizers passed to the step as arguments are held weakly (issue 14): once the
user drops them, their graphs (which hold their parameters, buffers and optimizer state) are
freed at once, and a model passed later is captured afresh -- never replayed on the dead one's
tensors, even when it reuses the dead object's address."""
import copy
import gc
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph


def step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def batch(k):
    g = torch.Generator().manual_seed(50 + k)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def fresh(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    t = copy.deepcopy(m)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), t, torch.optim.Adam(t.parameters(), lr=1e-2)


def run(sg, m, o, t, ot, ks):
    for k in ks:
        assert torch.equal(sg(m, o, *batch(k)), step(t, ot, *batch(k))), k
        for p, q in zip(list(m.parameters()) + list(m.buffers()), list(t.parameters()) + list(t.buffers())):
            assert torch.equal(p, q), k


def test_a_dropped_model_and_optimizer_are_freed_and_a_new_model_captures_fresh():
    sg = stepgraph.compile(step)
    m, o, t, ot = fresh(0)
    run(sg, m, o, t, ot, range(4))
    assert sg.stats.captures == 1 and sg.stats.replays == 2
    refs = [weakref.ref(x) for x in (m, o, m[0].weight, m[1].running_mean, o.state[m[0].weight]["exp_avg"])]
    raised = []   # an exception in the weakref callback is only printed ("Exception ignored")
    hook, sys.unraisablehook = sys.unraisablehook, raised.append
    try:
        del m, o
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert not raised, [str(r.exc_value) for r in raised]
    assert all(r() is None for r in refs), [r() is not None for r in refs]
    assert sg.graphs == []
    m2, o2, t2, ot2 = fresh(1)
    run(sg, m2, o2, t2, ot2, range(4, 8))   # warm-up, capture, replays: as the first one
    assert (sg.stats.eager_calls, sg.stats.captures, sg.stats.replays) == (2, 2, 4), sg.stats


def test_models_made_and_dropped_in_a_loop_never_replay_a_dead_one():
    # A hyper-parameter search: each trial's model may reuse the last one's address.
    sg = stepgraph.compile(step)
    for trial in range(4):
        m, o, t, ot = fresh(trial)
        run(sg, m, o, t, ot, range(3))
        del m, o
        gc.collect()
    assert sg.stats.captures == 4 and sg.stats.replays == 4, sg.stats


def test_a_second_model_keeps_working_when_the_first_is_dropped():
    sg = stepgraph.compile(step)
    a, oa, ta, ota = fresh(0)
    b, ob, tb, otb = fresh(1)
    for k in range(3):
        run(sg, a, oa, ta, ota, [k])
        run(sg, b, ob, tb, otb, [k])
    ref = weakref.ref(a)
    del a, oa
    gc.collect()
    assert ref() is None
    before = sg.stats.replays
    run(sg, b, ob, tb, otb, range(3, 7))   # (its graphs went with a's: warm-up, capture, replays)
    assert sg.stats.replays - before == 2 and len(sg.graphs) == 1, sg.stats


MODEL, OPT = fresh(7)[:2]


def test_state_the_step_reads_from_its_globals_stays_held():
    def g(x, y):
        return step(MODEL, OPT, x, y)
    sg = stepgraph.compile(g)
    for k in range(3):
        sg(*batch(k))
    gc.collect()
    assert len(sg.graphs) == 1 and sg.stats.replays == 1   # (held by the globals: alive, its graph kept)
    sg(*batch(3))
    assert sg.stats.replays == 2


def _kfold(compiled, keep=False):
    """k-fold cross-validation: the step reads the global ``model``/``opt`` rebound per fold."""
    global FOLD_MODEL, FOLD_OPT

    def g(x, y):
        return step(FOLD_MODEL, FOLD_OPT, x, y)
    sg = stepgraph.compile(g) if compiled else g
    out, refs, kept = [], [], []
    for fold in range(10):
        FOLD_MODEL, FOLD_OPT = fresh(fold)[:2]
        refs.append(weakref.ref(FOLD_MODEL))
        kept += [FOLD_MODEL] if keep else []
        if fold % 2:
            FOLD_MODEL[1].eval()   # (the new model's flags are guarded: it is state, not just its params)
        out += [sg(*batch(fold * 10 + k)) for k in range(4)]
        out += [p.detach().clone() for p in list(FOLD_MODEL.parameters()) + list(FOLD_MODEL.buffers())]
    return out, refs, sg


@pytest.mark.parametrize("keep", [False, True])
def test_a_global_model_rebound_per_fold_frees_the_last_folds_graphs_and_replays(keep):
    """A global ``model``/``opt`` rebound per k-fold fold: each fold warms up, captures once and
    replays. Before, the guards' identity keys and the registry held every earlier fold's model,
    optimizer and graphs (6 of 9 alive), the new model was never registered (its train/eval
    flags unguarded), and from the fifth fold every call ran eagerly (max_captures)."""
    want = _kfold(False)[0]
    got, refs, sg = _kfold(True, keep)
    for k, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), k
    gc.collect()
    if not keep:
        assert sum(r() is not None for r in refs[:-1]) == 0
        assert len(sg.graphs) == 1
    assert sg.stats.replays == 20 and sg.stats.captures == 10, sg.stats
    assert not any("requires_grad" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_module_with_tensors_given_anew_each_call_is_said_once():
    """``step(x, y, nn.CrossEntropyLoss(weight=w))`` per batch: each call's criterion is freed
    after it, so every call warmed up or captured again and nothing replayed, said nowhere."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def g(x, y, criterion):
        loss = criterion(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    sg = stepgraph.compile(g)
    with pytest.warns(UserWarning, match="freed after each of the last 3 calls") as w:
        for k in range(8):
            x, y = batch(k)
            sg(x, y, nn.CrossEntropyLoss(weight=1.0 / (torch.bincount(y, minlength=4).float() + 1)))
    assert sum("freed after each" in str(m.message) for m in w) == 1
