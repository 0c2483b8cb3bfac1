"""Diagnostic (GPU): normalisation layers x train/eval switching x backends, stepgraph vs eager.
Prints the worst relative error of parameters and grads after a few steps per case."""
import sys
import torch
from torch import nn
import stepgraph

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def block(kind):
    if kind == "bn":
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, padding=2, dilation=2, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8), nn.ReLU(),
                         nn.ReflectionPad2d(1), nn.Conv2d(8, 8, 3), nn.InstanceNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def run(kind, switch, backend, compiled, opt_kind):
    torch.manual_seed(0)
    m = block(kind).to(DEV)
    opt = (torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.5, 0.999)) if opt_kind == "adam"
           else torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))

    def step(x, y):
        if switch == "inside":
            m.train()
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        return loss
    f = stepgraph.compile(step, backend=backend) if compiled else step
    g = torch.Generator(DEV).manual_seed(1)
    for k in range(6):
        x, y = torch.randn(4, 3, 16, 16, device=DEV, generator=g), torch.randn(4, 4, device=DEV, generator=g)
        f(x, y)
        if switch in ("inside", "outside"):
            m.eval()
            with torch.no_grad():
                m(x)
            if switch == "outside":
                m.train()
    if DEV == "cuda":
        torch.cuda.synchronize()
    out = {n: p.detach().clone() for n, p in m.named_parameters()}
    out.update({n + ".grad": p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None})
    out.update({n: b.detach().clone() for n, b in m.named_buffers()})
    return out, getattr(f, "stats", None)


def rel(a, b):
    return ((a - b).double().norm() / b.double().norm().clamp_min(1e-12)).item()


def main():
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    for cudnn in (True, False):
        torch.backends.cudnn.enabled = cudnn
        for kind in ("bn", "in"):
            for switch in ("none", "outside", "inside"):
                for opt_kind in ("sgd", "adam"):
                    want, _ = run(kind, switch, None, False, opt_kind)
                    for backend in ("replay", "cudagraph"):
                        try:
                            got, st = run(kind, switch, backend, True, opt_kind)
                        except Exception as e:
                            print(f"cudnn={cudnn} {kind} {switch} {opt_kind} {backend}: {type(e).__name__} {str(e)[:200]}", flush=True)
                            continue
                        worst = max((rel(got[k], want[k]), k) for k in want if k in got and want[k].is_floating_point())
                        print(f"cudnn={cudnn} {kind} {switch:<8} {opt_kind} {backend:<9}: worst {worst[0]:.2e} at {worst[1]}"
                              f"  captures={st.captures} replays={st.replays}", flush=True)


if __name__ == "__main__":
    main()
