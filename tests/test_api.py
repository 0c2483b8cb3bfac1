"""The public API contract: decorator forms, nested inputs/outputs, kwargs, graph, explain."""
import copy

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
