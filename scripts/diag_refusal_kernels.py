"""Which ops make a refused CUDA trace's state differ from eager's (detr)? Each case: a module's
train step that ends with CPU work on a device value (refused after the trace), vs eager."""
import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

import stepgraph


def cases():
    yield "linear+dropout", lambda: nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 16))
    yield "mha p=0", lambda: nn.MultiheadAttention(16, 2, dropout=0.0)
    yield "mha p=0.1", lambda: nn.MultiheadAttention(16, 2, dropout=0.1)
    yield "declayer p=0", lambda: nn.TransformerDecoderLayer(16, 2, 32, 0.0)
    yield "declayer p=0.1", lambda: nn.TransformerDecoderLayer(16, 2, 32, 0.1)


def run(name, make, refuse):
    torch.manual_seed(0)
    m = make().cuda()
    m2 = copy.deepcopy(m)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    from stepgraph.optimizers import same_form

    def body(model, opt, x):
        if isinstance(model, nn.MultiheadAttention):
            y = model(x, x, x)[0]
        elif isinstance(model, nn.TransformerDecoderLayer):
            y = model(x, x)
        else:
            y = model(x)
        loss = y.square().mean()
        if refuse:
            c = y.detach().cpu()
            _ = c.split([1, c.shape[-1] - 1], -1)   # CPU work on a device value: refused at the end
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    sg = stepgraph.compile(lambda x: body(m, o, x), on_capture_error="eager")
    out = []
    for i in range(3):
        g = torch.Generator(device="cuda").manual_seed(i)
        x = torch.randn(5, 3, 16, device="cuda", generator=g)
        if i == 1:
            same_form(o2)
        torch.manual_seed(100 + i)
        a = sg(x)
        torch.manual_seed(100 + i)
        b = body(m2, o2, x)
        d = max((p - q).abs().max().item() for p, q in zip(m.parameters(), m2.parameters()))
        out.append(f"call {i + 1}: loss equal {torch.equal(a, b)}, params max abs diff {d:.3e}")
    print(f"{name:18s} refuse={refuse}: " + "; ".join(out), flush=True)


import warnings
warnings.simplefilter("ignore")
for name, make in cases():
    for refuse in (True, False):
        try:
            run(name, make, refuse)
        except Exception as e:
            print(name, refuse, "ERROR", type(e).__name__, str(e)[:200])
