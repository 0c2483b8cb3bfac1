"""Issue 5, "Real training loops": the patterns real training code uses, each against an eager twin.

Every case builds two identical models/optimizers, drives the stepgraph step and the eager
function with the same fresh batch every call (warm-up at call 1, capture at call 2, replays
after), and compares outputs, parameters, grads, buffers and optimizer state after every call.
Comparisons are bitwise (the replay runs the same aten kernels as eager); ``MAX_REL`` records
the worst relative error per feature (``python -m pytest -s`` prints it at the end).

Features that cannot be captured must raise ``stepgraph.CaptureError`` whose message says what
to do; those cases assert the error, and that the failing call still left eager-equal state.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint

import stepgraph
from parity import rel_err

MAX_REL: dict[str, float] = {}
STEPS = 7  # call 1 eager, call 2 capture, 5 replays


@pytest.fixture(scope="module", autouse=True)
def _print_max_rel():
    yield
    if MAX_REL:
        width = max(map(len, MAX_REL))
        print("\nmax relative error vs eager, per feature:")
        for k, v in sorted(MAX_REL.items()):
            print(f"  {k:<{width}}  {v:.3g}")


# --------------------------------------------------------------------------- helpers

def same(feature: str, got, want, what: str = "output", rtol: float = 0.0) -> None:
    """Every tensor leaf of ``got`` equals ``want`` (bitwise when rtol == 0); record the error."""
    gl, gs = pytree.tree_flatten(got)
    wl, ws = pytree.tree_flatten(want)
    assert gs == ws, f"{feature}: {what} structure {gs} != eager {ws}"
    for i, (a, b) in enumerate(zip(gl, wl)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{feature}: {what}[{i}] is {type(a)}, eager gave a tensor"
            assert a.dtype == b.dtype and a.shape == b.shape, f"{feature}: {what}[{i}] {a.dtype}{list(a.shape)}"
            if a.dtype in (torch.bool, torch.int64, torch.int32):
                e = 0.0 if torch.equal(a, b) else math.inf
            elif torch.equal(a, b) or (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
                                       and torch.equal(a.isinf(), b.isinf())):
                e = 0.0  # equal, NaNs in the same places
            else:
                e = rel_err(a, b)
            MAX_REL[feature] = max(MAX_REL.get(feature, 0.0), e)
            assert e <= rtol, f"{feature}: {what}[{i}] differs from eager (rel err {e:.3g}, rtol {rtol})"
        else:
            assert a == b, f"{feature}: {what}[{i}] {a!r} != eager {b!r}"


def same_state(feature: str, m1: nn.Module, m2: nn.Module, o1=None, o2=None, rtol: float = 0.0) -> None:
    """Parameters, grads (presence and value), buffers and optimizer state equal the twin's."""
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        same(feature, p, q, f"param {n}", rtol)
        assert (p.grad is None) == (q.grad is None), f"{feature}: .grad presence differs for {n}"
        if p.grad is not None:
            same(feature, p.grad, q.grad, f"grad {n}", rtol)
    for (n, b), c in zip(m1.named_buffers(), m2.buffers()):
        same(feature, b, c, f"buffer {n}", rtol)
    if o1 is not None:
        assert len(o1.state) == len(o2.state)
        for s1, s2 in zip(o1.state.values(), o2.state.values()):
            assert s1.keys() == s2.keys()
            for k in s1:
                same(feature, s1[k], s2[k], f"opt state {k}", rtol)


def twins(build, seed=0):
    torch.manual_seed(seed)
    m = build()
    return m, copy.deepcopy(m)


def counts(step):
    s = step.stats
    return s.eager_calls, s.captures, s.replays


def classify_batch(k, n=8, d=8, classes=4):
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def mlp(d=8, width=16, classes=4, ln=False, dropout=0.0):
    layers = [nn.Linear(d, width)] + ([nn.LayerNorm(width)] if ln else []) + [nn.GELU()]
    layers += [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(*layers, nn.Linear(width, classes))


def train_fn(model, opt, loss_scale=1.0):
    def f(x, y):
        loss = F.cross_entropy(model(x), y) * loss_scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return f


# --------------------------------------------------------------------------- autocast

@pytest.mark.parametrize("where", ["inside", "outside"])
def test_autocast_bf16_around_forward_and_loss(where):
    """autocast(cpu, bf16) inside the step around forward + loss (or around the whole call)."""
    feat = f"autocast bf16 ({where})"
    m1, m2 = twins(lambda: mlp(ln=True))
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m1, m2))

    def make(m, o):
        def f(x, y):
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if where == "inside" else contextlib.nullcontext()
            with ctx:
                logits = m(x)
                loss = F.cross_entropy(logits, y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss, logits
        return f
    step, eager = stepgraph.compile(make(m1, o1)), make(m2, o2)
    for k in range(STEPS):
        batch = classify_batch(k)
        if where == "inside":
            got, want = step(*batch), eager(*batch)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = step(*batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = eager(*batch)
        same(feat, got, want)
        assert got[1].dtype == torch.bfloat16  # autocast is live in every replay, not dropped
        same_state(feat, m1, m2, o1, o2)
    assert counts(step) == (1, 1, STEPS - 2), step.stats
    dtypes = {n.meta["val"].dtype for n in step.graph.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)}
    assert torch.bfloat16 in dtypes


# --------------------------------------------------------------------------- GradScaler

def _scaler_fn(model, opt, scaler, unscale_and_clip=False):
    def f(x, y, flag):
        loss = F.cross_entropy(model(x), y)
        loss = loss * torch.where(flag > 0, float("inf"), 1.0)  # flag == 1: an inf gradient this step
        scaler.scale(loss).backward()
        norm = torch.zeros(())
        if unscale_and_clip:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        found = sum(scaler._found_inf_per_device(opt).values())  # before update() resets it
        scaler.update()
        opt.zero_grad()
        return loss, found, norm
    return f


def test_grad_scaler_exists_on_cpu():
    s = torch.amp.GradScaler("cpu")
    assert s.is_enabled() and s._device == "cpu"


@pytest.mark.parametrize("inf_at", [1, 4], ids=["inf_at_capture", "inf_at_replay"])
@pytest.mark.parametrize("clip", [False, True], ids=["plain", "unscale_clip"])
def test_grad_scaler_fused_adamw_skips_inf_step_like_eager(inf_at, clip):
    """GradScaler + fused AdamW (GradScaler hands found_inf to the kernel: no host sync).

    One call has an inf gradient (a tensor flag, so no recapture): the step is skipped, the
    scale backs off, and scale/growth tracker/found_inf/params equal eager on every call.
    """
    feat = "GradScaler fused AdamW" + (" +unscale_/clip" if clip else "")
    m1, m2 = twins(mlp)
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (m1, m2))
    sc1, sc2 = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2) for _ in range(2))
    step, eager = stepgraph.compile(_scaler_fn(m1, o1, sc1, clip)), _scaler_fn(m2, o2, sc2, clip)
    found_seen = []
    for k in range(8):
        batch = classify_batch(k)
        flag = torch.tensor(1 if k == inf_at else 0)
        before = [p.detach().clone() for p in m1.parameters()]
        scale_before = sc1.get_scale()
        got, want = step(*batch, flag), eager(*batch, flag)
        same(feat, got, want)
        same(feat, sc1._scale, sc2._scale, "scale")
        same(feat, sc1._growth_tracker, sc2._growth_tracker, "growth tracker")
        same_state(feat, m1, m2, o1, o2)
        found_seen.append(float(got[1]))
        if k == inf_at:
            assert all(torch.equal(a, p) for a, p in zip(before, m1.parameters())), "inf step was not skipped"
            assert sc1.get_scale() == scale_before * 0.5  # backoff_factor
        else:
            assert not all(torch.equal(a, p) for a, p in zip(before, m1.parameters()))
    assert found_seen == [1.0 if k == inf_at else 0.0 for k in range(8)]
    assert counts(step) == (1, 1, 6), step.stats


def _capture_error_after_eager_equal(fn_maker, m_build, opt_build, extra_twin_state, batches, **compile_kw):
    m1, m2 = twins(m_build)
    o1, o2 = opt_build(m1), opt_build(m2)
    x1, x2 = extra_twin_state(), extra_twin_state()
    step = stepgraph.compile(fn_maker(m1, o1, x1), **compile_kw)
    eager = fn_maker(m2, o2, x2)
    step(*batches[0])
    eager(*batches[0])
    with pytest.raises(stepgraph.CaptureError) as ei:
        step(*batches[1])
    eager(*batches[1])
    return ei.value, (m1, o1, x1), (m2, o2, x2), step, eager


def test_grad_scaler_with_unfused_optimizer_is_a_capture_error():
    """Default (for-loop) AdamW: GradScaler reads found_inf with .item() to skip the step. That
    is a CaptureError naming grad_scaler.py, after which state equals eager's."""
    batches = [(*classify_batch(k), torch.tensor(0)) for k in range(2)]
    err, (m1, o1, s1), (m2, o2, s2), step, _ = _capture_error_after_eager_equal(
        lambda m, o, s: _scaler_fn(m, o, s), mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), batches, host_reads="error")
    assert "grad_scaler.py" in str(err), str(err)
    same_state("GradScaler unfused (error)", m1, m2, o1, o2)
    same("GradScaler unfused (error)", s1._scale, s2._scale, "scale")
    assert step.stats.failed_captures == 1


def test_grad_scaler_unfused_capture_error_says_to_use_a_fused_optimizer():
    """The fix must be actionable: the .item() is inside GradScaler.step, so 'return the tensor
    and call .item() outside' cannot be done by the user; a fused optimizer (fused=True) is the fix."""
    batches = [(*classify_batch(k), torch.tensor(0)) for k in range(2)]
    err, *_ = _capture_error_after_eager_equal(
        lambda m, o, s: _scaler_fn(m, o, s), mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        lambda: torch.amp.GradScaler("cpu"), batches, host_reads="error")
    assert "fused" in str(err), f"CaptureError for GradScaler does not suggest fused=True:\n{err}"


def test_grad_scaler_unfused_on_capture_error_eager_keeps_training_like_eager():
    feat = "GradScaler unfused (eager fallback)"
    m1, m2 = twins(mlp)
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m1, m2))
    sc1, sc2 = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2) for _ in range(2))
    step = stepgraph.compile(_scaler_fn(m1, o1, sc1), on_capture_error="eager", host_reads="error")
    eager = _scaler_fn(m2, o2, sc2)
    for k in range(STEPS):
        batch = (*classify_batch(k), torch.tensor(1 if k == 4 else 0))
        if k == 1:
            with pytest.warns(UserWarning, match="runs eagerly from now on"):
                same(feat, step(*batch), eager(*batch))
        else:
            same(feat, step(*batch), eager(*batch))
        same(feat, sc1._scale, sc2._scale, "scale")
        same_state(feat, m1, m2, o1, o2)
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays, s.failed_captures) == (STEPS - 1, 0, 0, 1), s


# --------------------------------------------------------------------------- LR schedulers

S = torch.optim.lr_scheduler
SCHEDULERS = {
    "StepLR": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=8),
    "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 1.0 / (1.0 + e)),
    "warmup_SequentialLR": lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=3), S.CosineAnnealingLR(o, T_max=6)],
        milestones=[3]),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=20),
}
OPTS = {
    "adam": lambda ps, lr, **kw: torch.optim.Adam(ps, lr=lr, **kw),
    "sgd_momentum": lambda ps, lr, **kw: torch.optim.SGD(ps, lr=lr, momentum=0.9, **kw),
}


def _hyper(opt):
    g = opt.param_groups[0]
    return tuple((k, float(v) if isinstance(v, torch.Tensor) else v) for k, v in g.items()
                 if k in ("lr", "betas", "momentum"))


def _run_scheduled(feat, sched_name, opt_name, lr, opt_kw, steps=STEPS, sched_kw=None, **compile_kw):
    m1, m2 = twins(mlp)
    o1 = OPTS[opt_name](m1.parameters(), lr.clone() if isinstance(lr, torch.Tensor) else lr, **opt_kw)
    o2 = OPTS[opt_name](m2.parameters(), lr.clone() if isinstance(lr, torch.Tensor) else lr, **opt_kw)
    mk = SCHEDULERS[sched_name] if sched_kw is None else sched_kw
    s1, s2 = mk(o1), mk(o2)
    step, eager = stepgraph.compile(train_fn(m1, o1), **compile_kw), train_fn(m2, o2)
    hypers = []
    for k in range(steps):
        hypers.append(_hyper(o2))
        assert _hyper(o1) == hypers[-1]
        batch = classify_batch(k)
        same(feat, step(*batch), eager(*batch))
        same_state(feat, m1, m2, o1, o2)
        s1.step()  # the scheduler runs OUTSIDE the step
        s2.step()
    return step, hypers, o1


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_scheduler_float_lr_never_recaptures(sched):
    """Float lr: read live from param_groups at each replay from the first capture on
    (eager-identical float arithmetic): no recapture at all."""
    step, hypers, _ = _run_scheduled(f"sched {sched} (float lr)", sched, "adam", 1e-3, {})
    distinct = len(set(hypers[1:]))  # call 1 is the eager warm-up
    assert distinct > 2  # the schedule really changed lr several times during the test
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays) == (1, 1, STEPS - 2) and s.recaptures == [], s


def test_onecycle_sgd_momentum_cycling_stays_live():
    """SGD branches on ``momentum != 0``: only that answer is guarded, the cycled momentum is
    read live (it once recaptured per value); parity holds."""
    step, hypers, _ = _run_scheduled("sched OneCycleLR SGD momentum", "OneCycleLR", "sgd_momentum", 1e-3, {})
    assert step.stats.captures == 1, step.stats


def test_onecycle_float_lr_changes_betas_too():
    """OneCycleLR with Adam also cycles betas[0]: lr and betas both become live values."""
    step, hypers, o1 = _run_scheduled("sched OneCycleLR+Adam betas (float lr)", "OneCycleLR", "adam", 1e-3, {})
    assert len({h[1] for h in hypers}) > 2  # betas changed
    assert step.stats.captures == 1, step.stats


def test_a_group_float_of_the_users_own_changed_every_call_is_read_live():
    """A group float that is no hyper-parameter torch names (here a key of the user's own; a
    running sum schedulefree writes back) was guarded by value: every new value a new graph, up
    to max_captures, then eager. On the replay backend every group float is read live."""
    def bump(o):
        wd = iter([0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08])

        class S:
            def step(self):
                o.param_groups[0]["my_knob"] = next(wd)
        return S()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step, hypers, _ = _run_scheduled("a group float of the user's own", None, "adam", 1e-3, {},
                                         steps=8, sched_kw=bump, max_captures=3)
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays) == (1, 1, 6), s
    assert not any("max_captures" in str(x.message) for x in w)


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_scheduler_tensor_lr_fused_adam_never_recaptures(sched):
    """Adam(lr=torch.tensor(...), fused=True): schedulers fill the lr tensor in place, the graph
    reads it at replay time: exactly one capture, and parity on every step."""
    sched_kw = None
    if sched == "OneCycleLR":  # betas cycling is a float hyper-parameter: see the next test
        sched_kw = lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=20, cycle_momentum=False)  # noqa: E731
    lr = torch.tensor(1e-3)
    step, hypers, o1 = _run_scheduled(f"sched {sched} (tensor lr)", sched, "adam", lr, {"fused": True},
                                      sched_kw=sched_kw)
    assert len({h[0] for h in hypers}) > 1  # lr really changed
    assert isinstance(o1.param_groups[0]["lr"], torch.Tensor)
    assert counts(step) == (1, 1, STEPS - 2), step.stats
    assert step.stats.recaptures == []


def test_onecycle_tensor_lr_with_cycled_betas_never_recaptures():
    """OneCycleLR(cycle_momentum=True) assigns new *float* betas every step: read live from the
    first capture. Parity holds."""
    lr = torch.tensor(1e-3)
    step, hypers, _ = _run_scheduled("sched OneCycleLR betas (tensor lr)", "OneCycleLR", "adam", lr, {"fused": True})
    s = step.stats
    assert len({h[1] for h in hypers[1:]}) > 2 and s.captures == 1 and s.recaptures == [], s


def test_tensor_lr_with_unfused_adam_is_a_capture_error_suggesting_fused():
    batches = [classify_batch(k) for k in range(2)]
    err, (m1, o1, _), (m2, o2, _), *_ = _capture_error_after_eager_equal(
        lambda m, o, _: train_fn(m, o), mlp,
        lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-3), foreach=False), lambda: None, batches)
    assert "fused=True" in str(err), str(err)
    same_state("tensor lr unfused (error)", m1, m2, o1, o2)


# --------------------------------------------------------------------------- gradient clipping

@pytest.mark.parametrize("mode", ["norm", "value", "both", "norm_inf_foreach"])
def test_clip_grad_inside_the_step(mode):
    feat = f"clip_grad ({mode})"
    m1, m2 = twins(mlp)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (m1, m2))

    def make(m, o):
        def f(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            norm = torch.zeros(())
            if mode in ("norm", "both"):
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
            if mode == "norm_inf_foreach":
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01, norm_type=math.inf, foreach=True)
            if mode in ("value", "both"):
                torch.nn.utils.clip_grad_value_(m.parameters(), clip_value=0.005)
            o.step()
            o.zero_grad()
            return loss, norm
        return f
    step, eager = stepgraph.compile(make(m1, o1)), make(m2, o2)
    norms = []
    for k in range(STEPS):
        batch = classify_batch(k)
        got, want = step(*batch), eager(*batch)
        same(feat, got, want)
        same_state(feat, m1, m2, o1, o2)
        norms.append(got[1])
    assert counts(step) == (1, 1, STEPS - 2), step.stats
    if mode != "value":
        assert len({float(n) for n in norms}) == STEPS  # a live norm each replay, not a baked one


def test_clip_grad_norm_error_if_nonfinite_is_a_capture_error():
    """error_if_nonfinite=True branches on the norm in Python: a CaptureError naming clip_grad."""
    def make(m, o, _):
        def f(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)
            o.step()
            o.zero_grad()
            return loss
        return f
    err, (m1, o1, _), (m2, o2, _), *_ = _capture_error_after_eager_equal(
        make, mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), lambda: None,
        [classify_batch(k) for k in range(2)], host_reads="error")
    assert "clip_grad" in str(err) and "bool(tensor)" in str(err), str(err)
    same_state("clip error_if_nonfinite (error)", m1, m2, o1, o2)


# --------------------------------------------------------------------------- gradient accumulation

def test_grad_accumulation_micro_batches_inside_one_step():
    feat = "grad accumulation (4 micro-batches inside)"
    m1, m2 = twins(lambda: mlp(ln=True))
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m1, m2))

    def make(m, o):
        def f(x, y):
            total = torch.zeros(())
            for xs, ys in zip(x.chunk(4), y.chunk(4)):
                loss = F.cross_entropy(m(xs), ys) / 4
                loss.backward()
                total = total + loss.detach()
            o.step()
            o.zero_grad()
            return total
        return f
    step, eager = stepgraph.compile(make(m1, o1)), make(m2, o2)
    for k in range(STEPS):
        batch = classify_batch(k, n=16)
        same(feat, step(*batch), eager(*batch))
        same_state(feat, m1, m2, o1, o2)
    assert counts(step) == (1, 1, STEPS - 2), step.stats


@pytest.mark.parametrize("set_to_none", [True, False])
def test_grad_accumulation_with_optimizer_outside_every_3_calls(set_to_none):
    """The captured step is forward + backward only; opt.step()/zero_grad() run outside every 3
    calls. .grad and params equal eager after every call. zero_grad(set_to_none=True) alternates
    between "grads None" and "grads present": exactly one extra graph (reason names .grad)."""
    feat = f"grad accumulation outside (set_to_none={set_to_none})"
    m1, m2 = twins(mlp)
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m1, m2))

    def make(m):
        def f(x, y):
            loss = F.cross_entropy(m(x), y) / 3
            loss.backward()
            return loss.detach()
        return f
    step, eager = stepgraph.compile(make(m1)), make(m2)
    calls = 10
    for k in range(calls):
        batch = classify_batch(k)
        same(feat, step(*batch), eager(*batch))
        same_state(feat, m1, m2, o1, o2)
        if k % 3 == 2:
            for o in (o1, o2):
                o.step()
                o.zero_grad(set_to_none=set_to_none)
            same_state(feat, m1, m2, o1, o2)
    s = step.stats
    if set_to_none:
        assert (s.eager_calls, s.captures, s.replays) == (1, 2, calls - 3), s
        assert len(s.recaptures) == 1 and ".grad" in s.recaptures[0], s.recaptures
    else:
        assert (s.eager_calls, s.captures, s.replays) == (1, 1, calls - 2), s


# --------------------------------------------------------------------------- activation checkpointing

class CkptNet(nn.Module):
    def __init__(self, d=16, dropout=0.0, bn=False, preserve_rng_state=True, reentrant=False):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d) if bn else nn.Identity(), nn.GELU(),
                          nn.Dropout(dropout) if dropout else nn.Identity())
            for _ in range(2))
        self.head = nn.Linear(d, 4)
        self.kw = dict(use_reentrant=reentrant, preserve_rng_state=preserve_rng_state)

    def forward(self, x):
        for blk in self.blocks:
            x = x + checkpoint(blk, x, **self.kw)
        return self.head(x)


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(bn=True),
    dict(dropout=0.3, preserve_rng_state=False),
    dict(dropout=0.3),  # the default: checkpoint restores the RNG state to recompute the same mask
], ids=["plain", "batchnorm", "dropout_no_rng_preserve", "dropout_preserve_rng"])
def test_activation_checkpointing_inside_the_model(cfg):
    """checkpoint(block, x, use_reentrant=False) in the model; with dropout, the same seed before
    each call in both runs. With preserve_rng_state=True (the default) the recompute in backward
    must reuse the forward's masks on every replay, as eager does (else a CaptureError)."""
    feat = "checkpoint " + ",".join(f"{k}={v}" for k, v in cfg.items())
    m1, m2 = twins(lambda: CkptNet(**cfg))
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m1, m2))
    step, eager = stepgraph.compile(train_fn(m1, o1)), train_fn(m2, o2)
    for k in range(STEPS):
        batch = classify_batch(k, d=16)
        torch.manual_seed(50 + k)
        got = step(*batch)
        torch.manual_seed(50 + k)
        want = eager(*batch)
        same(feat, got, want)
        same_state(feat, m1, m2, o1, o2)
    assert counts(step) == (1, 1, STEPS - 2), step.stats


def test_activation_checkpointing_reentrant():
    feat = "checkpoint use_reentrant=True"
    m1, m2 = twins(lambda: CkptNet(reentrant=True))
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m1, m2))
    step, eager = stepgraph.compile(train_fn(m1, o1)), train_fn(m2, o2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "None of the inputs have requires_grad=True"
        for k in range(STEPS):
            batch = classify_batch(k, d=16)
            same(feat, step(*batch), eager(*batch))
            same_state(feat, m1, m2, o1, o2)
    assert counts(step) == (1, 1, STEPS - 2), step.stats


# --------------------------------------------------------------------------- dropout / BatchNorm

def test_dropout_fresh_randomness_each_replay():
    feat = "dropout"
    m1, m2 = twins(lambda: mlp(width=32, dropout=0.5))
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (m1, m2))
    step, eager = stepgraph.compile(train_fn(m1, o1)), train_fn(m2, o2)
    # (1) the same seed before each call in both runs: equal every call
    for k in range(STEPS):
        batch = classify_batch(k)
        torch.manual_seed(7 + k)
        got = step(*batch)
        torch.manual_seed(7 + k)
        same(feat, got, eager(*batch))
        same_state(feat, m1, m2, o1, o2)
    assert counts(step) == (1, 1, STEPS - 2)
    # (2) seeded once, then a run of replays: they consume the generator exactly as eager does
    torch.manual_seed(123)
    run = [step(*classify_batch(k)) for k in range(4)]
    torch.manual_seed(123)
    for k, got in enumerate(run):
        same(feat, got, eager(*classify_batch(k)), "unseeded sequence")
    same_state(feat, m1, m2, o1, o2)
    # (3) no reseeding, same batch: consecutive replays draw different masks
    batch = classify_batch(0)
    a, b = step(*batch), step(*batch)
    assert not torch.equal(a, b)
    assert counts(step) == (1, 1, STEPS - 2 + 6)


def test_batchnorm_running_stats_equal_eager_and_eval_between_steps():
    feat = "batchnorm running stats"
    m1, m2 = twins(lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)))
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (m1, m2))
    step, eager = stepgraph.compile(train_fn(m1, o1)), train_fn(m2, o2)
    for k in range(STEPS):
        batch = classify_batch(k)
        same(feat, step(*batch), eager(*batch))
        same_state(feat, m1, m2, o1, o2)
        if k == 3:  # an evaluation pass outside the step, as a training loop does
            for m in (m1, m2):
                m.eval()
            with torch.no_grad():
                same(feat, m1(batch[0]), m2(batch[0]), "eval logits")
            for m in (m1, m2):
                m.train()
    assert int(m1[1].num_batches_tracked) == STEPS
    assert counts(step) == (1, 1, STEPS - 2), step.stats


def test_batchnorm_cumulative_average_is_a_capture_error_naming_batchnorm():
    """BatchNorm(momentum=None) computes 1/float(num_batches_tracked) on the host: a CaptureError
    whose message points into batchnorm.py (not the generic nn.Module call wrapper)."""
    err, (m1, o1, _), (m2, o2, _), *_ = _capture_error_after_eager_equal(
        lambda m, o, _: train_fn(m, o),
        lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None), nn.Linear(16, 4)),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1), lambda: None, [classify_batch(k) for k in range(2)],
        host_reads="error")
    same_state("batchnorm momentum=None (error)", m1, m2, o1, o2)
    assert "float(tensor)" in str(err)
    assert "batchnorm" in str(err).lower(), f"the error does not say it comes from BatchNorm:\n{err}"


# --------------------------------------------------------------------------- HF-style batches

class TinyTokenModel(nn.Module):
    """An HF-shaped model: forward(input_ids, attention_mask, labels) -> loss and logits."""

    def __init__(self, vocab=50, d=16, classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, input_ids, attention_mask, labels=None):
        h = self.ln(self.emb(input_ids))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        ctx = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1.0)
        logits = self.head(F.gelu(self.mix(h + ctx)))
        loss = None
        if labels is not None:  # a Python check on None, not on tensor values
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return loss, logits


def hf_batch(k, b=4, t=10, vocab=50, classes=5):
    g = torch.Generator().manual_seed(2000 + k)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    lengths = torch.randint(3, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # padding changes every batch
    labels = torch.where(mask.bool(), torch.randint(0, classes, (b, t), generator=g), -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@dataclasses.dataclass
class StepOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class StepTuple(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


def _pack(kind, loss, logits):
    if kind == "dict":
        return {"loss": loss, "logits": logits}
    if kind == "dataclass":
        return StepOutput(loss, logits)
    if kind == "namedtuple":
        return StepTuple(loss, logits)
    return loss


@pytest.mark.parametrize("call", ["dict_arg", "kwargs"])
@pytest.mark.parametrize("out", ["loss", "dict", "namedtuple", "dataclass"])
def test_hf_style_dict_batches_and_outputs(call, out):
    """A dict batch as one argument or as **kwargs; the step returns the loss, a dict, a
    NamedTuple or a dataclass. Every replay's returned values must be this step's (never the
    capture's): equal to eager, of the same type."""
    feat = f"HF-style batch {call} -> {out}"
    m1, m2 = twins(TinyTokenModel)
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m1, m2))

    def make(m, o):
        def body(batch):
            loss, logits = m(**batch)
            loss.backward()
            o.step()
            o.zero_grad()
            return _pack(out, loss, logits)
        if call == "dict_arg":
            return body
        return lambda **batch: body(batch)
    step, eager = stepgraph.compile(make(m1, o1)), make(m2, o2)
    previous = []
    for k in range(STEPS):
        batch = hf_batch(k)
        got = step(batch) if call == "dict_arg" else step(**batch)
        want = eager(batch) if call == "dict_arg" else eager(**batch)
        assert type(got) is type(want)
        assert not any(got is p for p in previous), \
            f"call {k + 1} returned the very {type(got).__name__} object of an earlier call (a stale result)"
        previous.append(got)
        if out == "dataclass":
            got, want = ([getattr(o, f.name) for f in dataclasses.fields(o)] for o in (got, want))
        same(feat, got, want)
        same_state(feat, m1, m2, o1, o2)
    assert counts(step) == (1, 1, STEPS - 2), step.stats


# --------------------------------------------------------------------------- GNN scatter/gather

class TinyGNN(nn.Module):
    """Message passing with index_select/gather/index_add_/scatter_add_ over an edge index."""

    def __init__(self, d=16, classes=3):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)
        self.gate = nn.Linear(d, 1)
        self.head = nn.Linear(d, classes)

    def forward(self, x, edge_index):
        src, dst = edge_index[0], edge_index[1]
        h = self.l1(x)
        gate = torch.sigmoid(self.gate(h)).gather(0, src.unsqueeze(1))
        agg = torch.zeros_like(h).index_add_(0, dst, h.index_select(0, src) * gate)
        deg = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device).scatter_add_(0, dst, torch.ones_like(dst, dtype=x.dtype))
        h = F.relu(agg / deg.clamp_min(1).unsqueeze(1) + h)
        h2 = self.l2(h)
        idx = src.unsqueeze(1).expand(-1, h2.shape[1])
        agg2 = torch.zeros_like(h2).scatter_add_(0, dst.unsqueeze(1).expand(-1, h2.shape[1]), h2.gather(0, idx))
        return self.head(F.relu(agg2 + h2))


def test_gnn_scatter_gather_with_changing_edge_index():
    feat = "GNN index_add_/scatter_add_/gather"
    n, e, d = 20, 60, 16
    m1, m2 = twins(TinyGNN)
    o1, o2 = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (m1, m2))

    def make(m, o):
        def f(x, edge_index, y):
            loss = F.cross_entropy(m(x, edge_index), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return f
    step, eager = stepgraph.compile(make(m1, o1)), make(m2, o2)
    seen = []
    for k in range(STEPS):
        g = torch.Generator().manual_seed(3000 + k)
        batch = (torch.randn(n, d, generator=g), torch.randint(0, n, (2, e), generator=g),
                 torch.randint(0, 3, (n,), generator=g))
        seen.append(batch[1])
        same(feat, step(*batch), eager(*batch))
        same_state(feat, m1, m2, o1, o2)
    assert not torch.equal(seen[1], seen[2])
    assert counts(step) == (1, 1, STEPS - 2), step.stats


# --------------------------------------------------------------------------- ResNet-style CNN

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    def __init__(self, width=8, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def test_resnet_cnn_residual_blocks_and_batchnorm():
    feat = "ResNet-style CNN + BN"
    m1, m2 = twins(TinyResNet)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
              for m in (m1, m2))
    step, eager = stepgraph.compile(train_fn(m1, o1)), train_fn(m2, o2)
    for k in range(6):
        g = torch.Generator().manual_seed(4000 + k)
        batch = (torch.randn(8, 3, 12, 12, generator=g), torch.randint(0, 10, (8,), generator=g))
        same(feat, step(*batch), eager(*batch))
        same_state(feat, m1, m2, o1, o2)
    assert counts(step) == (1, 1, 4), step.stats
    assert int(m1.layer2.down[1].num_batches_tracked) == 6


# --------------------------------------------------------------------------- the loop around the step

def test_unrelated_module_construction_between_steps_does_not_recapture():
    """Real loops build modules between steps (a loss module in the eval code, a metric, an
    eager copy of a model: transformers' BERT builds nn.CrossEntropyLoss() in every forward).
    None of those touch the step's state, so the step must keep replaying its one graph."""
    feat = "unrelated nn.Module built between steps"
    m1, m2 = twins(mlp)
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m1, m2))
    step, eager = stepgraph.compile(train_fn(m1, o1)), train_fn(m2, o2)
    for k in range(STEPS):
        batch = classify_batch(k)
        same(feat, step(*batch), eager(*batch))
        crit = nn.CrossEntropyLoss()  # e.g. an evaluation criterion built in the loop
        with torch.no_grad():
            crit(m1(batch[0]), batch[1])
    same_state(feat, m1, m2, o1, o2)
    assert counts(step) == (1, 1, STEPS - 2), step.stats
