"""Probe (device): do masks drawn inside a stepgraph CUDA graph equal eager's under the same seed?"""
import copy, os, torch, torch.nn as nn, torch.nn.functional as F
import stepgraph
torch.manual_seed(0)
for kind in ["mlp", "lstm"]:
    if kind == "mlp":
        m = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.Linear(64, 5)).cuda()
    else:
        os.environ["STEPGRAPH_CUDNN_RNN"] = "decompose"
        m = nn.LSTM(16, 32, num_layers=2, dropout=0.3).cuda()
    t = copy.deepcopy(m)
    o = torch.optim.SGD(m.parameters(), lr=0.1); to = torch.optim.SGD(t.parameters(), lr=0.1)
    def body(mod, opt):
        def step(x):
            y = mod(x)
            y = y[0] if isinstance(y, tuple) else y
            loss = y.square().mean(); loss.backward(); opt.step(); opt.zero_grad(); return loss
        return step
    sg = stepgraph.compile(body(m, o), backend="cudagraph"); eg = body(t, to)
    def eg_nocudnn(x):
        with torch.backends.cudnn.flags(enabled=False):
            return eg(x)
    for k in range(5):
        x = torch.randn(7, 4, 16, device="cuda")
        torch.manual_seed(k); a = sg(x).item()
        torch.manual_seed(k); b = eg_nocudnn(x).item()
        print(kind, k, a, b, "EQ" if a == b else f"DIFF {abs(a-b)/abs(b):.2e}", stepgraph_stats := (sg.stats.eager_calls, sg.stats.captures, sg.stats.replays))
