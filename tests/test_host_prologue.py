"""CPU work a CUDA step does on host values only (``torch.randint(1, T, (n,)).to(device)``, a
DDPM's timesteps): run before the graph at each call, as eager runs it, instead of refused
(passes/host_prologue.py). The split itself is checked here on the CPU; the step on CUDA."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import stepgraph
from stepgraph.errors import NeedsReplay
from stepgraph.passes.host_prologue import split_prologue


def _traced(fn, *example, host=("randint", "_to_copy", "mul")):
    gm = make_fx(fn, tracing_mode="real")(*example)
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(h in str(n.target) for h in host):
            n.meta["stepgraph_host"] = True
    return gm


def test_host_nodes_become_a_prologue_whose_results_the_graph_reads():
    def f(x, k):
        t = torch.randint(1, 10, (4,)) * k
        return x + t.to(torch.float32), t

    x, k = torch.randn(4), torch.tensor(3)
    gm = _traced(f, x, k)
    example = [x, k]
    pro = split_prologue(gm, example)
    assert pro is not None and pro.reads == (1,) and pro.n_outputs == 2, gm.code
    assert len(example) == 4 and all(not ("randint" in str(n.target)) for n in gm.graph.nodes)
    torch.manual_seed(5)
    want = f(x, k)
    torch.manual_seed(5)
    got = gm(x, k, *pro([x, k]))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_host_node_fed_by_the_graph_is_no_prologue():
    def f(x):
        y = x * 2
        return y.to(torch.float64)

    gm = _traced(f, torch.randn(3), host=("_to_copy",))
    with pytest.raises(NeedsReplay, match="computes on the CPU"):
        split_prologue(gm, [torch.randn(3)])


def test_a_host_value_the_step_also_writes_stays_in_the_graph():
    """An optimizer's CPU step counter (Adagrad on CUDA): read after the graph's in-place
    increment, so hoisting the read would read the old count."""
    def f(x, step):
        step.add_(1)
        return x * (step * 2).to(torch.float32)

    gm = _traced(f, torch.randn(3), torch.tensor(0.0), host=("mul.Tensor", "_to_copy"))
    with pytest.raises(NeedsReplay, match="computes on the CPU"):
        split_prologue(gm, [torch.randn(3), torch.tensor(0.0)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["cudagraph", "inductor"])
def test_cpu_random_timesteps_moved_to_the_gpu_in_the_step(backend):
    """TeaPearce's DDPM (clients/ddpm.py): ``_ts = torch.randint(1, n_T + 1, (n,)).to(device)``,
    then ``sqrtab[_ts]`` on the GPU. Each replay draws its own timesteps from the CPU generator,
    as eager does: the losses equal eager's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(9, 32), nn.ReLU(), nn.Linear(32, 8)).cuda()
    ref = nn.Sequential(nn.Linear(9, 32), nn.ReLU(), nn.Linear(32, 8)).cuda()
    ref.load_state_dict(net.state_dict())
    sched = torch.linspace(0.1, 0.9, 101, device="cuda")

    def make(m, opt):
        def step(x):
            ts = torch.randint(1, 101, (x.shape[0],)).to("cuda")
            noise = torch.randn_like(x)
            xt = sched[ts, None] * x + (1 - sched[ts, None]) * noise
            loss = F.mse_loss(noise, m(torch.cat([xt, (ts / 100.0)[:, None]], 1)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach(), ts
        return step
    sg = stepgraph.compile(make(net, torch.optim.SGD(net.parameters(), lr=0.1)), backend=backend)
    eager = make(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    seen = set()
    for k in range(6):
        x = torch.randn(16, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(k))
        torch.manual_seed(100 + k)
        torch.cuda.manual_seed(100 + k)
        got, ts = sg(x)
        torch.manual_seed(100 + k)
        torch.cuda.manual_seed(100 + k)
        want, wts = eager(x)
        assert torch.equal(ts, wts), (ts, wts)
        seen.add(tuple(ts.tolist()))
        if backend == "cudagraph":
            torch.testing.assert_close(got, want)
    assert len(seen) == 6 and sg.stats.replays >= 3, sg.stats
    assert "CPU work run before the graph at each call" in sg.explain() and "randint" in sg.explain()
