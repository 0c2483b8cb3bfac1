"""CUDA-graph backend: parity with eager on the GPU and the behaviours of issue 3.

Skipped without CUDA (CI has no GPU); run on the device with scripts/device_suite.sh.
On the GPU stepgraph switches optimizers to PyTorch's capturable path (device step
counters, tensor lr), so optimizer math is compared within a tolerance, not bitwise.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph
from parity import deterministic_cudnn  # noqa: F401  (fixture)
from parity import HAS_FUSED, OPTIMIZERS, ce_step, run_parity

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("deterministic_cudnn")]
RTOL = 1e-6


FAMILIES = ["mlp", "cnn_bn", "gpt", "embedding_model", "hooked_mlp", "tied"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_cuda_family_x_optimizer(family, opt_name):
    if opt_name == "adagrad":
        # PyTorch's Adagrad has no capturable form: it reads its step counter on the host.
        with pytest.raises(stepgraph.CaptureError, match="replay"):
            run_parity(family, opt_name, device="cuda", backend="cudagraph", rtol=RTOL)
        return
    rep = run_parity(family, opt_name, device="cuda", backend="cudagraph", rtol=RTOL)
    print(f"{family}/{opt_name}: worst rel err {rep.worst():.2e}")


@pytest.mark.parametrize("opt_name", sorted(HAS_FUSED - {"adagrad"}))
@pytest.mark.parametrize("form", ["foreach", "fused"])
def test_cuda_optimizer_forms(opt_name, form):
    run_parity("mlp", opt_name, form, device="cuda", backend="cudagraph", rtol=RTOL)


@pytest.mark.parametrize("family", ["mlp", "gpt"])
def test_cuda_deviation_from_default_config_eager(family):
    """Against an eager twin left on PyTorch's default (non-capturable) Adam: fp-rounding only."""
    rep = run_parity(family, "adamw", device="cuda", backend="cudagraph", rtol=1.0, same_config=False)
    print(f"{family}/adamw vs default-config eager: " + ", ".join(
        f"{k}={v:.1e}" for k, v in sorted(rep.max_rel.items(), key=lambda kv: -kv[1])[:3]))
    assert rep.max_rel["loss"] <= 1e-4


def _mlp_pair(**optkw):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.0), nn.Linear(32, 4)).cuda()
    m2 = copy.deepcopy(m)
    return m, m2, torch.optim.AdamW(m.parameters(), lr=1e-3, **optkw), torch.optim.AdamW(m2.parameters(), lr=1e-3, **optkw)


def _batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g).cuda(), torch.randint(0, 4, (n,), generator=g).cuda()


def _close(m, m2):
    for p, q in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-7)


def test_single_graph_replay_and_outputs_not_overwritten():
    m, m2, opt, opt2 = _mlp_pair()
    step, eager = stepgraph.compile(ce_step(m, opt)), ce_step(m2, opt2)
    outs = []
    for i in range(6):
        outs.append(step(*_batch(seed=i)))
        eager(*_batch(seed=i))
    kept = [o.clone() for o in outs]
    for i in range(3):
        step(*_batch(seed=10 + i))
    assert all(torch.equal(a, b) for a, b in zip(outs, kept)), "a replay overwrote an earlier output"
    assert step.stats.captures == 1 and step.stats.replays == 4 + 3
    assert step.captures[0].backend == "cudagraph"


def test_recapture_on_shape_change_and_shared_pool():
    m, m2, opt, opt2 = _mlp_pair()
    step, eager = stepgraph.compile(ce_step(m, opt)), ce_step(m2, opt2)
    for i, n in enumerate([8, 8, 8, 4, 4, 8, 4]):
        torch.testing.assert_close(step(*_batch(n, i)), eager(*_batch(n, i)), rtol=RTOL, atol=1e-6)
    assert step.stats.captures == 2
    assert "shape" in step.stats.recaptures[0] and "(8, 16)" in step.stats.recaptures[0]
    _close(m, m2)


def test_lr_scheduler_never_recaptures():
    m, m2, opt, opt2 = _mlp_pair()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    step, eager = stepgraph.compile(ce_step(m, opt)), ce_step(m2, opt2)
    for i in range(8):
        step(*_batch(seed=i))
        eager(*_batch(seed=i))
        sched.step()
        sched2.step()
    assert step.stats.captures == 1, step.stats.recaptures
    _close(m, m2)


def test_load_state_dict_mid_run():
    m, m2, opt, opt2 = _mlp_pair()
    step, eager = stepgraph.compile(ce_step(m, opt)), ce_step(m2, opt2)
    for i in range(4):
        step(*_batch(seed=i))
        eager(*_batch(seed=i))
    sd_m, sd_o = copy.deepcopy(m2.state_dict()), copy.deepcopy(opt2.state_dict())
    m.load_state_dict(sd_m)
    opt.load_state_dict(sd_o)
    for i in range(4, 8):
        step(*_batch(seed=i))
        eager(*_batch(seed=i))
    assert any("state" in r for r in step.stats.recaptures), step.stats.recaptures
    _close(m, m2)


def test_param_data_moved_recaptures_not_stale():
    m, m2, opt, opt2 = _mlp_pair()
    step, eager = stepgraph.compile(ce_step(m, opt)), ce_step(m2, opt2)
    for i in range(3):
        step(*_batch(seed=i))
        eager(*_batch(seed=i))
    with torch.no_grad():
        for p, q in [(m[0].weight, m2[0].weight)]:
            p.data = p.data.clone()  # new storage, same Parameter object
    for i in range(3, 6):
        step(*_batch(seed=i))
        eager(*_batch(seed=i))
    assert any("moved" in r for r in step.stats.recaptures), step.stats.recaptures
    _close(m, m2)


def test_dropout_masks_differ_across_replays_and_seed_reproduces():
    def run():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 4)).cuda()
        opt = torch.optim.SGD(m.parameters(), lr=0.0)  # lr 0: same weights, only masks vary
        step = stepgraph.compile(ce_step(m, opt))
        x, y = _batch()
        return [step(x, y).item() for _ in range(6)]
    a, b = run(), run()
    assert len(set(a[2:])) > 1, f"replays reused one dropout mask: {a}"
    assert a == b, "a fixed seed must reproduce the run"


def test_host_sync_and_cpu_tensor_raise_capture_error():
    m, _, opt, _ = _mlp_pair()

    def bad(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    step = stepgraph.compile(bad, host_reads="error")
    step(*_batch())
    with pytest.raises(stepgraph.CaptureError) as e:
        step(*_batch())
    assert "test_cuda.py" in e.value.where
    # By default the read is live: taken after the CUDA graph (backends/segments.py).
    step = stepgraph.compile(bad)
    step(*_batch())
    first = step(*_batch())
    assert isinstance(first, float) and step(*_batch()) != first and step.stats.replays == 1
    assert step.captures[-1].backend == "cudagraph"

    cpu_scale = torch.tensor([2.0, 3.0])

    def mixed(x, y):
        loss = F.cross_entropy(m(x), y) * cpu_scale.sum().cuda()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    # CPU work on host values only (a CPU tensor of the program's, summed and moved): run before
    # the graph at each call (passes/host_prologue.py), so an in-place change of it is seen.
    step2 = stepgraph.compile(mixed)
    for _ in range(3):
        step2(*_batch())
    cpu_scale.mul_(0)
    assert step2(*_batch()).item() == 0.0 and step2.stats.replays == 2, step2.stats
    assert step2.captures[-1].backend == "cudagraph"


def test_zero_copy_outputs_are_static():
    m, _, opt, _ = _mlp_pair()
    step = stepgraph.compile(ce_step(m, opt), clone_outputs=False)
    for i in range(3):
        a = step(*_batch(seed=i))
    b = step(*_batch(seed=5))
    assert a.data_ptr() == b.data_ptr(), "clone_outputs=False returns the graph's static buffer"


def test_inputs_with_static_address_skip_copy_and_mutated_inputs_copied_back():
    m, _, opt, _ = _mlp_pair()

    def step_fn(x, y, counter):
        counter.add_(1)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    step = stepgraph.compile(step_fn)
    counter = torch.zeros((), device="cuda")
    for i in range(5):
        step(*_batch(seed=i), counter)
    assert counter.item() == 5.0, "an input the graph writes must be written back"



def test_cudnn_lstm_refused_by_the_knob_is_a_clear_error_and_captures_with_cudnn_off(monkeypatch):
    """STEPGRAPH_CUDNN_RNN=refuse (by default such an LSTM is captured as its decomposition:
    test_cuda_rnn.py)."""
    monkeypatch.setenv("STEPGRAPH_CUDNN_RNN", "refuse")
    torch.manual_seed(0)
    lstm, head = torch.nn.LSTM(8, 16, num_layers=2).cuda(), torch.nn.Linear(16, 4).cuda()
    twin_lstm, twin_head = copy.deepcopy(lstm), copy.deepcopy(head)
    params = list(lstm.parameters()) + list(head.parameters())
    twin_params = list(twin_lstm.parameters()) + list(twin_head.parameters())
    opt, topt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(twin_params, lr=0.1)

    def body(rnn, lin, o):
        def f(x, y):
            out, _ = rnn(x)
            loss = F.cross_entropy(lin(out[-1]), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return f
    step, eager = stepgraph.compile(body(lstm, head, opt)), body(twin_lstm, twin_head, topt)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [(torch.randn(5, 3, 8, device="cuda", generator=g), torch.randint(0, 4, (3,), device="cuda", generator=g))
               for _ in range(6)]
    step(*batches[0]), eager(*batches[0])
    with pytest.raises(stepgraph.CaptureError, match="cudnn.flags") as e:
        step(*batches[1])
    eager(*batches[1])
    assert "test_cuda.py" in e.value.where
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)  # the refused call ran eagerly to its end
    with torch.backends.cudnn.flags(enabled=False):
        for x, y in batches[2:]:
            assert torch.equal(step(x, y), eager(x, y))
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)
    assert step.stats.replays >= 2, step.stats
