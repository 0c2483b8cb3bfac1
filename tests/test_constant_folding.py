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
