"""The public API contract: decorator forms, nested inputs/outputs, kwargs, graph, explain."""
import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def test_decorator_forms_and_public_names():
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    @stepgraph.compile
    def a(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    @stepgraph.compile(backend="replay", warmup=2, max_captures=3)
    def b(x, y):
        return F.cross_entropy(m(x), y).detach()

    for i in range(4):
        a(*_batch(i))
        b(*_batch(i))
    assert isinstance(a, stepgraph.StepFunction)
    assert (a.stats.eager_calls, a.stats.captures, a.stats.replays) == (1, 1, 2)
    assert (b.stats.eager_calls, b.stats.captures, b.stats.replays) == (2, 1, 1)
    assert isinstance(a.stats.recaptures, list)
    assert issubclass(stepgraph.CaptureError, stepgraph.StepGraphError)
    assert isinstance(a.graph, torch.fx.GraphModule) and "aten" in a.graph.code
    text = a.explain()
    for needle in ("m.0.weight", "opt.state[m.0.weight]['exp_avg']", "guards", "state written"):
        assert needle in text, needle
    a.reset()
    assert a.graph is None and a.stats.captures == 0


class _Trainer:
    """A trainer whose step is decorated in the class body (``@stepgraph.compile`` on a method)."""

    def __init__(self):
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def plain_step(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    step = stepgraph.compile(plain_step)


def test_a_method_decorated_in_the_class_body_gets_a_step_function_per_instance():
    """``self`` was never bound: the user's method raised "missing 1 required positional
    argument"; two instances must not share graphs (each holds its own model)."""
    a, b, twin = _Trainer(), _Trainer(), _Trainer()
    b.model[0].weight.data.mul_(2)
    twin_b = copy.deepcopy(b)
    for i in range(4):
        assert torch.equal(a.step(*_batch(i)), twin.plain_step(*_batch(i)))
        assert torch.equal(b.step(*_batch(i)), twin_b.plain_step(*_batch(i)))
    assert a.step is not b.step and a.step is a.step and _Trainer.step is not a.step
    assert (a.step.stats.captures, a.step.stats.replays) == (1, 2) == (b.step.stats.captures, b.step.stats.replays)
    for p, q in zip(b.model.parameters(), twin_b.model.parameters()):
        assert torch.equal(p, q)


def test_a_partial_or_a_callable_object_compiles_and_a_generator_is_refused():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(scale, x, y):
        loss = F.cross_entropy(m(x), y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    class Step:
        def __call__(self, x, y):
            return step(1.0, x, y)
    for fn, name in ((functools.partial(step, 0.5), "step"), (Step(), "Step")):
        f = stepgraph.compile(fn)
        for i in range(3):
            f(*_batch(i))
        assert f.__name__ == name and f.stats.replays == 1

    def gen_step(x, y):
        yield step(1.0, x, y)
    with pytest.raises(stepgraph.StepGraphError, match="generator or async function"):
        stepgraph.compile(gen_step)


def test_nested_inputs_outputs_and_kwargs_match_eager():
    m, m2 = _model(), _model()
    opt, opt2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def mk(mm, o):
        def step(batch, *, weights, scale=1.0, tag="x"):
            x, y = batch["pair"]
            logits = mm(x)
            loss = (F.cross_entropy(logits, y, reduction="none") * weights[0]).mean() * scale
            loss.backward()
            o.step()
            o.zero_grad()
            return {"loss": loss, "stats": (logits.mean(), [logits.max(), tag]), "n": 3}
        return step
    sg, eager = stepgraph.compile(mk(m, opt)), mk(m2, opt2)
    for i in range(6):
        x, y = _batch(i)
        w = [torch.rand(8, generator=torch.Generator().manual_seed(50 + i))]
        batch = {"pair": (x, y)}
        out, ref = sg(batch, weights=w, scale=2.0), eager(batch, weights=w, scale=2.0)
        assert out["n"] == 3 and out["stats"][1][1] == "x"
        assert torch.equal(out["loss"], ref["loss"])
        assert torch.equal(out["stats"][0], ref["stats"][0]) and torch.equal(out["stats"][1][0], ref["stats"][1][0])
    assert sg.stats.captures == 1 and sg.stats.replays == 4
    out, ref = sg({"pair": _batch(9)}, weights=w, scale=3.0), eager({"pair": _batch(9)}, weights=w, scale=3.0)
    assert torch.equal(out["loss"], ref["loss"])  # a new non-tensor value: guarded, recaptured
    assert sg.stats.captures == 2 and "scale" in sg.stats.recaptures[0]
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kw", [dict(backend="nope"), dict(warmup=-1), dict(max_captures=0),
                                dict(on_capture_error="ignore")])
def test_bad_options_raise_stepgraph_error(kw):
    with pytest.raises(stepgraph.StepGraphError):
        stepgraph.compile(lambda x: x, **kw)


def test_replay_backend_on_explicit_request_and_cudagraph_refused_on_cpu():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    cg = stepgraph.compile(copy.copy(step), backend="cudagraph")
    cg(*_batch(0))
    with pytest.raises(stepgraph.StepGraphError, match="cpu"):
        cg(*_batch(1))


@pytest.mark.parametrize("families", ["foo", "mlp,foo", "mlp,", ""])
def test_demo_unknown_family_is_a_clear_usage_error(families, capsys):
    """`python -m stepgraph --families foo` ended in a KeyError traceback after the table header."""
    from stepgraph.tools import demo
    with pytest.raises(SystemExit) as e:
        demo.main(["--families", families, "--steps", "3"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out == "", "refused before anything runs or prints"
    assert "--families" in err and all(f in err for f in demo.FAMILIES), err
