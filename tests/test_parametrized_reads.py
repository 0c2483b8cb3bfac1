"""A step whose own code reads a weight that ``torch.nn.utils.parametrize`` computes
(parametrizations.orthogonal / weight_norm / spectral_norm: an orthogonality penalty on
``fc.weight``, the weight returned for logging). The attribute is a property that builds a new
tensor at each read: stepgraph's scan of the step's Python values read it, keyed a new tensor
at each read and refused the step as "rebinds m[0].weight to another tensor"; and each of its
reads ran the parametrization, so spectral_norm's power iteration advanced ``_u``/``_v`` beyond
eager's from the warm-up call on (the refused call's state was not eager's). Probe:
/work/repros/s26_probeB/orth_weight_read.py, sn_weight_read_side_effect.py."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrizations as P

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(kind, compiled, calls=6):
    torch.manual_seed(0)
    m = torch.nn.Sequential(getattr(P, kind)(torch.nn.Linear(6, 6)), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)

    def step(x, y):
        w = m[0].weight
        loss = F.cross_entropy(m(x), y) + 1e-2 * (w @ m[0].weight.T - torch.eye(6)).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), m[0].weight.detach()
    fn = stepgraph.compile(step) if compiled else step
    g = torch.Generator().manual_seed(1)
    outs = [fn(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(calls)]
    return m, opt, outs, fn


@pytest.mark.parametrize("kind", ["orthogonal", "weight_norm", "spectral_norm"])
def test_a_parametrized_weight_the_step_reads_replays_equal_to_eager(kind):
    want_m, want_opt, want, _ = _run(kind, False)
    got_m, got_opt, got, fn = _run(kind, True)
    assert fn.stats.captures == 1 and fn.stats.replays == 4, fn.stats
    for (a, wa), (b, wb) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(wa, wb)
    for (n, a), (_, b) in zip(got_m.state_dict().items(), want_m.state_dict().items()):
        assert torch.equal(a, b), n   # (spectral_norm's _u, _v: no power iteration of stepgraph's)
    for p, q in zip(got_m.parameters(), want_m.parameters()):
        assert torch.equal(got_opt.state[p]["exp_avg_sq"], want_opt.state[q]["exp_avg_sq"])
