"""A CUDA step that returns ``loss.detach().cpu()`` (or ``.cpu().numpy()``, DLRM's loop body):
the graph returns the device value and the runtime copies it to the host after each replay
(capture/tohost.py), instead of refusing the step."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

import stepgraph
from stepgraph.capture.tohost import to_host_outputs


def _graph(f):
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, device="cuda")
    gm = make_fx(f, tracing_mode="fake")(x)
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    return gm, [(n, f"problem {k}") for k, n in enumerate(copies)]


def test_a_returned_copy_leaves_the_graph():
    def f(x):
        y = x * 2
        return y.detach().cpu(), y.sum()
    gm, pending = _graph(f)
    positions, left = to_host_outputs(gm, pending, 2)
    assert positions == {0} and left == [] and "_to_copy" not in gm.code, gm.code


@pytest.mark.parametrize("use", ["used", "written", "cast", "not_user_output"])
def test_other_copies_stay_refused(use):
    def f(x):
        y = x * 2
        c = y.detach().to("cpu", torch.float64) if use == "cast" else y.detach().cpu()
        if use == "used":
            return c + 1, y
        if use == "written":
            y.add_(1)
        return c, y
    gm, pending = _graph(f)
    positions, left = to_host_outputs(gm, pending, 1 if use == "not_user_output" else 2)
    if use == "not_user_output":
        positions, left = to_host_outputs(*_graph(f), 0)
    assert positions == frozenset() and left == ["problem 0"], gm.code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["cudagraph", "inductor"])
@pytest.mark.parametrize("as_numpy", [False, True])
def test_cuda_step_returning_a_host_copy(backend, as_numpy):
    out = []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            E = model(x).pow(2).mean()
            L = E.detach().cpu()
            opt.zero_grad()
            E.backward()
            opt.step()
            return L.numpy() if as_numpy else L
        f = stepgraph.compile(step, backend=backend) if compiled else step
        g = torch.Generator("cuda").manual_seed(1)
        res = [f(torch.randn(4, 3, device="cuda", generator=g)) for _ in range(5)]
        out.append([torch.as_tensor(r).clone() for r in res])
        if compiled:
            assert f.stats.captures == 1 and f.stats.replays == 3, f.stats
            assert all(torch.as_tensor(r).device.type == "cpu" for r in res)
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)
