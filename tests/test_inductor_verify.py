"""The switch to a background-compiled Inductor graph proves itself (backends/verify.py), says
so on stderr or in the log (backends/progress.py), and does not stall the switching call.

Each test compares with an eager twin fed the same batches: bitwise up to the switch (the
unfused graph runs eager's kernels), within fp tolerance after it; a fused step that diverges
leaves the user's state bitwise equal to eager's.
"""
import logging
import os

import pytest
import torch

import stepgraph
from parity import rel_err
from stepgraph.tools import models

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = "cuda" if os.environ.get("STEPGRAPH_TEST_CUDA") and torch.cuda.is_available() else "cpu"
SMALL = {"mlp": dict(width=32, depth=3), "gpt": dict(layers=1, d=32, heads=2, vocab=64, seq=16)}


def _pair(family, bf16=False, sgd=False):
    """A stepgraph step and its eager twin: AdamW with weight decay (or SGD with momentum, whose
    traced update is eager's bitwise: AdamW's is its capturable form), optional bf16 autocast."""
    case = models.build(family, device=DEVICE, **SMALL[family])
    twin = case.fresh()

    def make(c):
        opt = (torch.optim.SGD(c.model.parameters(), lr=0.05, momentum=0.9) if sgd else
               torch.optim.AdamW(c.model.parameters(), lr=1e-3, weight_decay=0.1))

        def step(x, y):
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
                loss = c.loss_fn(c.model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step, opt
    (step, opt), (eager, opt2) = make(case), make(twin)
    return case, twin, stepgraph.compile(step, backend="inductor"), eager, opt, opt2


def _state(model, opt):
    return [p.detach().clone() for p in model.parameters()] + [
        v.detach().clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _run(case, sg, eager, steps=range(6), bitwise_until_switch=True):
    for i in steps:
        b = case.make_batch(i)
        fused = sg.captures[0].run.state == "fused" if sg.captures else False
        got, want = sg(*b), eager(*b)
        if bitwise_until_switch and not fused:
            assert torch.equal(got, want), f"step {i}: the unfused graph is eager's kernels"
        if i == 2:
            assert sg.wait_compiled() or sg.captures[0].run.state != "compiling"


@pytest.mark.parametrize("family,bf16", [("mlp", False), ("gpt", False), ("gpt", True)])
def test_switch_is_parity_checked(family, bf16, caplog):
    caplog.set_level(logging.INFO, logger="stepgraph")
    case, twin, sg, eager, opt, opt2 = _pair(family, bf16)
    _run(case, sg, eager, bitwise_until_switch=not bf16)  # (CPU bf16 autocast: not bitwise unfused either)
    run = sg.captures[0].run
    assert run.state == "fused", sg.explain()
    [p] = sg.stats.fused_parity
    assert p.diverged is None and p.error is None and p.compared > 0
    assert p.dtype == ("bfloat16" if bf16 else "float32") and p.max_rel <= p.tolerance
    print(f"{family} bf16={bf16}: {p.describe()}")
    assert "parity-checked against the unfused graph at the switch: max relative difference" in sg.explain()
    # Norm-relative, as tests/parity.py: GPT's key bias has a zero true gradient, whose rounding
    # noise Adam turns into lr-sized steps of either sign (no elementwise tolerance holds there).
    # With bf16 that noise compounds over the fused steps after the check (the qkv bias reached
    # 0.24 after 3): there, the matrices only.
    for a, b in zip(_state(case.model, opt), _state(twin.model, opt2)):
        if not bf16 or a.dim() >= 2:
            assert rel_err(a, b) <= p.tolerance, (a.shape, rel_err(a, b))
    text = caplog.text
    for phase in ("compiling the fused step with Inductor in the background", "fused step ready after",
                  "switched to the fused step at replay"):
        assert phase in text, (phase, text)


def _perturb_fused(monkeypatch, make_fault):
    """Wrap the fused runner (only it: the unfused graph is built elsewhere) with ``fault``."""
    from stepgraph.backends import inductor
    real = inductor._runner

    from stepgraph.backends.runner import Runner

    class Faulty(Runner):  # (every backend hands out Runners: backends/runner.py)
        def __init__(self, fn):
            self._fn = fn

        def __call__(self, inputs):
            return self._fn(inputs)

    def runner(compiled, state_in, cuda, opts, *unfused):
        run = real(compiled, state_in, cuda, opts, *unfused)
        return Faulty(make_fault(run))
    monkeypatch.setattr(inductor, "_runner", runner)


def test_injected_divergence_keeps_the_unfused_graph_and_names_the_tensor(monkeypatch):
    case, twin, sg, eager, opt, opt2 = _pair("mlp", sgd=True)
    weight = case.model.body[0].weight

    def fault(run):
        def bad(inputs):
            out = run(inputs)
            with torch.no_grad():
                weight.add_(0.5)  # a miscompiled update of one parameter
            return out
        return bad
    _perturb_fused(monkeypatch, fault)
    with pytest.warns(UserWarning, match=r"did not match the unfused graph: c\.model\.body\.0\.weight differs"):
        _run(case, sg, eager)
    run = sg.captures[0].run
    assert run.state == "diverged"
    [p] = sg.stats.fused_parity
    assert p.diverged == "c.model.body.0.weight" and p.max_rel > p.tolerance
    assert "DIVERGED first at c.model.body.0.weight: kept the unfused graph" in sg.explain()
    # Every step, the switching one included, ran eager's kernels on eager's state: bitwise.
    for a, b in zip(_state(case.model, opt), _state(twin.model, opt2)):
        assert torch.equal(a, b)


def test_a_fused_call_that_raises_keeps_the_unfused_graph(monkeypatch):
    case, twin, sg, eager, opt, opt2 = _pair("mlp", sgd=True)

    def fault(run):
        def bad(inputs):
            run(inputs)  # (it wrote half the state before failing)
            raise RuntimeError("injected failure of the first fused call")
        return bad
    _perturb_fused(monkeypatch, fault)
    with pytest.warns(UserWarning, match="its first call failed .*injected failure"):
        _run(case, sg, eager)
    assert sg.captures[0].run.state == "diverged"
    for a, b in zip(_state(case.model, opt), _state(twin.model, opt2)):
        assert torch.equal(a, b)


def test_check_and_progress_off(monkeypatch, capsys):
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_VERIFY", "0")
    monkeypatch.setenv("STEPGRAPH_PROGRESS", "0")
    from stepgraph.backends import progress
    monkeypatch.setattr(progress.log, "hasHandlers", lambda: False)  # as if logging were unconfigured
    case, twin, sg, eager, opt, opt2 = _pair("mlp")
    _run(case, sg, eager)
    assert sg.captures[0].run.state == "fused" and sg.stats.fused_parity == []
    assert "stepgraph:" not in capsys.readouterr().err


def test_progress_goes_to_stderr_when_logging_is_unconfigured(monkeypatch, capsys, caplog):
    from stepgraph.backends import progress
    monkeypatch.setattr(progress.log, "hasHandlers", lambda: False)
    progress.progress("stepgraph: fused step ready after %.1fs", 1.25)
    assert capsys.readouterr().err == "stepgraph: fused step ready after 1.2s\n"
    monkeypatch.setattr(progress.log, "hasHandlers", lambda: True)
    caplog.set_level(logging.INFO, logger="stepgraph")
    progress.progress("stepgraph: switched")
    assert capsys.readouterr().err == "" and "stepgraph: switched" in caplog.text
    monkeypatch.setenv("STEPGRAPH_PROGRESS", "0")
    progress.progress("stepgraph: quiet")
    assert "quiet" not in caplog.text


def test_switching_call_does_not_load_the_artifact():
    """The watcher thread loads the compiled artifact before the job counts as done: the call
    that switches only runs the fused step (and the check)."""
    case, twin, sg, eager, opt, opt2 = _pair("mlp")
    for i in range(3):
        sg(*case.make_batch(i))
    run = sg.captures[0].run
    job = run.job
    assert job.wait(600) and job._loaded is not None and job.ready_s >= job.exited_s > 0
    calls = []
    real = job.load
    job.load = lambda: calls.append(1) or real()
    sg(*case.make_batch(3))
    assert run.state == "fused" and calls == [1]
    assert run.switched_s >= run.compile_seconds == pytest.approx(job.ready_s)


def test_relative_difference_and_precision():
    from stepgraph.backends.verify import _lowest_precision, _rel
    a = torch.tensor([3.0, 4.0])
    assert _rel(a, a.clone()) == 0.0
    assert _rel(a + torch.tensor([0.0, 0.5]), a) == pytest.approx(0.5 / 5.0, rel=0.2)
    assert _rel(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")
    assert _rel(torch.tensor([1, 2]), torch.tensor([1, 3])) == float("inf")
    gm = torch.fx.symbolic_trace(lambda x: x.to(torch.bfloat16).float())
    assert _lowest_precision(gm, [torch.zeros(2)]) == torch.bfloat16


def test_random_draws_ignore_a_zero_dropout_probability():
    """SDPA's CPU/flash kernels are tagged as seeded for their dropout_p, even at 0: such a step
    is still checked; one with real dropout is not (Inductor draws its own random numbers)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from stepgraph.backends.verify import random_draws
    q = torch.randn(1, 2, 4, 8)

    def attn(p):
        return make_fx(lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=p))(q)
    assert random_draws(attn(0.0)) == 0
    assert random_draws(make_fx(lambda x: torch.nn.functional.dropout(x, 0.2))(q)) == 1


def test_dropout_is_checked_with_eager_random_numbers(monkeypatch):
    """With Inductor's fallback_random the fused step draws eager's dropout masks: the check
    runs both graphs from the same generator state, and the switching call consumes the
    generator as one eager step does. Without it, dropout steps are not checked (said)."""
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_PATCHES", '{"fallback_random": true}')
    case = models.build("gpt", device=DEVICE, dropout=0.1, **SMALL["gpt"])
    twin = case.fresh()
    opt = torch.optim.SGD(case.model.parameters(), lr=0.05, momentum=0.9)
    opt2 = torch.optim.SGD(twin.model.parameters(), lr=0.05, momentum=0.9)
    sg = stepgraph.compile(models.train_step(case.model, case.loss_fn, opt), backend="inductor")
    eager = models.train_step(twin.model, twin.loss_fn, opt2)
    for i in range(6):
        if i == 3:
            assert sg.wait_compiled()
        b = case.make_batch(i)
        torch.manual_seed(i)
        got = sg(*b)
        after = torch.get_rng_state()
        torch.manual_seed(i)
        want = eager(*b)
        assert torch.equal(after, torch.get_rng_state()), f"step {i}: one step's draws"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    [p] = sg.stats.fused_parity
    assert p.skipped is None and p.diverged is None and sg.captures[0].run.state == "fused", p
    for a, b in zip(case.model.parameters(), twin.model.parameters()):
        assert rel_err(a, b) <= p.tolerance


def _nan_fusion(monkeypatch, module):
    """Inductor's code made to return NaN in its first output: a fusion bug (lora_finetune's fused
    step on the CPU gave NaN from its first call)."""
    from fusion_bugs import nan_first_output
    monkeypatch.setattr(module, "_compile", nan_first_output(module._compile))


def _sliced_step(model, opt, read):
    """Inputs and targets sliced from one token buffer (llm.c's and LoRA's loaders): views of one
    storage, which the background compile cannot take -- compiled in-process. ``read``: the
    loss also returned as a Python float (a host read: the step is compiled as segments)."""
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return (loss.detach(), loss.item()) if read else loss.detach()
    return step


@pytest.mark.skipif(DEVICE != "cpu", reason="the in-process and segment checks run on the CPU")
@pytest.mark.parametrize("read", [False, True], ids=["in-process", "segment"])
def test_an_in_process_or_segment_compile_is_checked_at_its_first_call(monkeypatch, read):
    """A compile the background cannot take (inputs that are views of one buffer) and each fused
    segment of a step with a host read are checked at their first call as the switch is: a fused
    result with NaN keeps the unfused code (eager's kernels), warned, and the user's state stays
    eager's bitwise."""
    from stepgraph.backends import inductor, inductor_segments
    _nan_fusion(monkeypatch, inductor_segments if read else inductor)
    torch.manual_seed(0)
    mods = [torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Flatten(), torch.nn.Linear(32, 16))
            for _ in range(2)]
    mods[1].load_state_dict(mods[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in mods]
    sg = stepgraph.compile(_sliced_step(mods[0], opts[0], read), backend="inductor")
    eager = _sliced_step(mods[1], opts[1], read)
    g = torch.Generator().manual_seed(1)
    with pytest.warns(UserWarning, match="did not match"):
        for _ in range(5):
            buf = torch.randint(0, 16, (3, 5), generator=g)
            a, b = sg(buf[:, :4], buf[:, 4]), eager(buf[:, :4], buf[:, 4])
            assert torch.equal(a[0], b[0]) and a[1] == b[1] if read else torch.equal(a, b)
    assert sg.stats.replays == 3, sg.stats
    for p, q in zip(mods[0].parameters(), mods[1].parameters()):
        assert torch.equal(p, q)
