"""Guards: every change a captured graph assumed away triggers exactly one recapture.

Each test runs a stepgraph step next to an eager twin (a deepcopy of the model with the same
optimizer) and checks, after every call, that the returned value, the model's parameters and
buffers, the grads and the optimizer state are bitwise equal to the twin's. The usual flow:
warm-up (eager) -> capture -> replay with the base signature, then one change -> exactly one
recapture whose reason names the change -> replay of the new graph, then the base signature
again -> replay of the first graph (no new capture).
"""
import contextlib
import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph


# ---- harness -----------------------------------------------------------------------------
def make_model(bn=False):
    torch.manual_seed(0)
    mid = [nn.BatchNorm1d(16)] if bn else []
    return nn.Sequential(nn.Linear(8, 16), *mid, nn.GELU(), nn.Linear(16, 4))


def batch(k, n=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randn(n, 8, generator=g).to(dtype), torch.randint(0, 4, (n,), generator=g)


from parity import ce_step as train_step  # noqa: E402  (shared harness)


def _clone_arg(a):
    if isinstance(a, torch.Tensor):
        return a.detach().clone().requires_grad_(a.requires_grad)
    return a


def _same(a, b, atol):
    if atol is None:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=atol, rtol=atol)


class Pair:
    """A compiled step and its eager twin; every call checks that both agree bitwise."""

    def __init__(self, factory, *, opt_cls=torch.optim.AdamW, opt_kw=None, bn=False, **compile_kw):
        opt_kw = dict(lr=1e-3) if opt_kw is None else opt_kw
        self.model = make_model(bn)
        self.twin = copy.deepcopy(self.model)
        self.opt = opt_cls(self.model.parameters(), **opt_kw)
        self.topt = opt_cls(self.twin.parameters(), **copy.deepcopy(opt_kw))
        self.step = stepgraph.compile(factory(self.model, self.opt), **compile_kw)
        self.eager = factory(self.twin, self.topt)
        self.atol = None  # None: bitwise

    @property
    def stats(self):
        return self.step.stats

    def counts(self):
        s = self.step.stats
        return s.eager_calls, s.captures, s.replays

    def both(self, fn):
        """Apply the same change to (model, opt) and to the twin's."""
        fn(self.model, self.opt)
        fn(self.twin, self.topt)

    def __call__(self, *args):
        got = self.step(*args)
        want = self.eager(*[_clone_arg(a) for a in args])
        assert _same(got, want, self.atol), f"output differs from eager: {got} vs {want}"
        self.check_state()
        return got

    def check_state(self):
        a, b = self.model.state_dict(), self.twin.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert _same(a[k], b[k], self.atol), f"{k} differs from eager"
        for ga, gb in zip(self.opt.param_groups, self.topt.param_groups):
            for p, q in zip(ga["params"], gb["params"]):
                assert _same(p, q, self.atol)
                assert (p.grad is None) == (q.grad is None)
                if p.grad is not None:
                    assert _same(p.grad, q.grad, self.atol), "grad differs from eager"
                sa, sb = self.opt.state.get(p, {}), self.topt.state.get(q, {})
                assert sa.keys() == sb.keys()
                for k in sa:
                    if isinstance(sa[k], torch.Tensor):
                        assert _same(sa[k], sb[k], self.atol), f"optimizer state {k!r} differs"
                    else:
                        assert sa[k] == sb[k]


def drive(p, base, changed=None, *, change=None, undo=None, ctx=contextlib.nullcontext, words=()):
    """warm-up, capture, replay with ``base``; one change -> one recapture; back -> replay."""
    for k in range(3):
        p(*base(k))
    assert p.counts() == (1, 1, 1)
    if change:
        p.both(change)
    changed = changed or base
    with ctx():
        p(*changed(10))
        assert p.counts() == (1, 2, 1)
        assert len(p.stats.recaptures) == 1, p.stats.recaptures
        reason = p.stats.recaptures[0]
        for w in words:
            assert w in reason, f"{w!r} not in recapture reason {reason!r}"
        p(*changed(11))  # the new graph replays
        assert p.counts() == (1, 2, 2)
    if undo:
        p.both(undo)
    p(*base(20))  # the original signature replays the first graph: no new capture
    p(*base(21))
    assert p.counts() == (1, 2, 4)
    assert len(p.stats.recaptures) == 1
    return reason


# ---- one test per guard ------------------------------------------------------------------
def test_guard_input_shape():
    p = Pair(train_step)
    reason = drive(p, batch, lambda k: batch(k, n=4), words=("shape", "(8, 8)", "(4, 8)"))
    assert reason.index("(8, 8)") < reason.index("(4, 8)")  # old -> new


def test_guard_input_dtype():
    def factory(model, opt):
        def step(x, y):
            loss = F.cross_entropy(model(x.float()), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    p = Pair(factory)
    drive(p, batch, lambda k: batch(k, dtype=torch.float64), words=("dtype", "float32", "float64"))


def test_guard_input_requires_grad():
    def with_grad(k):
        x, y = batch(k)
        return x.requires_grad_(True), y
    p = Pair(train_step)
    drive(p, batch, with_grad, words=("requires_grad", "False", "True"))


def test_requires_grad_input_gets_its_grad_on_replay():
    """An input that requires grad gets ``.grad`` from the step's backward, as in eager."""
    p = Pair(train_step)
    for k in range(4):
        x, y = batch(k)
        x.requires_grad_(True)
        xt = x.detach().clone().requires_grad_(True)
        p.step(x, y)
        p.eager(xt, y)
        assert xt.grad is not None
        assert x.grad is not None, f"call {k + 1}: input .grad not set (counts {p.counts()})"
        assert torch.equal(x.grad, xt.grad)
    assert p.counts() == (1, 1, 2)


def test_guard_non_tensor_argument_value():
    def factory(model, opt):
        def step(x, y, scale):
            loss = F.cross_entropy(model(x), y) * scale
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    p = Pair(factory)
    drive(p, lambda k: (*batch(k), 2.0), lambda k: (*batch(k), 3.0), words=("scale", "2.0", "3.0"))


@pytest.mark.parametrize("change", ["order", "missing", "extra", "nested"])
def test_guard_argument_structure_names_the_keys_that_changed(change):
    """A dict batch whose keys changed: the reason names the argument and its keys (it printed
    the first 60 characters of two TreeSpec reprs, equal up to there)."""
    def factory(model, opt):
        def step(batch):
            x = batch["x"] if "x" in batch else batch["inner"]["x"]
            loss = F.cross_entropy(model(x), batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    other = {"order": lambda x, y: {"y": y, "x": x}, "missing": lambda x, y: {"y": y, "inner": {"x": x}},
             "extra": lambda x, y: {"x": x, "y": y, "w": x}, "nested": lambda x, y: {"x": x, "y": [y]}}[change]
    want = {"order": "arg 0 (batch) dict keys ['x', 'y'] -> ['y', 'x']",
            "missing": "arg 0 (batch) dict keys ['x', 'y'] -> ['y', 'inner']",
            "extra": "arg 0 (batch) dict keys ['x', 'y'] -> ['x', 'y', 'w']",
            "nested": "arg 0 (batch)['y']: a value -> a list of 1"}[change]
    p = Pair(factory)
    if change == "nested":   # (the step indexes the list: only the structure is compared here)
        def factory2(model, opt):
            def step(batch):
                y = batch["y"][0] if isinstance(batch["y"], list) else batch["y"]
                loss = F.cross_entropy(model(batch["x"]), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss
            return step
        p = Pair(factory2)
    reason = drive(p, lambda k: ({"x": batch(k)[0], "y": batch(k)[1]},), lambda k: (other(*batch(k)),),
                   words=("arg 0 (batch)",))
    assert reason == want, reason


def test_guard_grad_mode():
    def eval_step(model, opt):
        def step(x, y):
            return F.cross_entropy(model(x), y)
        return step
    p = Pair(eval_step)
    drive(p, batch, ctx=torch.no_grad, words=("grad mode", "True", "False"))


def test_guard_train_eval():
    p = Pair(train_step, bn=True)  # BatchNorm: train and eval compute different things
    reason = drive(p, batch, change=lambda m, o: m.eval(), undo=lambda m, o: m.train(),
                   words=(".training", "True", "False"))
    assert re.search(r"\.training True -> False", reason), reason


def test_guard_autocast():
    p = Pair(train_step)
    p.atol = 2e-2  # bfloat16: compare with eager under the same autocast within tolerance

    def ctx():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    drive(p, batch, ctx=ctx, words=("autocast", "bfloat16"))


def test_guard_float_weight_decay():
    """weight_decay is read live; the optimizer's ``if weight_decay != 0`` is what is guarded:
    0.01 -> 0.05 replays (parity proves the new value is used), 0.05 -> 0 recaptures."""
    def set_wd(v):
        def f(model, opt):
            opt.param_groups[0]["weight_decay"] = v
        return f
    p = Pair(train_step)
    for k in range(3):
        p(*batch(k))
    p.both(set_wd(0.05))
    p(*batch(3))
    assert p.counts() == (1, 1, 2), p.stats.recaptures
    drive_from = p.counts()
    p.both(set_wd(0.0))
    p(*batch(4))
    assert p.counts() == (drive_from[0], 2, drive_from[2]), p.stats.recaptures
    assert "weight_decay" in p.stats.recaptures[0]


def test_float_lr_is_read_live_from_the_first_capture():
    # The loop assigns a new lr every call (nanoGPT's idiom): no recapture on the CPU, and the
    # eager twin's parity proves each replay used that call's lr.
    p = Pair(train_step)
    for k in range(8):
        p.both(lambda m, o: o.param_groups[0].__setitem__("lr", 1e-3 * (k + 1)))
        p(*batch(k))
    assert p.counts() == (1, 1, 6) and p.stats.recaptures == []


def test_float_of_a_live_lr_is_guarded_not_baked():
    # ``float(group['lr'])`` hands Python a plain copy the trace cannot follow (a step that
    # scales its grads by it): its value is guarded, so a scheduler's new lr recaptures with
    # the lr named. Before, the copy was baked and every replay used the first lr, silently.
    def factory(model, opt):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            scale = float(opt.param_groups[0]["lr"]) * 1000
            for q in model.parameters():
                q.grad.mul_(scale)
            opt.step()
            opt.zero_grad()
            return loss
        return step
    p = Pair(factory)
    for k in range(3):
        p(*batch(k))
    p.both(lambda m, o: o.param_groups[0].__setitem__("lr", 5e-4))
    p(*batch(3))
    p(*batch(4))
    assert p.counts() == (1, 2, 2), p.stats.recaptures
    assert "['lr'] 0.001 -> 0.0005" in p.stats.recaptures[0]


def test_tensor_lr_fill_is_read_live_without_recapture():
    # Adam on CPU accepts a tensor lr with fused=True (foreach/single-tensor would call .item()).
    p = Pair(train_step, opt_cls=torch.optim.Adam, opt_kw=dict(lr=torch.tensor(1e-3), fused=True))
    for k in range(3):
        p(*batch(k))
    assert p.counts() == (1, 1, 1)
    lr = p.opt.param_groups[0]["lr"]
    p.both(lambda m, o: o.param_groups[0]["lr"].fill_(5e-2))
    assert p.opt.param_groups[0]["lr"] is lr
    for k in range(3, 6):
        p(*batch(k))  # parity with the twin proves the replay used lr=5e-2, not a baked 1e-3
    assert p.counts() == (1, 1, 4)
    assert p.stats.recaptures == []


def test_guard_layer_frozen_then_unfrozen():
    # Gradual unfreezing: ``requires_grad_(False)`` then ``(True)`` on the first layer between
    # calls. Before, replays kept computing (and applying) its grads while frozen, and kept it
    # frozen once unfrozen: no recapture, silently unlike eager.
    def set_rg(v):
        def f(model, opt):
            model[0].requires_grad_(v)
        return f
    p = Pair(train_step)
    for k in range(3):
        p(*batch(k))
    p.both(set_rg(False))
    for k in range(3, 5):
        p(*batch(k))
    assert p.counts() == (1, 2, 2), p.stats.recaptures
    assert p.stats.recaptures == ["model.0.weight.requires_grad True -> False"], p.stats.recaptures
    p.both(set_rg(True))
    for k in range(5, 8):
        p(*batch(k))   # the first graph again (same signature as before freezing)
    assert p.counts()[1] <= 3 and p.counts()[2] >= 4, p.stats.recaptures


@pytest.mark.parametrize("foreach", [False, True])
def test_radam_rectification_branch_is_a_guarded_decision(foreach):
    # RAdam decides ``if rho_t > 5`` from its step counter and beta2 (a live float): the outcome
    # is guarded at each replay, so the step where it flips captures the other branch once.
    # Before, the comparison guarded only beta2's value and replays kept the first branch
    # (weights 5e-3 from eager after 10 steps, silently).
    p = Pair(train_step, opt_cls=torch.optim.RAdam, opt_kw=dict(lr=1e-2, foreach=foreach))
    for k in range(10):
        p(*batch(k))
    assert p.counts() == (1, 2, 7), p.stats.recaptures
    assert "decision on an optimizer step counter" in p.stats.recaptures[0], p.stats.recaptures


def test_guard_optimizer_state_cleared():
    # ``opt.state.clear()`` (moments reset at a phase change): the next step refills the same
    # dict to the same length; the per-parameter dicts are new. Before, the first graph replayed
    # on the dropped tensors (Adam's step 1 where eager had 3, weights 0.02 apart), silently.
    p = Pair(train_step)
    for k in range(4):
        p(*batch(k))
    p.both(lambda m, o: o.state.clear())
    for k in range(4, 9):
        p(*batch(k))
    assert any("state" in r for r in p.stats.recaptures), p.stats.recaptures


def test_guard_optimizer_load_state_dict():
    p = Pair(train_step)
    for k in range(3):
        p(*batch(k))
    p.both(lambda m, o: o.load_state_dict(o.state_dict()))
    p(*batch(3))
    assert p.counts() == (1, 2, 1)
    assert len(p.stats.recaptures) == 1
    reason = p.stats.recaptures[0]
    assert "state" in reason and "replaced" in reason, reason
    for k in range(4, 7):
        p(*batch(k))  # the new graph replays and updates the *new* state tensors
    assert p.counts() == (1, 2, 4)
    assert len(p.stats.recaptures) == 1


def test_guard_parameter_replaced():
    p = Pair(train_step)
    for k in range(3):
        p(*batch(k))

    def swap(model, opt):
        old = model[0].weight
        new = nn.Parameter(old.detach() * 0.5)
        model[0].weight = new
        group = opt.param_groups[0]["params"]
        group[group.index(old)] = new
        opt.state[new] = opt.state.pop(old)
    p.both(swap)
    p(*batch(3))
    assert p.counts() == (1, 2, 1)
    assert len(p.stats.recaptures) == 1
    assert "module" in p.stats.recaptures[0], p.stats.recaptures[0]
    for k in range(4, 7):
        p(*batch(k))  # a stale graph would have updated the old weight
    assert p.counts() == (1, 2, 4)
    assert len(p.stats.recaptures) == 1


def test_max_captures_overflow_runs_eagerly_with_one_warning():
    p = Pair(train_step, max_captures=2)
    p(*batch(0))
    p(*batch(1))
    p(*batch(2, n=4))
    assert p.counts() == (1, 2, 0)
    with pytest.warns(UserWarning, match="max_captures=2"):
        p(*batch(3, n=2))
    assert p.counts() == (2, 2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only one warning per step function
        p(*batch(4, n=2))
    assert p.counts() == (3, 2, 0)
    p(*batch(5))
    p(*batch(6, n=4))  # both kept graphs still replay
    assert p.counts() == (3, 2, 2)
    assert len(p.step.graphs) == 2


def test_reset_clears_graphs_and_stats():
    p = Pair(train_step)
    for k in range(3):
        p(*batch(k))
    p(*batch(3, n=4))
    assert p.counts() == (1, 2, 1) and p.step.graph is not None
    p.step.reset()
    s = p.step.stats
    assert (s.eager_calls, s.captures, s.replays, s.recaptures, s.failed_captures) == (0, 0, 0, [], 0)
    assert p.step.graph is None and p.step.graphs == []
    assert "0 graph(s)" in p.step.explain()
    p(*batch(4))  # warm-up again
    assert p.counts() == (1, 0, 0)
    p(*batch(5))
    p(*batch(6))
    assert p.counts() == (1, 1, 1)
    assert p.stats.recaptures == []


def test_first_recapture_of_each_kind_is_visible_by_default(caplog):
    """A batch shape that varies once cost a recapture per shape, logged at INFO only (invisible
    unless the user configured logging): the first of each kind is a WARNING, with its cost."""
    import logging
    import stepgraph
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    sg = stepgraph.compile(step)
    with caplog.at_level(logging.INFO, logger="stepgraph"):
        for n in (3, 3, 5, 7):
            sg(torch.randn(n, 4))
    recs = [r for r in caplog.records if "recaptured" in r.getMessage()]
    assert [r.levelno for r in recs] == [logging.WARNING, logging.INFO], [r.getMessage() for r in recs]
    assert "shape" in recs[0].getMessage() and "max_captures" in recs[0].getMessage()


def test_momentum_cycled_by_onecycle_stays_live_and_its_branch_is_guarded():
    """SGD branches on ``momentum != 0``: that once baked momentum, so OneCycleLR (which cycles
    it every step) recaptured every call. Now only the comparison is guarded: one capture,
    bitwise, and a momentum of 0 (the other branch) recaptures once, with its reason."""
    import copy
    import stepgraph
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    m2 = copy.deepcopy(m)
    o, o2 = (torch.optim.SGD(x.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3) for x in (m, m2))
    s1, s2 = (torch.optim.lr_scheduler.OneCycleLR(x, max_lr=0.5, total_steps=40) for x in (o, o2))

    def make(model, opt):
        def step(x, y):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m, o)), make(m2, o2)
    for i in range(10):
        if i == 8:
            for g in o.param_groups + o2.param_groups:
                g["momentum"] = 0.0
        x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
        assert torch.equal(sg(x, y), eager(x, y)), i
        s1.step()
        s2.step()
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert sg.stats.captures == 2, sg.stats.recaptures
    assert "momentum" in sg.stats.recaptures[0]


@pytest.mark.parametrize("case", ["ndarray", "none_pattern", "object"])
def test_recaptures_of_an_identity_or_a_structure_that_keeps_changing_name_a_fix(case, caplog):
    """Corpus clients that recaptured at every call with a reason but no fix: CleanRL's ppo.py
    passes ``mb_inds`` (a new numpy array per minibatch), the DQN tutorial's sampled transitions
    have their terminal ``None``s at new places each call, TeaPearce's DDPM calls a tqdm bar made
    per epoch. The first recapture's log line and the max_captures warning say what to change."""
    import io
    import logging

    import numpy as np
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    data = torch.randn(16, 4)

    if case == "object":
        tqdm = pytest.importorskip("tqdm").tqdm
    bar = None

    def step(idx, pairs):
        if case == "ndarray":   # (its values read in Python: keyed by value; tests/test_numpy_args.py)
            x = data[idx] * (1 + int(idx[0]) % 5)
        elif case == "none_pattern":
            x = torch.cat([a for a, b in pairs if b is not None])
        else:
            x = data
            _shown = bar.set_description("training")   # (its result kept: keyed by identity; a statement call is not: test_library_calls.py)
        loss = m(x).pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()
    sg = stepgraph.compile(step, max_captures=3)
    want = {"ndarray": "reads the values of idx", "none_pattern": "build the tensors", "object": "create it once"}[case]
    with warnings.catch_warnings(record=True) as w, caplog.at_level(logging.WARNING, logger="stepgraph"):
        warnings.simplefilter("always")
        fixed = [(data[i:i + 1], data[i:i + 1]) for i in range(6)]
        for k in range(8):
            idx = np.arange(k, k + 4) if case == "ndarray" else torch.arange(4)
            pairs = [(data[i:i + 1], None if i == k % 6 else data[i:i + 1]) for i in range(6)] \
                if case == "none_pattern" else fixed
            if case == "object":
                bar = tqdm(range(1), file=io.StringIO())
            sg(idx, pairs)
    firsts = [r.getMessage() for r in caplog.records if "recaptured" in r.getMessage()]
    caps = [str(x.message) for x in w if "max_captures=3" in str(x.message)]
    assert firsts and want in firsts[0], firsts
    assert len(caps) == 1 and want in caps[0], caps


def test_a_recapture_names_the_new_object_not_a_value_that_flips_back():
    """TeaPearce's DDPM (clients/ddpm.py): each epoch resets ``loss_ema = None`` and makes a new
    tqdm bar whose ``set_description`` the step calls. Explained against the newest graph, every
    recapture read "loss_ema '<live>' -> None" (or back), a value some graph already has; the bar,
    new each epoch, went unnamed. Explained against the nearest graph, each names the bar."""
    import io
    tqdm = pytest.importorskip("tqdm").tqdm
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    loss_ema, pbar = None, None

    def step(x):
        nonlocal loss_ema
        loss = m(x).pow(2).mean()
        loss.backward()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        _shown = pbar.set_description("training")   # (a result kept: keyed by identity)
        o.step()
        o.zero_grad()
        return loss.detach()
    sg = stepgraph.compile(step)
    for epoch in range(4):
        loss_ema, pbar = None, tqdm(range(2), file=io.StringIO())
        for _ in range(2):
            sg(torch.randn(8, 4))
    assert len(sg.stats.recaptures) >= 4, sg.stats
    assert all(r.startswith("pbar <object at") for r in sg.stats.recaptures), sg.stats.recaptures


def test_an_object_keyed_by_identity_is_held_so_its_id_is_not_reused():
    """A 0-dim numpy array (no array input: keyed by identity) read in the step: a new one at
    each call used to get the freed one's id, matched its key, and replayed its baked value."""
    import numpy as np
    model = torch.nn.Linear(3, 1)
    data = torch.randn(4, 3)

    def step(k):
        return model(data * (int(k) + 1)).sum()
    f = stepgraph.compile(step)
    for v in [1, 0, 1, 3, 0, 1]:
        assert torch.equal(f(np.array(v)), step(np.array(v))), v


def test_a_step_that_sets_grads_to_none_first_replays_on_the_quick_key(monkeypatch):
    """``opt.zero_grad()`` before ``backward()`` leaves new grad tensors after every call: the quick
    key compares them by metadata (as the full signature does), not by identity, so the replays
    after the first do not rebuild the full signature (every other one did: 416 us a call on the
    CPU against eager's 321, now 230)."""
    from stepgraph.capture.guards import Guards
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    f = stepgraph.compile(step)
    batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(12)]
    for x, y in batches[:4]:
        f(x, y)
    full = []
    real = Guards.signature
    monkeypatch.setattr(Guards, "signature", lambda self, a, k: full.append(1) or real(self, a, k))
    for x, y in batches[4:]:
        f(x, y)
    assert f.stats.replays == 10 and len(full) == 0, len(full)
    model[0].weight.grad = torch.zeros(4, 8).t()   # other strides: the quick key differs
    f(*batches[0])
    assert len(full) >= 1


@pytest.mark.parametrize("change", ["prune", "spectral_norm", "parametrize"])
def test_a_structure_change_between_calls_captures_once(change):
    """Pruning, spectral_norm or a parametrization put in after the capture: the graph was filed
    under the key built before the registry saw the change, so the next call captured again,
    naming a misaligned grad."""
    import torch.nn.utils.parametrize as P
    import torch.nn.utils.prune as prune

    class Sym(nn.Module):
        def forward(self, X):
            return X.triu() + X.triu(1).transpose(-1, -2)
    apply = {"prune": lambda m: prune.l1_unstructured(m[0], "weight", amount=0.3),
             "spectral_norm": lambda m: nn.utils.parametrizations.spectral_norm(m[2]),
             "parametrize": lambda m: P.register_parametrization(m[2], "weight", Sym())}[change]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    f = stepgraph.compile(step)
    g = torch.Generator().manual_seed(1)
    for k in range(7):
        if k == 3:
            apply(model)
        f(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
    assert f.stats.captures == 2 and f.stats.replays == 4, f.stats.recaptures


def test_draws_taken_on_some_calls_only_are_named_so_in_the_reason():
    """vit-pytorch CaiT's ``randrange`` runs only when every layer's coin said drop: the draws
    stepgraph takes before the call (its hidden keyword argument) differ. The reason read
    "keyword arguments dict keys [] -> ['_stepgraph_batches']" (helper-88)."""
    import torch.utils._pytree as pytree
    from stepgraph.capture.fetches import FETCH_KW
    from stepgraph.capture.reasons import spec_diff
    none, some = (pytree.tree_flatten(((torch.ones(1),), kw))[1] for kw in ({}, {FETCH_KW: [0.5]}))
    assert spec_diff(none, some, ["x"]) == ("the step's draws on random / numpy.random and next() of its "
                                            "iterators: none at capture, some now")
    assert spec_diff(some, none, ["x"]).endswith("some at capture, none now")
