"""Partial capture (stepgraph.graph_module): graphed modules inside steps that stay eager."""
import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph
from stepgraph import CaptureError, StepGraphError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class MLP(nn.Module):
    def __init__(self, d=16, h=32, p=0.1):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, h), nn.Linear(h, d), nn.Dropout(p)

    def forward(self, x):
        return x + self.fc2(self.drop(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """A pre-norm transformer block: LayerNorm, SDPA attention, dropout, MLP."""

    def __init__(self, d=16, heads=2, p=0.1):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp, self.heads, self.p = MLP(d, 2 * d, p), heads, p

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, d)), self.p, self.training)
        return self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, vocab=23, d=16):
        super().__init__()
        self.emb, self.mlp, self.block = nn.Embedding(vocab, d), MLP(d), Block(d)
        self.enc = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.enc(self.block(self.mlp(self.emb(idx)))))


def _step(model, opt, idx, y, log):
    loss = F.cross_entropy(model(idx).flatten(0, 1), y.flatten())
    log.append(loss.item())                      # host sync for logging: fine outside graphs
    if loss.item() > 100:                        # data-dependent Python: fine outside graphs
        loss = loss * 0.0
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return grads


def test_parity_mlp_and_transformer_blocks_in_an_eager_step():
    torch.manual_seed(0)
    eager = Net()
    graphed = copy.deepcopy(eager)
    stepgraph.graph_module(graphed.mlp)                    # patched in place
    graphed.block = stepgraph.graph_module(graphed.block)  # or swapped for the wrapper
    g_enc = stepgraph.graph_module(graphed.enc)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    logs = ([], [])
    for i in range(7):
        idx, y = torch.randint(0, 23, (3, 6)), torch.randint(0, 23, (3, 6))
        grads = []
        for m, opt, log in zip((eager, graphed), opts, logs):
            torch.manual_seed(100 + i)                    # same dropout masks in both
            grads.append(_step(m, opt, idx, y, log))
        assert all(torch.equal(a, b) for a, b in zip(*grads)), f"grads differ at step {i}"
    assert logs[0] == logs[1]
    for a, b in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(a, b)
    for pa, pb in zip(eager.parameters(), graphed.parameters()):
        sa, sb = opts[0].state[pa], opts[1].state[pb]
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    for gm in (graphed.mlp._stepgraph_partial, graphed.block, g_enc):
        assert (gm.stats.eager_calls, gm.stats.captures, gm.stats.replays) == (1, 1, 5)
        assert gm.stats.recaptures == []


def test_module_hooks_before_and_after_graphing_run_every_call():
    torch.manual_seed(1)
    mods = [MLP(p=0.0), None]
    mods[1] = copy.deepcopy(mods[0])
    counts = [Counter(), Counter()]

    def hooks(c):
        return (lambda m, args: (c.update(["pre"]), (args[0] * 1.5,))[1],
                lambda m, args, out: (c.update(["fwd"]), out * 2)[1],
                lambda m, gin, gout: (c.update(["bwd"]), (gin[0] * 0.5,))[1],
                lambda g: (c.update(["param"]), g * 0.25)[1],
                lambda p: c.update(["post_acc"]))
    for m, c in zip(mods, counts):
        pre, fwd, bwd, ph, post = hooks(c)
        m.register_forward_pre_hook(pre)
        m.fc1.weight.register_hook(ph)
    gm = stepgraph.graph_module(mods[1])
    for m, c in zip(mods, counts):   # registered after graphing
        pre, fwd, bwd, ph, post = hooks(c)
        m.register_forward_hook(fwd)
        m.register_full_backward_hook(bwd)
        m.fc2.bias.register_post_accumulate_grad_hook(post)
    for i in range(5):
        x = torch.randn(4, 16)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        outs = [mods[0](xs[0]), gm(xs[1])]
        assert torch.equal(outs[0], outs[1])
        for o in outs:
            (o * o).sum().backward()
        assert torch.equal(xs[0].grad, xs[1].grad)
    for a, b in zip(mods[0].parameters(), mods[1].parameters()):
        assert torch.equal(a.grad, b.grad)
    assert counts[0] == counts[1] == Counter(pre=5, fwd=5, bwd=5, param=5, post_acc=5)
    assert gm.stats.replays == 3


def test_submodule_hooks_run_at_every_call():
    """(Hooks inside a graphed module: tests/test_partial_hooks.py.)"""
    m = MLP(p=0.0)
    calls = []
    m.fc1.register_forward_hook(lambda mod, a, o: calls.append(type(o)))
    gm = stepgraph.graph_module(m)
    for _ in range(4):
        gm(torch.randn(2, 16))
    assert calls == [torch.Tensor] * 4 and gm.stats.replays == 2


class KW(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, mask=None, scale=1.0, flag=False, tag="a"):
        h = self.lin(x)
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        if flag:
            h = h * scale
        return {"out": h, "stats": (h.detach().mean(), h.argmax(-1)), "tag": tag}


def test_kwargs_non_tensor_args_nested_outputs_and_recapture_reasons():
    torch.manual_seed(2)
    eager = KW()
    gm = stepgraph.graph_module(copy.deepcopy(eager))
    mask = torch.rand(4, 8) > 0.5
    calls = [dict(flag=True, scale=2.0)] * 3 + [dict(flag=False, scale=2.0)] * 2 + [dict(flag=True, scale=3.0)] * 2
    for kw in calls:
        x = torch.randn(4, 8)
        a, b = eager(x, mask=mask, **kw), gm(x, mask=mask, **kw)
        assert torch.equal(a["out"], b["out"]) and torch.equal(a["stats"][1], b["stats"][1])
        assert b["tag"] == "a" and b["out"].requires_grad
        assert not b["stats"][0].requires_grad and not b["stats"][1].requires_grad
        b["out"].sum().backward()
        a["out"].sum().backward()
    for p, q in zip(eager.parameters(), gm.parameters()):
        assert torch.equal(p.grad, q.grad)
    s = gm.stats
    assert (s.eager_calls, s.captures, s.replays) == (1, 3, 3)
    assert s.recaptures == ["kwargs['flag']: value True -> False",
                            "kwargs['flag']: value False -> True; kwargs['scale']: value 2.0 -> 3.0"]


def test_inputs_with_and_without_grad_and_outputs_without_grad():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, a, b):
            h = torch.tanh(a @ self.w) * b
            return h, (h > 0).float(), a.detach() * 2
    torch.manual_seed(3)
    eager = Two()
    gm = stepgraph.graph_module(copy.deepcopy(eager))
    for _ in range(4):
        a, b = torch.randn(3, 8), torch.randn(3, 8)
        ga, gb = a.clone().requires_grad_(), b.clone()   # one input requires grad, one does not
        ea = a.clone().requires_grad_()
        out_g, out_e = gm(ga, gb), eager(ea, b)
        assert out_g[0].requires_grad and not out_g[1].requires_grad and not out_g[2].requires_grad
        assert all(torch.equal(x, y) for x, y in zip(out_g, out_e))
        out_g[0].pow(2).sum().backward()
        out_e[0].pow(2).sum().backward()
        assert torch.equal(ga.grad, ea.grad) and gb.grad is None
    assert torch.equal(gm.module.w.grad, eager.w.grad)
    assert gm.stats.replays == 2


def test_recapture_on_shape_grad_mode_and_eval_and_max_captures():
    torch.manual_seed(4)
    m = MLP()
    gm = stepgraph.graph_module(m, max_captures=4)
    gm(torch.randn(4, 16))
    gm(torch.randn(4, 16))
    gm(torch.randn(6, 16)).sum().backward()
    with torch.no_grad():
        out = gm(torch.randn(6, 16))
        assert not out.requires_grad
        gm(torch.randn(6, 16))
    m.eval()
    x = torch.randn(6, 16)
    assert torch.equal(gm(x), MLP.forward(m, x))
    m.train()
    r = gm.stats.recaptures
    assert r[0] == "args[0]: shape (4, 16) -> (6, 16)"
    assert r[1:] == ["grad mode: True -> False", "grad mode: False -> True; train/eval mode changed: train -> eval"]
    assert gm.stats.captures == 4
    with pytest.warns(UserWarning, match="max_captures=4"):
        gm(torch.randn(9, 16))
    assert gm.stats.eager_calls == 2
    text = gm.explain()
    assert "graph 0" in text and "recapture: args[0]: shape" in text and "saved activations" in text
    gm.reset()
    assert gm.stats.captures == 0 and "graph 0" not in gm.explain()


def test_batchnorm_buffers_and_no_grad_forward():
    torch.manual_seed(5)
    eager = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    gm = stepgraph.graph_module(copy.deepcopy(eager))
    for _ in range(4):
        x = torch.randn(5, 8)
        a, b = eager(x), gm(x)
        assert torch.equal(a, b)
        a.sum().backward()
        b.sum().backward()
    sa, sb = eager.state_dict(), gm.module.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert int(sb["1.num_batches_tracked"]) == 4


def test_data_dependent_forward_raises_capture_error():
    """A module with no submodule to graph instead (its host read sits with its own parameters)."""
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            h = x @ self.w
            return h * 2 if h.sum().item() > 0 else h
    gm = stepgraph.graph_module(Bad())
    gm(torch.randn(2, 4))
    with pytest.raises(CaptureError, match="could not be traced") as e:
        gm(torch.randn(2, 4))
    assert gm.stats.failed_captures == 1
    assert "test_partial.py" in e.value.where and "h.sum().item() > 0" in e.value.where, e.value.where


class MaskedEncoder(nn.Module):
    """transformers' pattern: the model checks its attention mask on the host (``if
    (mask == 1).all(): mask = None``, to take the unmasked attention path), then runs its layers."""

    def __init__(self, d=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(d, 3)

    def forward(self, ids, mask):
        pad = None if bool((mask == 1).all()) else mask == 0
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=pad)
        return self.head(h[:, 0])


def test_a_host_read_in_the_forward_graphs_its_submodules_instead():
    """The module's own forward (its host read, its Python) runs eagerly; the submodules it calls
    replay their graphs, and the results are eager's, on batches with and without padding."""
    torch.manual_seed(0)
    model = MaskedEncoder()
    twin = copy.deepcopy(model)
    gm = stepgraph.graph_module(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]

    def batch(k):
        g = torch.Generator().manual_seed(k)
        ids, mask = torch.randint(0, 50, (4, 8), generator=g), torch.ones(4, 8, dtype=torch.long)
        if k % 3 == 2:
            mask[1, 5:] = 0
        return ids, mask, torch.randint(0, 3, (4,), generator=g)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(7):
            ids, mask, y = batch(k)
            for m, opt in zip((model, twin), opts):
                F.cross_entropy(m(ids, mask), y).backward()
                opt.step()
                opt.zero_grad()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters())), k
    said = [str(w.message) for w in caught if "graph_module(MaskedEncoder)" in str(w.message)]
    assert len(said) == 1 and "(mask == 1).all()" in said[0] and "layers.0" in said[0], said
    layer = model.layers[0].__dict__["_stepgraph_partial"]
    assert layer.stats.replays >= 3 and model.embed.__dict__["_stepgraph_partial"].stats.replays >= 3
    assert "submodules graphed in its place: embed" in gm.explain()
    gm.remove()
    assert all("_stepgraph_partial" not in m.__dict__ for m in model.modules())


def test_remove_restores_eager_forward():
    m = MLP(p=0.0)
    gm = stepgraph.graph_module(m)
    assert stepgraph.graph_module(m) is gm
    gm(torch.randn(2, 16))
    gm(torch.randn(2, 16))
    assert gm.remove() is m and "forward" not in m.__dict__
    m(torch.randn(2, 16))
    assert gm.stats.captures == 1 and gm.stats.replays == 0


def test_replay_order_on_cpu_is_fine():
    torch.manual_seed(6)
    m = MLP(p=0.0)
    gm = stepgraph.graph_module(m)
    gm(torch.randn(2, 16))
    o1, o2, o3 = (gm(torch.randn(2, 16)) for _ in range(3))
    o1.sum().backward()   # CPU: every forward allocates fresh activations
    o3.sum().backward()
    o2.sum().backward()


def test_replay_order_check_logic_on_cpu_with_static_semantics():
    """The CUDA order check, exercised on the CPU by giving the entry static-buffer semantics."""
    gm = stepgraph.graph_module(MLP(p=0.0))
    gm(torch.randn(2, 16))
    gm(torch.randn(2, 16)).sum().backward()
    gm.order[0].cuda = True
    o1, o2 = gm(torch.randn(2, 16)), gm(torch.randn(2, 16))
    o2.sum().backward()
    with pytest.raises(StepGraphError, match="overwrote the saved activations"):
        o1.sum().backward()


# ---- GPU -------------------------------------------------------------------------------
@cuda
def test_cuda_parity_and_fresh_dropout():
    torch.manual_seed(7)
    eager = Net().cuda()
    graphed = copy.deepcopy(eager)
    for name in ("mlp", "block", "enc"):
        stepgraph.graph_module(getattr(graphed, name))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, graphed)]
    for m in (eager, graphed):   # dropout off: compare numerics
        for mod in m.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0
            elif isinstance(mod, nn.MultiheadAttention):
                mod.dropout = 0.0
        m.block.p = 0.0
    logs = ([], [])
    for i in range(6):
        idx, y = torch.randint(0, 23, (3, 6), device="cuda"), torch.randint(0, 23, (3, 6), device="cuda")
        grads = [_step(m, o, idx, y, log) for m, o, log in zip((eager, graphed), opts, logs)]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert graphed.mlp._stepgraph_partial.stats.replays == 4
    d = stepgraph.graph_module(MLP(p=0.5).cuda())
    x = torch.randn(64, 16, device="cuda")
    outs = [d(x) for _ in range(4)]
    assert not torch.equal(outs[2], outs[3])   # replays draw fresh dropout masks


@cuda
def test_cuda_replay_order_violation_raises():
    torch.manual_seed(8)
    gm = stepgraph.graph_module(MLP(p=0.0).cuda())
    gm(torch.randn(2, 16, device="cuda"))
    ok = gm(torch.randn(2, 16, device="cuda"))
    ok.sum().backward()
    o1 = gm(torch.randn(2, 16, device="cuda"))
    o2 = gm(torch.randn(2, 16, device="cuda"))
    o2.sum().backward()
    with pytest.raises(StepGraphError, match="overwrote the saved activations"):
        o1.sum().backward()


@cuda
def test_cuda_hooks_kwargs_and_input_grad():
    torch.manual_seed(9)
    eager = KW().cuda()
    gm = stepgraph.graph_module(copy.deepcopy(eager))
    n = Counter()
    gm.module.register_forward_hook(lambda m, a, o: n.update(["fwd"]))
    mask = torch.rand(4, 8, device="cuda") > 0.5
    for _ in range(4):
        x = torch.randn(4, 8, device="cuda")
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        a, b = eager(xa, mask=mask, flag=True, scale=2.0), gm(xb, mask=mask, flag=True, scale=2.0)
        torch.testing.assert_close(a["out"], b["out"])
        a["out"].sum().backward()
        b["out"].sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad)
    assert n["fwd"] == 4 and gm.stats.replays == 2


def test_what_a_failed_trace_put_in_an_argument_object_is_taken_back():
    """transformers' DynamicCache: a layer appends its keys to a cache object its caller passes;
    the trace appended fake tensors, then failed at a host read; the forward run eagerly next saw
    twice the keys. The argument objects' dicts and lists are put back after a failed trace."""
    class Cache:
        def __init__(self):
            self.keys = []

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = nn.Linear(4, 4)

        def forward(self, x, cache):
            cache.keys.append(self.k(x))
            keys = torch.cat(cache.keys)
            return x * 2 if bool((keys.sum() > 0).all()) else x   # (a host read after the append)

    torch.manual_seed(0)
    layer = Layer()
    stepgraph.graph_module(layer)
    for k in range(3):
        cache = Cache()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layer(torch.randn(2, 4), cache)
        assert len(cache.keys) == 1 and not isinstance(cache.keys[0], torch._subclasses.FakeTensor), k


class MaskedHead(nn.Module):
    """ELECTRA pretraining's loss: ``logits.view(-1)[attention_mask.view(-1) == 1]``, a size the data decides."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, h, mask, labels):
        active = mask.view(-1) == 1
        logits = self.lin(h).squeeze(-1).view(-1)[active]
        return F.binary_cross_entropy_with_logits(logits, labels.view(-1)[active].float())


def test_a_boolean_mask_selection_replays_with_each_calls_size():
    torch.manual_seed(0)
    eager = MaskedHead()
    graphed = stepgraph.graph_module(copy.deepcopy(eager))
    for kept in (3, 3, 1, 5, 2):
        h, labels = torch.randn(2, 5, 8), torch.randint(0, 2, (2, 5))
        mask = torch.ones(2, 5, dtype=torch.long)
        mask[0, kept:] = 0
        losses = [m(h, mask, labels) for m in (eager, graphed)]
        for loss in losses:
            loss.backward()
        assert torch.equal(*losses)
        for a, b in zip(eager.parameters(), graphed.module.parameters()):
            assert torch.equal(a.grad, b.grad)
    assert graphed.stats.captures == 1 and graphed.stats.replays == 3
