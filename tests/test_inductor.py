"""``backend="inductor"``: the whole step fused by TorchInductor, equal to eager within fp tolerance.

Fusion reorders float arithmetic, so parity is a tolerance (the max relative error per
tensor is printed); the optimizer runs PyTorch's capturable path (see backends/inductor.py).
"""
import os

import pytest
import torch

from parity import run_parity

DEVICE = "cuda" if os.environ.get("STEPGRAPH_TEST_CUDA") and torch.cuda.is_available() else "cpu"
SMALL = {"mlp": {"width": 32, "depth": 3}, "gpt": {"layers": 1, "d": 32, "heads": 2, "vocab": 64, "seq": 16}}
# GPT runs SGD: its attention key bias has a mathematically zero gradient, so its "gradient"
# is rounding noise that Adam normalises into lr-sized steps, which no fused kernel reproduces.
CASES = [("mlp", "adamw", "default"), ("mlp", "sgd", "default"), ("mlp", "sgd", "foreach"),
         ("mlp", "adam", "fused"), ("mlp", "rmsprop", "foreach"), ("gpt", "sgd", "default"),
         ("cnn_bn", "sgd", "default"), ("embedding_model", "adam", "default"), ("tied", "adamw", "foreach")]


@pytest.mark.parametrize("family,opt_name,form", CASES)
def test_inductor_parity(family, opt_name, form):
    rep = run_parity(family, opt_name, form, device=DEVICE, backend="inductor", rtol=2e-5,
                     config=SMALL.get(family))
    worst = sorted(rep.max_rel.items(), key=lambda kv: -kv[1])[:3]
    print(f"{family}/{opt_name}/{form} on {DEVICE}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst))


def test_inductor_reports_compile_time_and_keeps_user_optimizer_flags():
    import stepgraph
    from stepgraph.tools import models
    case = models.build("mlp", width=16, depth=2)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3, fused=True)

    def step(x, y):
        loss = case.loss_fn(case.model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    sg = stepgraph.compile(step, backend="inductor")
    for i in range(4):
        sg(*case.make_batch(i))
    assert sg.stats.captures == 1 and sg.stats.replays == 2
    assert sg.wait_compiled()
    sg(*case.make_batch(4))
    assert sg.stats.compile_seconds > 0
    assert "Inductor graph live from this graph's replay 3 (compiled in the background" in sg.explain(), sg.explain()
    g = opt.param_groups[0]
    assert g["fused"] is True and g["capturable"] is False, "the user's optimizer flags must be restored"


def test_inductor_sgd_update_from_a_matmul_keeps_its_alpha():
    """Regression: Inductor's addmm pattern dropped add's alpha (param += grad instead of -lr*grad)."""
    import copy

    import stepgraph
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3, bias=False)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.5), torch.optim.SGD(m2.parameters(), lr=0.5)

    def mk(mod, opt):
        def step(x):
            loss = mod(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(m, o), backend="inductor"), mk(m2, o2)
    for i in range(5):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(sg(x), eager(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.weight, m2.weight, rtol=1e-5, atol=1e-6)


def _mlp_step(width=16, device="cpu"):
    from stepgraph.tools import models
    case = models.build("mlp", width=width, depth=2, device=device)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    return case, opt, models.train_step(case.model, case.loss_fn, opt)


def _mlp_with_twin(device="cpu"):
    """``_mlp_step`` and its eager twin: (case, step, twin, eager step)."""
    from stepgraph.tools import models
    case, _, step = _mlp_step(device=device)
    twin = case.fresh()
    return case, step, twin, models.train_step(twin.model, twin.loss_fn,
                                               torch.optim.AdamW(twin.model.parameters(), lr=1e-3))


def test_inductor_background_compile_does_not_block_and_switches_seamlessly():
    """The capturing call returns without waiting for Inductor; calls meanwhile run the unfused
    graph (bitwise eager); after the switch the fused graph continues the same training."""
    import time

    import stepgraph
    case, opt, step = _mlp_step()
    twin = case.fresh()
    opt2 = torch.optim.AdamW(twin.model.parameters(), lr=1e-3)
    from stepgraph.tools import models
    eager = models.train_step(twin.model, twin.loss_fn, opt2)
    sg = stepgraph.compile(step, backend="inductor")
    t0 = time.perf_counter()
    for i in range(3):
        b = case.make_batch(i)
        assert torch.equal(sg(*b), eager(*b)), "unfused calls are eager's kernels: bitwise"
    unfused_s = time.perf_counter() - t0
    run = sg.captures[0].run
    assert run.state == "compiling", "a C++ compile of a whole step takes seconds: still running"
    assert "compiling in a background process" in sg.explain()
    assert sg.wait_compiled()
    # (not compared with unfused_s: a timing, which a loaded box inverts; "compiling" after three
    # calls is what shows the capture did not wait)
    assert run.compile_seconds > 0, (run.compile_seconds, unfused_s)
    for i in range(3, 8):
        b = case.make_batch(i)
        torch.testing.assert_close(sg(*b), eager(*b), rtol=2e-5, atol=1e-6)
    for p, p2 in zip(case.model.parameters(), twin.model.parameters()):
        torch.testing.assert_close(p, p2, rtol=2e-5, atol=1e-6)


def test_inductor_blocking_compile_when_background_is_off(monkeypatch):
    import stepgraph
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_BACKGROUND", "0")
    case, opt, step = _mlp_step()
    sg = stepgraph.compile(step, backend="inductor")
    for i in range(2):
        sg(*case.make_batch(i))
    assert sg.stats.compile_seconds > 0, "compiled inside the capturing call"
    run = sg.captures[0].run
    # (checked at its first call as a background compile is at its switch: CPU, backends/inductor.py)
    assert run.wait(0) and run.where == "in-process" and run.state == "fused"
    sg(*case.make_batch(2))
    assert "compiled in-process" in sg.explain() and "parity-checked" in sg.explain(), sg.explain()
    [p] = sg.stats.fused_parity
    assert p.diverged is None and p.compared > 0, p
    assert sg.stats.compile_seconds == pytest.approx(run.compile_seconds), "not counted twice"


def test_inductor_failed_background_compile_warns_and_keeps_the_unfused_graph(monkeypatch):
    import stepgraph
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_PATCHES", '{"no_such_inductor_option": 1}')
    case, opt, step = _mlp_step()
    sg = stepgraph.compile(step, backend="inductor")
    for i in range(2):
        sg(*case.make_batch(i))
    with pytest.warns(UserWarning, match="background Inductor compile failed.*no_such_inductor_option"):
        assert not sg.wait_compiled()
    sg(*case.make_batch(2))
    assert sg.stats.replays == 1 and "compile failed, running the unfused graph" in sg.explain()


def test_inductor_failed_blocking_compile_warns_and_runs_the_unfused_graph(monkeypatch):
    """As a failed background compile: the capturing call keeps its result and the step runs the
    unfused graph, warned and shown by explain() (was: a CaptureError, losing the call's result).
    The graph steps the optimizer's capturable form, traced for Inductor: parameters within fp
    tolerance of eager's."""
    import stepgraph
    from stepgraph.backends import inductor
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_BACKGROUND", "0")

    def broken(*a, **k):
        raise AssertionError("injected Inductor failure")
    monkeypatch.setattr(inductor, "_compile", broken)
    case, step, twin, eager = _mlp_with_twin()
    sg = stepgraph.compile(step, backend="inductor")
    for i in range(5):
        b = case.make_batch(i)
        with pytest.warns(UserWarning, match="Inductor could not compile.*injected") if i == 1 else _quiet():
            torch.testing.assert_close(sg(*b), eager(*b), rtol=2e-5, atol=1e-6)
    for p, p2 in zip(case.model.parameters(), twin.model.parameters()):
        torch.testing.assert_close(p, p2, rtol=2e-5, atol=1e-6)
    assert (sg.stats.captures, sg.stats.replays, sg.stats.failed_captures) == (1, 3, 0), sg.stats
    assert "Inductor compile failed, running the unfused graph: AssertionError" in sg.explain()


def _quiet():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA memory of the fused graph's switch (STEPGRAPH_TEST_CUDA=1)")
def test_inductor_switch_does_not_hold_the_state_twice():
    """The first fused call is that call's real step (then recorded), not a warm-up on copies
    of the parameters and optimizer state: the switch's peak memory stays near an eager step's."""
    import stepgraph
    from stepgraph.tools import models
    case = models.build("mlp", width=2048, depth=4, batch=8, device="cuda")
    twin = case.fresh()
    eager = models.train_step(twin.model, twin.loss_fn, torch.optim.AdamW(twin.model.parameters(), lr=1e-3))
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    sg = stepgraph.compile(models.train_step(case.model, case.loss_fn, opt), backend="inductor")
    param_bytes = sum(p.numel() * p.element_size() for p in case.model.parameters())

    def peak_of_call(f, i):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        f(*case.make_batch(i))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    for i in range(2):
        sg(*case.make_batch(i))
        eager(*case.make_batch(i))
    eager_peak = peak_of_call(eager, 2)
    unfused = peak_of_call(sg, 2)
    assert sg.wait_compiled()
    switch = peak_of_call(sg, 3)
    fused = peak_of_call(sg, 4)
    print(f"peak above the state, MiB: eager step {eager_peak / 2**20:.1f}, unfused replay {unfused / 2**20:.1f}, "
          f"switch {switch / 2**20:.1f}, fused replay {fused / 2**20:.1f}; parameters {param_bytes / 2**20:.1f}")
    # Copies of parameters + exp_avg + exp_avg_sq would add 3x the parameter bytes.
    assert switch < eager_peak + param_bytes, (switch, eager_peak, param_bytes)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA-graph recording of the fused step (STEPGRAPH_TEST_CUDA=1)")
def test_inductor_record_failure_after_the_first_fused_call_keeps_training(monkeypatch):
    """The first fused call has already stepped the model when the recording runs: a failed
    recording must not lose that step nor stop training (later calls run the step's unfused CUDA
    graph, with a warning)."""
    import stepgraph
    from stepgraph.backends import cudagraph
    case, step, twin, eager = _mlp_with_twin(device="cuda")
    sg = stepgraph.compile(step, backend="inductor")
    for i in range(3):
        b = case.make_batch(i)
        assert torch.equal(sg(*b), eager(*b))
    assert sg.wait_compiled()

    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(cudagraph, "record", broken)
    with pytest.warns(UserWarning, match="could not be recorded into a CUDA graph; it runs its unfused CUDA graph"
                                         ".*not permitted"):
        b = case.make_batch(3)
        torch.testing.assert_close(sg(*b), eager(*b), rtol=2e-5, atol=1e-6)
    assert "could not be recorded into a CUDA graph (RuntimeError), runs its unfused CUDA graph" in sg.explain()
    for i in range(4, 7):
        b = case.make_batch(i)
        torch.testing.assert_close(sg(*b), eager(*b), rtol=2e-5, atol=1e-6)
    for p, p2 in zip(case.model.parameters(), twin.model.parameters()):
        torch.testing.assert_close(p, p2, rtol=2e-5, atol=1e-6)


def test_record_failure_runs_the_fallback_from_then_on(monkeypatch):
    """``record_after_first_call``: the first call runs the compiled function; a recording that
    fails hands later calls to the fallback (the step's unfused CUDA graph), or else to the
    compiled function itself, warned either way."""
    from stepgraph.backends import cudagraph
    from stepgraph.backends.runner import Runner

    class Fallback(Runner):
        def __call__(self, inputs):
            return ["fallback"]

    monkeypatch.setattr(cudagraph, "record", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("capture failed")))
    for fallback, later in ((Fallback(), ["fallback"]), (None, ["compiled"])):
        run = cudagraph.record_after_first_call(lambda *x: ["compiled"], fallback=fallback)
        with pytest.warns(UserWarning, match="could not be recorded.*capture failed"):
            assert run([]) == ["compiled"]
        assert run([]) == later and run.stale() is None
        assert "could not be recorded into a CUDA graph (RuntimeError), runs " + (
            "its unfused CUDA graph from now on" if fallback else "without one from now on") in run.describe()


@pytest.mark.parametrize("sched", ["assigned", "onecycle", "epochs_read"])
def test_inductor_hyper_parameters_a_loop_changes_compile_once(sched, monkeypatch):
    """nanoGPT's ``g["lr"] = get_lr(it)`` (SGD) and OneCycleLR cycling AdamW's lr and betas:
    once recompiled every call; now fed to the fused graph as a tensor (passes/device_scalars.py).
    ``epochs_read``: torchvision's reference recipe, a warm-up SequentialLR stepped per epoch and
    the step returning ``opt.param_groups[0]["lr"]`` to its logger: recaptured at each schedule
    change on the GPU (the lr named twice, live once and keyed by value once; the returned float
    baked) -- the returned lr is now this call's host value."""
    import copy
    import stepgraph
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_BACKGROUND", "0")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(DEVICE)
    m2 = copy.deepcopy(m)
    if sched == "assigned":
        o, o2 = (torch.optim.SGD(x.parameters(), lr=0.1, momentum=0.9) for x in (m, m2))
        scheds = []
    elif sched == "onecycle":
        o, o2 = (torch.optim.AdamW(x.parameters(), lr=1e-3) for x in (m, m2))
        scheds = [torch.optim.lr_scheduler.OneCycleLR(x, max_lr=1e-2, total_steps=20) for x in (o, o2)]
    else:
        o, o2 = (torch.optim.SGD(x.parameters(), lr=0.5, momentum=0.9) for x in (m, m2))
        scheds = [torch.optim.lr_scheduler.SequentialLR(x, [torch.optim.lr_scheduler.LinearLR(x, 0.01, total_iters=1),
                                                           torch.optim.lr_scheduler.CosineAnnealingLR(x, T_max=3)], [1])
                  for x in (o, o2)]

    def make(model, opt):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return (loss.detach(), opt.param_groups[0]["lr"]) if sched == "epochs_read" else loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m, o), backend="inductor"), make(m2, o2)
    for i in range(7 if sched != "epochs_read" else 9):
        if sched == "assigned":
            for g in o.param_groups + o2.param_groups:
                g["lr"] = 0.1 / (i + 1)
        x, y = torch.randn(4, 8, device=DEVICE), torch.randn(4, 2, device=DEVICE)
        got, want = sg(x, y), eager(x, y)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if sched == "epochs_read":
            assert type(got[1]) is float and got[1] == want[1]
        for s in scheds if sched != "epochs_read" or i % 3 == 2 else ():
            s.step()
    for p, q in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert sg.stats.captures == 1, sg.stats.recaptures
    assert sg.stats.compile_seconds > 0, sg.explain()  # fused, not the unfused fallback
    assert "into one device tensor" in sg.explain()


# Every torch.optim optimizer through the whole-step Inductor graph on the CPU. Adadelta hit
# PyTorch's capturable device check mid-trace (AssertionError: the update was lost): the trace
# widened that check only in a hand-kept list of optimizer modules.
INDUCTOR_OPTIMIZERS = {
    "adadelta": (torch.optim.Adadelta, {}),
    "adadelta_foreach": (torch.optim.Adadelta, dict(foreach=True, weight_decay=0.1)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=1e-3)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2)),
    "nadam_decoupled": (torch.optim.NAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1)),
    "radam": (torch.optim.RAdam, dict(lr=1e-2)),
    "asgd": (torch.optim.ASGD, dict(lr=1e-2, t0=2)),
    "rprop": (torch.optim.Rprop, dict(lr=1e-2)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)),
}


@pytest.mark.parametrize("name", list(INDUCTOR_OPTIMIZERS))
def test_inductor_every_optimizer_matches_eager(name, monkeypatch):
    import copy

    import stepgraph
    # In-process compile: one tiny graph compiles in ~1 s once Inductor is loaded.
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_BACKGROUND", "0")
    cls, kw = INDUCTOR_OPTIMIZERS[name]
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    m2 = copy.deepcopy(m)
    o, o2 = cls(m.parameters(), **kw), cls(m2.parameters(), **copy.deepcopy(kw))

    def mk(mod, opt):
        def step(x, y):
            loss = torch.nn.functional.cross_entropy(mod(x), y)
            loss.backward()
            opt.step()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(m, o), backend="inductor"), mk(m2, o2)
    close = dict(rtol=2e-5, atol=1e-6)
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        torch.testing.assert_close(sg(x, y), eager(x, y), **close)
    assert (sg.stats.captures, sg.stats.replays, sg.stats.failed_captures) == (1, 3, 0), sg.stats
    for p, p2 in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(p, p2, **close)
        torch.testing.assert_close(p.grad, p2.grad, **close)  # grads accumulate: no zero_grad
        for k, v in o.state[p].items():
            torch.testing.assert_close(v, o2.state[p2][k], **close, msg=lambda s: f"state {k!r}: {s}")
    assert all(g.get("capturable", False) is False for g in o.param_groups), "user flags restored"


@pytest.mark.parametrize("parts", [1, 2])
def test_inductor_artifact_cache_loads_a_rerun_without_compiling(tmp_path, monkeypatch, caplog, parts):
    """A second run of the same step (a rerun of the script) loads the fused graph the first one
    compiled from stepgraph's artifact cache, with no child process, and trains identically;
    compiled in parts, each part is an entry of its own."""
    import logging

    import stepgraph
    from stepgraph.backends import partition
    monkeypatch.setenv("STEPGRAPH_ARTIFACT_CACHE", str(tmp_path))
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_PARTS", str(parts))
    # (the cache is off where Inductor's caches are; the benchmark's tests turn those off for good)
    import torch._inductor.config as ic
    monkeypatch.setattr(ic, "force_disable_caches", False)
    monkeypatch.setattr(torch.compiler.config, "force_disable_caches", False)
    caplog.set_level(logging.INFO, logger="stepgraph")
    runs = []
    for attempt in range(2):
        torch.manual_seed(0)
        case, opt, step = _mlp_step()
        sg = stepgraph.compile(step, backend="inductor")
        losses = [sg(*case.make_batch(i)) for i in range(2)]
        job = sg.captures[0].run.job
        jobs = job.jobs if isinstance(job, partition.PartsCompile) else [job]
        assert len(jobs) == parts and all((j.cached is None) == (attempt == 0) for j in jobs), attempt
        assert sg.wait_compiled(), sg.explain()
        losses += [sg(*case.make_batch(i)) for i in range(2, 5)]
        runs.append((losses, [p.detach().clone() for p in case.model.parameters()]))
        assert len(list(tmp_path.glob("*.bin"))) == parts
    assert "in stepgraph's artifact cache" in caplog.text
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert torch.equal(a, b), "the same compiled code on the same inputs"


def test_inductor_artifact_cache_key_follows_the_graph_and_its_inputs():
    from stepgraph.backends import artifact_cache
    from stepgraph.backends.compile_worker import InputSpec
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    gm2 = torch.fx.symbolic_trace(lambda x: x * 3)
    a = [InputSpec.of(torch.zeros(2, 3))]
    k = artifact_cache.key(gm, a, {})
    assert k == artifact_cache.key(gm, a, {})
    assert k != artifact_cache.key(gm2, a, {})
    assert k != artifact_cache.key(gm, [InputSpec.of(torch.zeros(3, 2))], {})
    assert k != artifact_cache.key(gm, a, {"max_autotune": True})


def test_inductor_switch_survives_warnings_raised_as_errors():
    """A warnings filter set to "error" (pytest -W error, a test's simplefilter) once failed
    the background compile: Inductor's imports in the watcher thread warn (torch.jit's
    deprecation, torch 2.11). The load then happens on the user's thread, warnings silenced."""
    import subprocess
    import sys
    script = (
        "import warnings, torch, stepgraph\n"
        "from stepgraph.tools import models\n"
        "case = models.build('mlp', width=16, depth=2)\n"
        "opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)\n"
        "sg = stepgraph.compile(models.train_step(case.model, case.loss_fn, opt), backend='inductor')\n"
        "warnings.simplefilter('error')\n"
        "for i in range(3):\n"
        "    sg(*case.make_batch(i))\n"
        "assert sg.wait_compiled(), sg.explain()\n"
        "sg(*case.make_batch(3))\n"
        "print('STATE', sg.captures[0].run.state)\n")
    env = dict(os.environ, STEPGRAPH_PROGRESS="0", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "STATE fused" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_inductor_reads_an_lr_computed_from_the_iteration():
    """An lr computed from the call's ``it`` inside the step: once that number moves it is read
    live, the optimizer's ops taking it run on the host between Inductor-fused segments
    (backends/inductor_segments.py). (Before: refused with a fix at each capture; before
    that, Inductor's NotImplementedError on the reader node, and eager from then on.)"""
    import copy
    import math
    import stepgraph
    from stepgraph.errors import StepGraphError
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    twin = copy.deepcopy(model)

    def make(m, opt):
        def step(it, x, y):
            for g in opt.param_groups:
                g["lr"] = 1e-3 * 0.5 * (1 + math.cos(math.pi * it / 10))
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    opt, topt = (torch.optim.SGD(p, lr=1e-3) for p in (model.parameters(), twin.parameters()))
    sg, eager = stepgraph.compile(make(model, opt), backend="inductor"), make(twin, topt)
    refused = []
    for it in range(8):
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        try:
            sg(it, x, y)
        except StepGraphError as e:
            refused.append((it, str(e)))
        eager(it, x, y)
        assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(model.parameters(), twin.parameters())), it
    assert not refused, refused
    # (the lr baked, then read live from the param group, then the number computed from ``it``
    # read live too: two recaptures, then replays)
    assert sg.stats.captures <= 3 and sg.stats.replays >= 4, sg.stats


def test_inductor_background_compile_in_parts_matches_eager(monkeypatch):
    """STEPGRAPH_INDUCTOR_PARTS=3: the lifted step is cut into parts compiled in child processes
    side by side (backends/partition.py); the fused step calls them in order. Its results are
    the whole graph's, within fusion's tolerance, and the check at the switch passes."""
    import stepgraph
    from stepgraph.backends import partition
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_PARTS", "3")
    case, step, twin, eager = _mlp_with_twin()
    sg = stepgraph.compile(step, backend="inductor")
    for i in range(3):
        b = case.make_batch(i)
        assert torch.equal(sg(*b), eager(*b))
    job = sg.captures[0].run.job
    assert isinstance(job, partition.PartsCompile) and len(job.jobs) == 3, type(job)
    assert sg.wait_compiled(), sg.explain()
    for i in range(3, 8):
        b = case.make_batch(i)
        torch.testing.assert_close(sg(*b), eager(*b), rtol=2e-5, atol=1e-6)
    for p, p2 in zip(case.model.parameters(), twin.model.parameters()):
        torch.testing.assert_close(p, p2, rtol=2e-5, atol=1e-6)
    assert sg.stats.fused_parity and not sg.stats.fused_parity[0].diverged, sg.explain()


def test_partition_cuts_where_few_bytes_cross_and_parts_rebuild_the_graph():
    """The parts, run one after another through the replay backend, compute what the whole
    graph does; every cut leaves only tensors crossing, and the parts are near equal."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from stepgraph.backends import partition

    def f(x, w):
        for _ in range(12):
            x = torch.tanh(x @ w) + x.sum(0)
        w.add_(x.mean())   # (a write into an input, in the last part)
        return x.relu(), x.shape[0] * 2

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    gm = make_fx(f)(x, w.clone())
    parts = partition.split(gm, 3)
    assert parts is not None and len(parts) == 3
    sizes = [sum(n.op == "call_function" for n in p.gm.graph.nodes) for p in parts]
    assert max(sizes) <= 2 * min(sizes), sizes
    w1, w2 = w.clone(), w.clone()
    want = gm(x, w1)
    got = partition.chain(gm, parts, [p.gm for p in parts])(x, w2)
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and torch.equal(w1, w2)


def test_partition_never_cuts_where_a_view_of_written_memory_crosses():
    """A part compiles its inputs as unaliased: a view of an input the graph writes, live across
    a cut, would be read by the next part before that part's write lands. No cut there."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from stepgraph.backends import partition

    def f(x, w):
        v = w.t()   # live to the end, and w is written before its last use
        for _ in range(12):
            x = torch.tanh(x @ v) + 1
        w.mul_(0.5)
        return x + v.sum()

    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4))
    assert partition.cuts(gm, 3) == [] and partition.split(gm, 3) is None


def test_parts_compiling_side_by_side_split_the_hosts_compile_workers(monkeypatch):
    """Each compile process warms one Inductor compile worker per core: children that compile
    parts side by side share the cores instead (a user's TORCHINDUCTOR_COMPILE_THREADS stands)."""
    import shutil
    from stepgraph.backends import background
    seen = []

    class Proc:
        pid = 0

        def __init__(self, *a, env=None, **k):
            seen.append(env)
    monkeypatch.setattr(background.subprocess, "Popen", Proc)
    monkeypatch.setattr(background.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    for share in (4, 1):
        shutil.rmtree(background._spawn(False, share=share)[1])
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")
    shutil.rmtree(background._spawn(False, share=4)[1])
    assert seen[0]["TORCHINDUCTOR_COMPILE_THREADS"] == "4"
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in seen[1] and seen[2]["TORCHINDUCTOR_COMPILE_THREADS"] == "2"
