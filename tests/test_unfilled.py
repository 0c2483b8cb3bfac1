"""A tensor an op fills behind the dispatcher (capture/unfilled.py): ``nn.CTCLoss`` with its
lengths as lists and ``reduction='mean'`` divides by ``at::tensor(target_lengths)``, whose values
ATen copies in with a memcpy no trace sees. Every replay divided by uninitialized memory: garbage
losses, trained on, silently (helper-90, session 36)."""
import pytest
import torch
from torch import nn

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("lengths", ["tuple", "list", "tensor"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ctc_loss_with_lengths_as_python_sequences_replays_eagers_loss(lengths, reduction):
    def run(compiled):
        torch.manual_seed(0)
        lin = nn.Linear(4, 5)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        ctc = nn.CTCLoss(zero_infinity=True, reduction=reduction)

        def step(x, targets, il, tl):
            loss = ctc(lin(x).log_softmax(-1), targets, il, tl)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        fn = stepgraph.compile(step) if compiled else step
        out = []
        for i in range(7):
            g = torch.Generator().manual_seed(i)
            x, targets = torch.randn(10, 2, 4, generator=g), torch.randint(1, 5, (2, 3), generator=g)
            il, tl = ((10, 8), (3, 3)) if i % 2 else ((10, 10), (3, 2))
            if lengths != "tuple":
                il, tl = (list(il), list(tl)) if lengths == "list" else (torch.tensor(il), torch.tensor(tl))
            out.append(fn(x, targets, il, tl))
        return fn, out, [p.detach().clone() for p in lin.parameters()]
    sg, got, params = run(True)
    _, want, want_params = run(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert sg.stats.replays >= 3, sg.stats
