"""CPU tensors the step builds from constants only (``torch.tensor([crop.shape[-1] for crop in
x])`` and what is computed from it: DINO's MultiCropWrapper runs ``unique_consecutive`` and
``cumsum`` on it and slices its batch with the results) are folded while tracing: values the
capture proved constant (the shapes are in the guard signature), not graph work. Before, a CUDA
step refused them as "CPU work in a CUDA step", and a CPU step carried host-read guards."""
import pytest
import torch
from torch import nn

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class MultiCrop(nn.Module):
    """DINO's utils.MultiCropWrapper: the backbone once per run of same-size crops."""

    def __init__(self, dev):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten()).to(dev)
        self.head = nn.Linear(4, 5).to(dev)

    def forward(self, x):
        sizes = torch.tensor([crop.shape[-1] for crop in x])
        ends = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start, feats = 0, torch.empty(0).to(x[0].device)
        for end in ends:
            feats = torch.cat((feats, self.backbone(torch.cat(x[start:end]))))
            start = end
        return self.head(feats)


def _run(dev, **kw):
    out = []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = MultiCrop(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(crops):
            loss = model(crops).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        f = stepgraph.compile(step, **kw) if compiled else step
        losses = []
        for k in range(5):
            g = torch.Generator().manual_seed(k)
            crops = [torch.randn(2, 3, 8, 8, generator=g).to(dev) for _ in range(2)] + \
                    [torch.randn(2, 3, 4, 4, generator=g).to(dev) for _ in range(3)]
            losses.append(f(crops).detach().cpu())
        out.append((losses, [p.detach().cpu().clone() for p in model.parameters()], f))
    (sl, sp, f), (el, ep, _) = out
    for a, b in zip(sl + sp, el + ep):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return f


def test_constant_cpu_computation_is_folded():
    f = _run("cpu")
    assert f.stats.captures == 1 and f.stats.replays == 3, f.stats
    code = f.graph.code if hasattr(f.graph, "code") else str(f.graph)
    assert "unique_consecutive" not in code and "cumsum" not in code, code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["cudagraph", "inductor"])
def test_multicrop_wrapper_on_cuda(backend):
    f = _run("cuda", backend=backend)
    assert f.stats.captures == 1 and f.stats.replays == 3, f.stats
    assert f.stats.fallbacks == 0 if hasattr(f.stats, "fallbacks") else True


def test_cpu_constant_index_of_a_device_tensor_moves_to_the_device():
    """DLRM's dot interaction: ``Z[:, li, lj]`` with ``li = torch.tensor([...])`` built on the
    CPU. Eager moves the indices at each call; the graph holds them on the device once."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from stepgraph.passes.moved_arguments import constants_to_device

    def f(z):
        li = torch.tensor([i for i in range(3) for j in range(i)])
        lj = torch.tensor([j for i in range(3) for j in range(i)])
        return z[:, li, lj] * 2

    gm = make_fx(f, tracing_mode="fake")(torch.empty(2, 3, 3, device="meta"))
    moved = constants_to_device(gm)
    assert moved == 2, gm.code
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            assert getattr(gm, n.target).device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["cudagraph", "inductor"])
def test_dlrm_interaction_on_cuda(backend):
    torch.manual_seed(0)
    out = []
    for compiled in (True, False):
        torch.manual_seed(0)
        emb = nn.Linear(4, 12).cuda()
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)

        def step(x):
            z = emb(x).view(-1, 3, 4)
            zz = torch.bmm(z, z.transpose(1, 2))
            li = torch.tensor([i for i in range(3) for j in range(i)])
            lj = torch.tensor([j for i in range(3) for j in range(i)])
            loss = zz[:, li, lj].pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        f = stepgraph.compile(step, backend=backend) if compiled else step
        out.append([f(torch.randn(5, 4, device="cuda", generator=torch.Generator("cuda").manual_seed(k))).item()
                    for k in range(5)])
        if compiled:
            assert f.stats.captures == 1 and f.stats.replays == 3, f.stats
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)


def test_an_in_place_write_into_a_folded_tensor_is_refused():
    """A folded result is a graph constant: an in-place write of step values into it would
    accumulate over replays (eager makes it afresh each call). Refused at its line."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @stepgraph.compile
    def step(x):
        base = torch.tensor([1.0, 2.0]).cumsum(0)
        base.add_(model(x).sum(0).detach())
        loss = (model(x) * base).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    step(torch.randn(3, 2))
    with pytest.raises(stepgraph.CaptureError, match="built from constants"):
        step(torch.randn(3, 2))


def test_numbers_given_to_a_tensor_op_are_folded():
    """Longformer's ``_chunk``: ``h.view(b, torch.div(h.size(1), 2 * w, rounding_mode="trunc"),
    ...)``. The sizes are Python ints, wrapped into tensors by torch, and the view reads the
    result back: refused as a host sync the user could not move ("return the tensor from the
    step"). Folded, it is the constant the trace would have baked."""
    out = []
    for compiled in (True, False):
        torch.manual_seed(0)
        lin = nn.Linear(8, 8)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)

        def step(x):
            h = lin(x)
            h = h.view(h.size(0), torch.div(h.size(1), 2, rounding_mode="trunc"), 2, h.size(2))
            loss = (h[:, :, 0] * h[:, :, 1]).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        f = stepgraph.compile(step) if compiled else step
        g = torch.Generator().manual_seed(0)
        out.append(([f(torch.randn(2, 6, 8, generator=g)).detach() for _ in range(4)], list(lin.parameters()), f))
    (sl, sp, f), (el, ep, _) = out
    assert all(torch.equal(a, b) for a, b in zip(sl + sp, el + ep))
    assert (f.stats.captures, f.stats.replays) == (1, 2), f.stats


def test_a_constant_a_traced_op_wrote_into_is_not_folded_after():
    """pytorch_optimizer's DAdaptSGD: ``sk_sq = torch.tensor([0.0])``, ``sk_sq.add_(s.pow(2).sum())``,
    then ``d_hat = numerator / sk_sq.sqrt()``. The sqrt was folded with the capture's sum: every
    replay divided by it (d grew where eager's stayed). A constant a traced op wrote into is a step
    value from then on."""
    def make():
        torch.manual_seed(0)
        m = nn.Linear(4, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        state = {"scale": []}

        def step(x):
            loss = m(x).square().mean()
            loss.backward()
            acc = torch.tensor([0.0])
            for p in m.parameters():
                acc.add_(p.grad.pow(2).sum())
            norm = acc.sqrt()
            for p in m.parameters():
                p.grad.div_(norm + 1.0)
            opt.step()
            opt.zero_grad()
            return loss.detach(), norm
        return step, m
    (f, m1), (g, m2) = make(), make()
    f = stepgraph.compile(f)
    for k in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        (a, na), (b, nb) = f(x), g(x)
        assert torch.equal(a, b) and torch.equal(na, nb), k
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert f.stats.replays == 3, f.stats
