"""A CUDA step refused for work on CPU tensors before its backward (DETR's Hungarian matcher:
``C.cpu().split(sizes)`` then scipy) is refused at that op: the call is undone and rerun
eagerly, so it holds eager's numbers. Refused at the trace's end, the call kept the trace's
result, and DETR's zero-gradient key biases (Adam's steps of sign(noise)) ended 2.9e-3 from
eager's on an H200 (the GPU corpus's one WRONG, sessions 17-25)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import stepgraph
from stepgraph import CaptureError
from stepgraph.optimizers import same_form

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _make(model, opt, after_backward=False):
    def step(x, y):
        out = model(x)
        if not after_backward:
            c = out.detach().cpu()
            picks = [int(part.argmax()) for part in c.split([4, 4])]   # (a matcher on the host)
            y = y[torch.as_tensor(picks, device="cuda")]
        loss = F.mse_loss(out[:2], y[:2])
        loss.backward()
        if after_backward:
            [part.sum() for part in out.detach().cpu().split([4, 4])]
        opt.step()
        opt.zero_grad()
        return loss
    return step


@pytest.mark.parametrize("after_backward", [False, True])
def test_refused_before_backward_holds_eagers_numbers(after_backward):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).cuda()
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.AdamW(m.parameters(), lr=1e-3), torch.optim.AdamW(m2.parameters(), lr=1e-3)
    step, eager = stepgraph.compile(_make(m, o, after_backward)), _make(m2, o2, after_backward)
    g = torch.Generator(device="cuda").manual_seed(1)
    x0 = torch.randn(8, 8, device="cuda", generator=g)
    y0 = torch.randn(3, 3, device="cuda", generator=g)
    step(x0, y0), eager(x0, y0)
    same_form(o2)   # (stepgraph's form from its capturing call on: the corpus's reference)
    with pytest.raises(CaptureError, match="runs on CPU tensors inside a CUDA step") as err:
        step(x0 * 2, y0)
    eager(x0 * 2, y0)
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert ("ran eagerly from its start" in notes) is not after_backward, notes
    if not after_backward:   # (after a backward the trace's own result is kept, as before)
        for p, q in zip(m.parameters(), m2.parameters()):
            assert torch.equal(p, q)
        for a, b in zip(o.state.values(), o2.state.values()):
            assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))
