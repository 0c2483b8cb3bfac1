"""Issue 5 on the GPU: real-loop features under the CUDA-graph backend, each against an eager
twin that uses the optimizer form stepgraph switches to (capturable / tensor lr), bitwise.
Skipped without CUDA; run on the device (scripts/device_suite.sh)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import stepgraph
from parity import deterministic_cudnn  # noqa: F401  (fixture)
from parity import ce_step, run_parity
from stepgraph.optimizers import same_form

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("deterministic_cudnn")]
STEPS = 7


class Block(nn.Module):
    def __init__(self, ckpt=False, p=0.0):
        super().__init__()
        self.a, self.b, self.drop, self.ckpt = nn.Linear(32, 64), nn.Linear(64, 32), nn.Dropout(p), ckpt

    def inner(self, x):
        return self.b(self.drop(F.gelu(self.a(x))))

    def forward(self, x):
        return x + (checkpoint(self.inner, x, use_reentrant=False) if self.ckpt else self.inner(x))


def _net(**kw):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), Block(**kw), Block(**kw), nn.Linear(32, 4)).cuda()


def _batch(k):
    g = torch.Generator().manual_seed(500 + k)
    return torch.randn(16, 16, generator=g).cuda(), torch.randint(0, 4, (16,), generator=g).cuda()


def _plain_step(m, opt):
    def step(x, y, flag):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _flag(k):
    # A tensor, not a Python value (which would be guarded and recapture): step 4 overflows.
    return torch.tensor(float("inf") if k == 4 else 1.0, device="cuda")


def _run(make_step, net_kw=None, opt_kw=None, seeded=False, expect_backend="cudagraph"):
    """Drive stepgraph and an eager twin; the twin switches to the capturable form after capture."""
    m = _net(**(net_kw or {}))
    m2 = copy.deepcopy(m)
    kw = dict(lr=1e-3, **(opt_kw or {}))
    opt, opt2 = torch.optim.AdamW(m.parameters(), **kw), torch.optim.AdamW(m2.parameters(), **kw)
    sg, eager = stepgraph.compile(make_step(m, opt)), make_step(m2, opt2)
    for k in range(STEPS):
        if seeded:
            torch.manual_seed(k)
        a = sg(*_batch(k), _flag(k))
        if k == 1:
            same_form(opt2)
        if seeded:
            torch.manual_seed(k)
        b = eager(*_batch(k), _flag(k))
        for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
            assert torch.equal(x, y), f"call {k + 1}: output differs"
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert sg.stats.captures == 1 and sg.stats.replays == STEPS - 2, sg.stats
    assert sg.captures[0].backend == expect_backend
    return sg


def test_autocast_bf16():
    def mk(m, opt):
        def step(x, y, k):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    _run(mk)


def test_grad_scaler_fp16_fused_adamw_with_a_skipped_step():
    scalers = []

    def mk(m, opt):
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 8)
        scalers.append(scaler)

        def step(x, y, k):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(m(x), y)
            scaler.scale(loss * k).backward()  # k: _flag(k), inf on step 4: that update is skipped
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss.float(), scaler._scale.clone()
        return step
    _run(mk, opt_kw=dict(fused=True))
    assert torch.equal(scalers[0]._scale, scalers[1]._scale)
    assert scalers[0]._scale.item() < 2.0 ** 8  # the overflow halved the scale


def test_clip_grad_norm_and_accumulation():
    def mk(m, opt):
        def step(x, y, k):
            for xi, yi in zip(x.chunk(4), y.chunk(4)):  # 4 micro-batches
                (F.cross_entropy(m(xi), yi) / 4).backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            return norm
        return step
    _run(mk)


def test_checkpoint_without_dropout_stays_a_cuda_graph():
    _run(_plain_step, net_kw=dict(ckpt=True))


def test_checkpoint_with_dropout_falls_back_to_replay_with_a_warning():
    with pytest.warns(UserWarning, match="replay"):
        _run(_plain_step, net_kw=dict(ckpt=True, p=0.2), seeded=True, expect_backend="replay")


def test_lr_schedulers_do_not_recapture():
    for make in (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
                 lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=20, cycle_momentum=False)):
        m = _net()
        m2 = copy.deepcopy(m)
        opt, opt2 = torch.optim.AdamW(m.parameters(), lr=1e-3), torch.optim.AdamW(m2.parameters(), lr=1e-3)
        s1, s2 = make(opt), make(opt2)

        sg, eager = stepgraph.compile(ce_step(m, opt)), ce_step(m2, opt2)
        for k in range(STEPS):
            sg(*_batch(k))
            if k == 1:
                same_form(opt2)
            eager(*_batch(k))
            s1.step()
            s2.step()
        assert sg.stats.captures == 1, sg.stats.recaptures
        for p, q in zip(m.parameters(), m2.parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("opt_name", ["Adam", "AdamW"])
def test_onecycle_cycling_betas_is_captured_once(opt_name):
    """OneCycleLR(cycle_momentum=True) assigns new float betas every step: they changed between
    the warm-up and the capture, so the capture feeds them to the graph as a device tensor
    (passes/device_scalars.py; was: a recapture with betas held as device tensors)."""
    m = _net()
    m2 = copy.deepcopy(m)
    cls = getattr(torch.optim, opt_name)
    opt, opt2 = cls(m.parameters(), lr=1e-3), cls(m2.parameters(), lr=1e-3)
    steps = 12
    s1, s2 = (torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=steps + 1) for o in (opt, opt2))
    sg, eager = stepgraph.compile(ce_step(m, opt)), ce_step(m2, opt2)
    worst = 0.0
    for k in range(steps):
        a = sg(*_batch(k))
        if k == 1:
            same_form(opt2)
        b = eager(*_batch(k))
        worst = max(worst, ((a - b).abs() / b.abs()).item())
        s1.step()
        s2.step()
    assert sg.stats.captures == 1, sg.stats.recaptures
    assert "['betas']" in sg.explain() and "device tensor" in sg.explain()
    for p, q in zip(m.parameters(), m2.parameters()):
        worst = max(worst, ((p - q).abs().max() / q.abs().max()).item())
    # float32 device betas vs the eager twin's Python-float betas: rounding only.
    print(f"OneCycle {opt_name} cycling betas on GPU: max rel err {worst:.2e}")
    assert worst < 1e-5


@pytest.mark.parametrize("family", ["hf_gpt2", "hf_llama"])
def test_hf_zoo_on_gpu(family):
    pytest.importorskip("transformers")
    run_parity(family, "adamw", device="cuda", backend="cudagraph", rtol=0.0,
               config=dict(layers=2, d=64, heads=2, vocab=256, batch=2, seq=32))


# --------------------------------------------------------------------------- the zoo on the GPU

def _zoo_gpu(feat, build, make_opt, batches, step_fn, rtol):
    from parity import rel_err
    torch.manual_seed(0)
    m1 = build().cuda()
    m2 = copy.deepcopy(m1)
    o1, o2 = make_opt(m1), make_opt(m2)
    sg, eager = stepgraph.compile(step_fn(m1, o1)), step_fn(m2, o2)
    worst = 0.0
    for k, b in enumerate(batches):
        if k == 1:
            same_form(o2)
        worst = max(worst, rel_err(sg(*b), eager(*b)))
    for x, y in zip(list(m1.parameters()) + list(m1.buffers()), list(m2.parameters()) + list(m2.buffers())):
        worst = max(worst, rel_err(x, y))
    print(f"{feat} on GPU: max rel err {worst:.2e}")
    assert worst <= rtol, f"{feat}: {worst:.3g}"
    assert (sg.stats.captures, sg.stats.replays) == (1, len(batches) - 2), sg.stats
    assert sg.captures[-1].backend == "cudagraph"


def test_hf_bert_masked_lm_on_gpu():
    pytest.importorskip("transformers")
    from test_hf_zoo import build, make_batch, step_fn
    batches = [({k: v.cuda() for k, v in make_batch("bert", k).items()},) for k in range(STEPS)]
    _zoo_gpu("HF BERT masked LM", lambda: build("bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
             lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), batches,
             lambda m, o: step_fn(m, o, "loss"), 0.0)


def test_resnet_cnn_on_gpu():
    from test_real_loops import TinyResNet
    batches = []
    for k in range(STEPS):
        g = torch.Generator().manual_seed(4000 + k)
        batches.append((torch.randn(8, 3, 12, 12, generator=g).cuda(), torch.randint(0, 10, (8,), generator=g).cuda()))
    _zoo_gpu("ResNet-style CNN + BN", TinyResNet,
             lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4),
             batches, lambda m, o: ce_step(m, o), 0.0)


def test_gnn_scatter_gather_on_gpu():
    from test_real_loops import TinyGNN
    n, e, d = 20, 60, 16
    batches = []
    for k in range(STEPS):
        g = torch.Generator().manual_seed(3000 + k)
        batches.append((torch.randn(n, d, generator=g).cuda(), torch.randint(0, n, (2, e), generator=g).cuda(),
                        torch.randint(0, 3, (n,), generator=g).cuda()))

    def step_fn(m, o):
        def f(x, edge_index, y):
            loss = F.cross_entropy(m(x, edge_index), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return f
    # index_add_/scatter_add_ use atomics on the GPU: summation order varies run to run, in
    # eager as well, so this one is compared within float32 rounding.
    _zoo_gpu("GNN scatter/gather", TinyGNN, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), batches, step_fn, 1e-4)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulation_with_optimizer_outside_every_3_calls_on_gpu(set_to_none):
    """The step only does forward+backward; optimizer.step()/zero_grad() run outside every 3rd
    call: .grad accumulates across replays exactly as in eager."""
    m = _net()
    m2 = copy.deepcopy(m)
    opt, opt2 = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)

    def mk(model):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(m)), mk(m2)
    for k in range(9):
        assert torch.equal(sg(*_batch(k)), eager(*_batch(k)))
        for p, q in zip(m.parameters(), m2.parameters()):
            assert torch.equal(p.grad, q.grad), k
        if k % 3 == 2:
            for o in (opt, opt2):
                o.step()
                o.zero_grad(set_to_none=set_to_none)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert sg.stats.replays >= 5 and sg.captures[-1].backend == "cudagraph", sg.stats


def test_a_carried_tuple_state_is_written_back_after_each_graph_replay():
    """``nonlocal mems; ...; mems = (h.detach(), (2 * h).detach())`` (a recurrent state,
    pyeffects.live_tuple) under the CUDA-graph backend: each replay reads the tuple the last one
    wrote back (fresh tensors, never a graph's static buffer), bitwise with eager."""
    from carried import tuple_state_step
    (a, ma), (b, mb) = tuple_state_step("cuda"), tuple_state_step("cuda")
    sg = stepgraph.compile(a)
    g = torch.Generator().manual_seed(4)
    kept = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=g).cuda()
        assert torch.equal(sg(x), b(x))
        assert all(torch.equal(p, q) for p, q in zip(ma(), mb()))
        kept.append(ma())
    assert sg.stats.replays >= STEPS - 3 and sg.explain().count("tuple of 2 tensors") == 1
    assert kept[-2][0].data_ptr() != kept[-1][0].data_ptr()   # (each replay's own tensors)
