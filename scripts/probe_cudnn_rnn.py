"""Diagnostic (issue item 4): what make_fx meets tracing cuDNN's LSTM directly, and the time of
eager cuDNN vs the captured decomposition for the word_language_model configuration."""
import time
import traceback

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import stepgraph

lstm = torch.nn.LSTM(32, 32, num_layers=2).cuda()
x = torch.randn(12, 4, 32, device="cuda")
try:
    make_fx(lambda x: torch.autograd.grad(lstm(x)[0].sum(), list(lstm.parameters())), tracing_mode="real",
            _allow_non_fake_inputs=True)(x)
    print("route (a): make_fx traced cuDNN's LSTM")
except Exception as e:
    tb = traceback.extract_tb(e.__traceback__)
    print("route (a):", type(e).__name__, str(e)[:200], "| at", [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in tb[-3:]])


def bench(big):
    torch.manual_seed(0)
    n, T, B = (650, 35, 20) if big else (32, 12, 4)
    m = torch.nn.LSTM(n, n, num_layers=2).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        loss = m(x)[0].pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    x = torch.randn(T, B, n, device="cuda")
    out = []
    for name, f in (("eager", step), ("stepgraph", stepgraph.compile(step))):
        for _ in range(5):
            f(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            f(x)
        torch.cuda.synchronize()
        out.append(f"{name} {(time.perf_counter() - t) / 50 * 1e3:.2f} ms")
    print(f"LSTM 2x{n}, T={T}, B={B}:", ", ".join(out))


bench(False)
bench(True)
