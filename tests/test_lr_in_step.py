"""The lr computed inside the step from an iteration argument (nanoGPT's ``lr = get_lr(it)``
followed by ``g['lr'] = lr``, inside the function the user compiles): once a value check on it
missed, the number is read live from the call's arguments (numchecks.set_call), the graph
computes the lr, the param groups hold it after each replay and a returned lr is this call's.
One graph per branch of the schedule (warm-up, cosine, floor), never one per call. Every call
is compared bitwise with eager PyTorch on a twin."""
import copy
import math
from math import cos, pi

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

WARMUP, DECAY, LR, MIN_LR = 2, 12, 1e-3, 1e-4


def get_lr(it):   # nanoGPT's train.py
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > DECAY:
        return MIN_LR
    decay_ratio = (it - WARMUP) / (DECAY - WARMUP)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return MIN_LR + coeff * (LR - MIN_LR)


def make(model, opt):
    def step(it, x, y):
        lr = get_lr(it)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, lr
    return step


OPTS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=LR, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=1e-2),
}


@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_lr_from_the_iteration_argument_is_computed_by_the_graph(opt_name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt, topt = OPTS[opt_name](model.parameters()), OPTS[opt_name](twin.parameters())
    step, eager = stepgraph.compile(make(model, opt)), make(twin, topt)
    for it in range(18):
        g = torch.Generator().manual_seed(it)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        (loss, lr), (tloss, tlr) = step(it, x, y), eager(it, x, y)
        assert torch.equal(loss, tloss) and lr == tlr, it
        assert opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"] == get_lr(it), it
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), it
    for a, b in zip(opt.state.values(), topt.state.values()):
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k
    s = step.stats
    # warm-up, then a graph per branch: 'it < 2' (capture), cosine, floor
    assert (s.captures, s.replays) == (3, 14), s.recaptures
    assert all(" < " in r or " > " in r for r in s.recaptures), s.recaptures


class _Counter:
    cur = 0


def get_lr_imported(step):   # OLMo's CosWithWarmup: ``from math import cos, pi``
    return 0.01 + 0.09 * (1 + cos(pi * step / 10)) / 2


def test_an_lr_from_math_functions_imported_by_name_is_not_baked():
    """OLMo's scheduler imports ``cos`` and ``pi`` from math; its trainer counts steps on an
    attribute. The patch on ``math.cos`` never reached the imported name: once the count was read
    live, the cosine of the capture's count was baked and every replay set that lr (helper-79)."""
    def make_olmo(model, opt, st):
        def step(x, y):
            st.cur += 1
            for g in opt.param_groups:
                g["lr"] = get_lr_imported(st.cur)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    twin = copy.deepcopy(model)
    opt, topt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    step, eager = stepgraph.compile(make_olmo(model, opt, _Counter())), make_olmo(twin, topt, _Counter())
    for it in range(8):
        g = torch.Generator().manual_seed(it)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        assert torch.equal(step(x, y), eager(x, y)), it
        assert opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"], it
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters())), it
    assert step.stats.replays >= 5, step.stats


def get_lr_literal(it):   # the same schedule with its constants written in (tracked arithmetic)
    if it < 2:
        return 1e-3 * (it + 1) / 3
    if it > 12:
        return 1e-4
    return 1e-4 + 0.5 * (1.0 + math.cos(math.pi * (it - 2) / 10)) * (1e-3 - 1e-4)


@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_lr_from_literals_and_the_iteration_argument(opt_name):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    twin = copy.deepcopy(model)
    opt, topt = OPTS[opt_name](model.parameters()), OPTS[opt_name](twin.parameters())

    def make2(m, o):
        def step(it, x, y):
            for g in o.param_groups:
                g["lr"] = get_lr_literal(it)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss, o.param_groups[0]["lr"]
        return step
    step, eager = stepgraph.compile(make2(model, opt)), make2(twin, topt)
    for it in range(16):
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        (loss, lr), (tloss, tlr) = step(it, x, y), eager(it, x, y)
        assert torch.equal(loss, tloss) and lr == tlr == opt.param_groups[0]["lr"] == get_lr_literal(it), it
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters())), it
    assert (step.stats.captures, step.stats.replays) == (3, 12), step.stats.recaptures


@pytest.mark.parametrize("how", ["kwarg", "argument"])
def test_an_annealed_loss_coefficient_enters_the_backward_live(how):
    """``ent_coef * entropy`` / ``beta * kl`` with the coefficient annealed each call (PPO, VAE
    KL annealing): autograd keeps the scalar for the backward. Once it moved it enters as a 0-dim
    tensor computed from it at each replay (fp32: the scalar form rounds it the same way), so the
    backward reads it live. Before, each new value recaptured, then the step ran eagerly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt, topt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, twin))

    def make(m, o):
        def step(x, coef=0.1, beta=1.0):
            h = m(x)
            loss = h.square().mean() + coef * h.abs().mean() - h.mean() / beta + (1 - coef) * h.sum() * 0.01
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return step
    step, eager = stepgraph.compile(make(model, opt)), make(twin, topt)
    for k in range(10):
        x = torch.randn(6, 8)
        kw = dict(coef=0.1 * (1 - k / 10), beta=1.0 + k)
        got, want = (step(x, **kw), eager(x, **kw)) if how == "kwarg" else \
            (step(x, *kw.values()), eager(x, *kw.values()))
        assert torch.equal(got, want), k
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters())), k
    assert (step.stats.captures, step.stats.replays) == (2, 7), step.stats.recaptures


def cosine_scheduler(base, final, iters, warmup=0):   # DINO's utils.cosine_scheduler (numpy)
    import numpy as np
    warm = np.linspace(0, base, warmup)
    i = np.arange(iters - warmup)
    return np.concatenate((warm, final + 0.5 * (base - final) * (1 + np.cos(np.pi * i / len(i)))))


@pytest.mark.parametrize("opt_name", ["adamw", "sgd-momentum"])
def test_schedules_held_as_numpy_arrays_are_indexed_live(opt_name):
    """DINO: ``g['lr'] = lr_schedule[it]``, ``g['weight_decay'] = wd_schedule[it]`` and the
    teacher's EMA ``m = momentum_schedule[it]`` index numpy arrays of the closure by the
    iteration. The element is a number computed from the array and the call's ``it`` at each
    replay (read live once it moved): not one graph per iteration (it recaptured at every call)."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    teacher = copy.deepcopy(student).requires_grad_(False)
    twins = copy.deepcopy((student, teacher))
    lr_schedule = cosine_scheduler(1e-2, 1e-4, 20, warmup=3)
    wd_schedule = cosine_scheduler(0.04, 0.4, 20)
    momentum_schedule = cosine_scheduler(0.99, 1.0, 20)

    def make(student, teacher, opt):
        def step(x, it, epoch):
            it = 10 * epoch + it
            for i, g in enumerate(opt.param_groups):
                g["lr"] = lr_schedule[it]
                if i == 0:
                    g["weight_decay"] = wd_schedule[it]
            loss = (student(x) - teacher(x)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                m = momentum_schedule[it]
                for q, k in zip(student.parameters(), teacher.parameters()):
                    k.data.mul_(m).add_((1 - m) * q.detach().data)
            return loss
        return step
    opt, topt = OPTS[opt_name](student.parameters()), OPTS[opt_name](twins[0].parameters())
    step, eager = stepgraph.compile(make(student, teacher, opt)), make(*twins, topt)
    for epoch in range(2):
        for it in range(10):
            x = torch.randn(6, 8)
            got, want = step(x, it, epoch), eager(x, it, epoch)
            assert torch.equal(got, want), (epoch, it)
            assert opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"], (epoch, it)
            assert opt.param_groups[0]["weight_decay"] == topt.param_groups[0]["weight_decay"]
            for a, b in zip(list(student.parameters()) + list(teacher.parameters()),
                            list(twins[0].parameters()) + list(twins[1].parameters())):
                assert torch.equal(a, b), (epoch, it)
    # warm-up, the capture, one more once the iteration moved: never one per iteration
    assert step.stats.captures <= 3, step.stats.recaptures
    # the schedule changes under the graph (a new array in place): read live, as eager
    lr_schedule[:] = 1e-3
    x = torch.randn(6, 8)
    assert torch.equal(step(x, 0, 1), eager(x, 0, 1))
    assert opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"] == 1e-3


def test_a_scheduler_lambda_reading_a_module_attribute_the_forward_reads():
    """The Annotated Transformer: ``LambdaLR(opt, lambda step: rate(step, model.src_embed[0].d_model,
    ...))`` stepped in the step, ``d_model`` also read by the forward (a tracked number there):
    the capture's lr was written back after every replay, over the scheduler's."""
    import math

    class Embeddings(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lut, self.d_model = torch.nn.Embedding(11, 32), 32

        def forward(self, x):
            return self.lut(x) * math.sqrt(self.d_model)

    def rate(step, model_size, warmup=400):
        step = max(step, 1)
        return model_size ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(Embeddings(), torch.nn.Linear(32, 11))
        opt = torch.optim.Adam(model.parameters(), lr=0.5, betas=(0.9, 0.98), eps=1e-9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: rate(s, model[0].d_model))

        def step(src, tgt):
            loss = torch.nn.functional.cross_entropy(model(src), tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            return loss.detach()
        return model, opt, step
    (m1, o1, eager), (m2, o2, f) = make(), make()
    sg = stepgraph.compile(f)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        src, tgt = torch.randint(0, 11, (8,), generator=g), torch.randint(0, 11, (8,), generator=g)
        assert torch.equal(sg(src, tgt), eager(src, tgt))
        assert o2.param_groups[0]["lr"] == o1.param_groups[0]["lr"]
    assert sg.stats.replays >= 5, sg.stats
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


def test_a_scheduler_stepped_with_the_steps_own_counter_follows_it():
    """transformer-xl: ``train_step += 1; scheduler.step(train_step)`` inside the step. A replay
    re-ran the scheduler with the capturing call's epoch, so the cosine schedule froze (lr stuck,
    ``last_epoch`` 4 where eager has 8, every weight off), silently."""
    import warnings

    def run(use_sg, steps=8):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=0.0)
        counter = {"train_step": 0}

        def train_batch(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            counter["train_step"] += 1
            sched.step(counter["train_step"])
            return loss
        step = stepgraph.compile(train_batch) if use_sg else train_batch
        lrs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # (step(epoch) is deprecated)
            for i in range(steps):
                step(torch.randn(8, 4, generator=torch.Generator().manual_seed(i)))
                lrs.append(opt.param_groups[0]["lr"])
        return lrs, sched.last_epoch, model.weight.detach().clone(), step

    want, got = run(False), run(True)
    assert got[3].stats.replays >= 5
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_a_float64_device_lr_divides_as_a_float_lr_does():
    """(The mechanism of test_cuda_live's bitwise Adam with an lr assigned every iteration, here
    on the CPU.) While an optimizer holding a float64 lr tensor steps, ``_foreach_div_`` by that
    lr multiplies by the reciprocal taken in double then rounded to float32, as PyTorch's CUDA
    foreach division by a Python float does; other divisions and later calls are untouched."""
    from stepgraph.optimizers import _divide_as_by_a_float, _divide_plainly
    lr = torch.tensor(3e-4, dtype=torch.float64)
    other = torch.tensor(3e-4, dtype=torch.float64)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.param_groups[0]["lr"] = lr
    xs = [torch.tensor([-0.1], dtype=torch.float32), torch.tensor([-0.0019], dtype=torch.float32)]
    want = [x * torch.tensor(1 / 3e-4, dtype=torch.float32) for x in xs]
    plain = torch._foreach_div_
    _divide_as_by_a_float(opt, (), {})
    try:
        got = [x.clone() for x in xs]
        torch._foreach_div_(got, lr)
        kept = [x.clone() for x in xs]
        torch._foreach_div_(kept, other)
    finally:
        _divide_plainly(opt, (), {})
    assert torch._foreach_div_ is plain
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, x / other) for a, x in zip(kept, xs))


def _sched_twins(make_sched, ret):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    fns = []
    for m in (model, twin):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        fns.append(_sched_step(m, opt, make_sched(opt), ret))
    return model, twin, fns


def _sched_step(m, opt, sched, ret):
    def step(x, y, i):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i % 2 == 1 or ret != "last_lr_every2":
            sched.step()
        if ret == "appended":   # (in the step's own code: a helper's appends are warned, not replayed)
            hist.append(sched.get_last_lr()[0])
            return loss, opt.param_groups[0]["lr"]
        return ret_value(ret, loss, opt, sched)
    hist: list = []
    step.hist = hist
    return step, opt, sched


_LOGS = {"lr": 0.0}


def ret_value(ret, loss, opt, sched):
    if ret == "group":
        return loss, opt.param_groups[0]["lr"]
    if ret.startswith("last_lr"):
        return loss, sched.get_last_lr()[0]
    lr = opt.param_groups[0]["lr"]
    if ret == "stored":
        _LOGS["lr"] = lr
        return loss, _LOGS["lr"]
    if ret == "printed":
        print(f"lr {opt.param_groups[0]['lr']:.6f}")
        return loss, 0.0
    return loss * lr


@pytest.mark.parametrize("ret", ["group", "last_lr", "last_lr_every2", "stored", "appended", "printed"])
@pytest.mark.parametrize("sched", ["multistep", "steplr"])
def test_the_lr_a_scheduler_stepped_in_the_step_sets_is_returned_as_eager_returns_it(sched, ret, capsys):
    """``sched.step(); return loss, opt.param_groups[0]['lr']`` (or ``get_last_lr()[0]``): the
    scheduler runs again after each replay, and the lr it set exists only then. Where the
    scheduler left the lr unchanged at capture (MultiStepLR between milestones) the trace put
    the live lr back, read at the graph's start: every replay returned the call's starting lr,
    the milestone's one call late, silently (probe s25_probe p12). Stored in a dict, appended
    to a list or printed formatted (``f"{lr:.6f}"``) after the scheduler step, it is read from
    the group when the replay writes it (the print repeated the capture's text, silently)."""
    make_sched = {"multistep": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[3, 5], gamma=0.5),
                  "steplr": lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5)}[sched]
    model, twin, ((fn, opt, sc), (efn, eopt, esc)) = _sched_twins(make_sched, ret)
    step = stepgraph.compile(fn)
    for i in range(10):
        torch.manual_seed(i)
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        got = step(x, y, i)
        printed = capsys.readouterr().out
        want = efn(x, y, i)
        assert printed == capsys.readouterr().out, i
        assert torch.equal(got[0], want[0]) and got[1] == want[1] and type(got[1]) is float, (i, got, want)
        assert opt.param_groups[0]["lr"] == eopt.param_groups[0]["lr"], i
        assert type(opt.param_groups[0]["lr"]) is float and all(type(v) is float for v in sc.get_last_lr())
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), i
    assert step.stats.replays >= 6
    assert fn.hist == efn.hist and (ret != "appended" or len(fn.hist) == 10)


@pytest.mark.parametrize("ret", ["tensor"])
def test_the_lr_a_scheduler_set_used_later_in_the_step_is_refused(ret):
    """A tensor op on the lr the scheduler just set would need it before the graph ran: refused
    at the scheduler's line, the call as eager left it (it was baked: silently wrong at the next
    milestone). Arithmetic on it returned is warned (test_footguns)."""
    make_sched = lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5)   # noqa: E731
    model, twin, ((fn, opt, sc), (efn, eopt, esc)) = _sched_twins(make_sched, ret)
    step = stepgraph.compile(fn)
    for i in range(2):
        torch.manual_seed(i)
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        want = efn(x, y, i)
        if i == 0:
            step(x, y, i)
            continue
        with pytest.raises(stepgraph.CaptureError, match="StepLR.step\\(\\) set in this call is used later"):
            step(x, y, i)
    assert opt.param_groups[0]["lr"] == eopt.param_groups[0]["lr"] and sc.last_epoch == esc.last_epoch
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("spec", [".6f", ".2e", ""])
def test_a_live_lr_formatted_in_a_print_is_printed_as_eager_prints_it(spec, capsys):
    """``print(f"lr={opt.param_groups[0]['lr']:.6f}")`` with the lr the loop assigns before each
    call: the redone print rebuilt its text from the capture's string, so every replay printed
    the capture's lr, silently (probe /work/repros/s26/print_lr.py)."""
    printed = []
    for use in (False, True):
        torch.manual_seed(0)
        m = nn.Linear(4, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def fn(x):
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"lr={opt.param_groups[0]['lr']:{spec}} step")
            return loss
        step = stepgraph.compile(fn) if use else fn
        for i in range(6):
            opt.param_groups[0]["lr"] = 0.1 / (i + 1)
            step(torch.randn(8, 4))
        printed.append(capsys.readouterr().out)
        if use:
            assert step.stats.replays == 4
    assert printed[0] == printed[1] and printed[0].count("step") == 6
