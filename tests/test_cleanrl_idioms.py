"""Idioms of CleanRL's off-policy scripts (clients/cleanrl_sac.py, cleanrl_td3.py,
cleanrl_dqn.py), each as a small step compared with eager PyTorch: the same seeds, fresh
batches at every call, and after every call the loss, parameters, grads, optimizer state and
the Python values the step rebinds."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


def _state(mods, opts, extra=()):
    out = {}
    for i, m in enumerate(mods):
        for n, p in m.named_parameters():
            out[f"m{i}.{n}"] = p.detach().clone()
            out[f"m{i}.{n}.grad"] = None if p.grad is None else p.grad.detach().clone()
    for i, o in enumerate(opts):
        for j, st in enumerate(o.state.values()):
            for name, v in st.items():
                out[f"o{i}.{j}.{name}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    for i, t in enumerate(extra):
        out[f"extra{i}"] = t.detach().clone() if isinstance(t, torch.Tensor) else t
    return out


def _same(a, b, where):
    assert a.keys() == b.keys(), where
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y), f"{where}: {k}"
        else:
            assert x == y, f"{where}: {k}: {x} != {y}"


# ---- SAC's entropy temperature: alpha = log_alpha.exp().item(), rebound in the step --------

def _sac(compiled: bool, steps: int, policy_frequency=2, noise=True):
    """sac_continuous_action.py's update, small: ``alpha`` (a Python float the step rebinds from
    ``log_alpha.exp().item()``) scales the critic target and, inside the delayed policy loop, the
    actor loss ``alpha * log_pi`` of a tensor that needs grad (autograd keeps that number for the
    backward); ``rsample``'s noise makes every read value differ call to call."""
    torch.manual_seed(0)
    actor, q = nn.Linear(4, 2), nn.Linear(6, 1)
    log_alpha = torch.zeros(1, requires_grad=True)
    q_opt = torch.optim.Adam(q.parameters(), lr=1e-2)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=1e-2)
    a_opt = torch.optim.Adam([log_alpha], lr=1e-2)
    alpha = log_alpha.exp().item()
    target_entropy = -2.0

    def get_action(obs):
        mean = actor(obs)
        x_t = mean + (torch.randn_like(mean) if noise else 0.1)
        return torch.tanh(x_t), -(x_t ** 2).sum(1, keepdim=True)

    def update(obs, rew):
        nonlocal alpha
        with torch.no_grad():
            next_a, next_log_pi = get_action(obs)
            target = rew + 0.99 * (q(torch.cat([obs, next_a], 1)) - alpha * next_log_pi)
        q_loss = F.mse_loss(q(torch.cat([obs, next_a], 1)), target)
        q_opt.zero_grad()
        q_loss.backward()
        q_opt.step()
        for _ in range(policy_frequency):
            pi, log_pi = get_action(obs)
            actor_loss = ((alpha * log_pi) - q(torch.cat([obs, pi], 1))).mean()
            actor_opt.zero_grad()
            actor_loss.backward()
            actor_opt.step()
            with torch.no_grad():
                _, log_pi = get_action(obs)
            alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()
            a_opt.zero_grad()
            alpha_loss.backward()
            a_opt.step()
            alpha = log_alpha.exp().item()
        return q_loss, actor_loss

    fn = stepgraph.compile(update) if compiled else update
    data = torch.Generator().manual_seed(1)
    records = []
    for _ in range(steps):
        obs, rew = torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data)
        losses = fn(obs, rew)
        records.append((tuple(x.detach().clone() for x in losses), alpha,
                        _state([actor, q], [q_opt, actor_opt, a_opt], [log_alpha])))
    return records, fn


@pytest.mark.parametrize("noise", [True, False], ids=["rsample", "deterministic"])
@pytest.mark.parametrize("policy_frequency", [1, 2])
def test_sac_alpha_read_back_scales_the_actor_loss(noise, policy_frequency):
    got, step = _sac(True, 6, policy_frequency, noise)
    want, _ = _sac(False, 6, policy_frequency, noise)
    for i, ((gl, ga, gs), (wl, wa, ws)) in enumerate(zip(got, want)):
        for x, y in zip(gl, wl):
            assert torch.equal(x, y), f"call {i}: loss"
        assert ga == wa, f"call {i}: alpha {ga} != {wa}"
        _same(gs, ws, f"call {i}")
    # One graph, replayed: alpha is computed by the graph (never a value to key or guard).
    assert step.stats.captures == 1 and step.stats.replays == 4, step.stats


# ---- a variant that bakes a float the graphs before it read live --------------------------

def _delayed(compiled: bool, calls: int):
    """td3_continuous_action.py's shape: the critic every call, the actor and the soft target
    update when ``global_step % policy_frequency == 0``, and every 100 steps (here 8) the
    logging block, whose ``print("SPS:", int(global_step / (time.time() - start_time)))``
    bakes ``start_time`` -- a float the graphs captured before read live. (Here without the
    clock, which would make the printed number differ at every logging call.)"""
    torch.manual_seed(0)
    actor, q = nn.Linear(4, 2), nn.Linear(6, 1)
    q_target = copy.deepcopy(q)
    q_opt = torch.optim.Adam(q.parameters(), lr=1e-2)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=1e-2)
    tau, start_time = 0.005, 1e4
    global_step = 0

    def update(obs, rew):
        with torch.no_grad():
            target = rew + 0.99 * q_target(torch.cat([obs, actor(obs)], 1))
        q_loss = F.mse_loss(q(torch.cat([obs, actor(obs).detach()], 1)), target)
        q_opt.zero_grad()
        q_loss.backward()
        q_opt.step()
        if global_step % 2 == 0:
            actor_loss = -q(torch.cat([obs, actor(obs)], 1)).mean()
            actor_opt.zero_grad()
            actor_loss.backward()
            actor_opt.step()
            for param, target_param in zip(q.parameters(), q_target.parameters()):
                target_param.data.copy_(tau * param.data + (1 - tau) * target_param.data)
        if global_step % 8 == 0:
            print("SPS:", int(global_step / start_time))
        return q_loss

    fn = stepgraph.compile(update) if compiled else update
    data = torch.Generator().manual_seed(1)
    records = []
    for global_step in range(96, 96 + calls):
        obs, rew = torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data)
        loss = fn(obs, rew)
        records.append((loss.detach().clone(), _state([actor, q, q_target], [q_opt, actor_opt])))
    return records, fn


def test_a_variant_baking_a_live_float_keeps_the_graphs_before_it():
    got, step = _delayed(True, 12)
    want, _ = _delayed(False, 12)
    for i, ((gl, gs), (wl, ws)) in enumerate(zip(got, want)):
        assert torch.equal(gl, wl), f"call {i}: loss"
        _same(gs, ws, f"call {i}")
    # Three paths (odd, policy, policy + logging), one graph each: the logging graph keys
    # start_time by value, and the two graphs before it, which read it live, still answer.
    assert step.stats.captures == 3, step.stats.recaptures
    assert not any("signature changed" in r for r in step.stats.recaptures), step.stats.recaptures


def test_a_read_back_random_value_an_op_bakes_is_refused_with_a_fix_for_it():
    """Where the read-back number meets an op that is no plain operand (``clamp(max=bound)``
    of a tensor that needs grad, whose backward keeps the bound), it cannot stay live: refused,
    and the fix says to keep it a tensor -- not to build a batch outside the step."""
    torch.manual_seed(0)
    m, s = nn.Linear(4, 2), torch.zeros(1, requires_grad=True)
    opt, sopt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD([s], lr=0.1)

    @stepgraph.compile
    def step(x):
        y = m(x) + torch.randn(8, 2)
        s_loss = (s.exp() * y.detach().mean()).sum()
        sopt.zero_grad()
        s_loss.backward()
        sopt.step()
        bound = s.exp().item()
        loss = y.clamp(max=bound).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    step(torch.randn(8, 4))
    with pytest.raises(stepgraph.CaptureError) as e:
        step(torch.randn(8, 4))
    assert "bound = s.exp().item()" in e.value.where
    assert "keep it a tensor" in e.value.fix and "get_batch" not in e.value.fix


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["auto", "cudagraph"])
def test_cuda_sac_alpha_read_back_scales_the_actor_loss(backend):
    """SAC on a GPU: ``alpha = log_alpha.exp().item()`` rebound in the step, then ``alpha *
    log_pi`` -- the live float enters the graph as a 0-dim tensor made from it at each replay."""
    from stepgraph.optimizers import same_form
    dev = torch.device("cuda")

    def build():
        torch.manual_seed(0)
        actor, q = nn.Linear(4, 2).to(dev), nn.Linear(6, 1).to(dev)
        log_alpha = torch.zeros(1, requires_grad=True, device=dev)
        opts = [torch.optim.Adam(q.parameters(), lr=1e-2), torch.optim.Adam(actor.parameters(), lr=1e-2),
                torch.optim.Adam([log_alpha], lr=1e-2)]
        box = {"alpha": log_alpha.exp().item()}

        def update(obs, rew):
            q_opt, actor_opt, a_opt = opts
            with torch.no_grad():
                x = actor(obs) + 0.1
                next_a, next_log_pi = torch.tanh(x), -(x ** 2).sum(1, keepdim=True)
                target = rew + 0.99 * (q(torch.cat([obs, next_a], 1)) - box["alpha"] * next_log_pi)
            q_loss = F.mse_loss(q(torch.cat([obs, next_a], 1)), target)
            q_opt.zero_grad()
            q_loss.backward()
            q_opt.step()
            x = actor(obs) + 0.1
            pi, log_pi = torch.tanh(x), -(x ** 2).sum(1, keepdim=True)
            actor_loss = ((box["alpha"] * log_pi) - q(torch.cat([obs, pi], 1))).mean()
            actor_opt.zero_grad()
            actor_loss.backward()
            actor_opt.step()
            alpha_loss = (-log_alpha.exp() * (log_pi.detach() - 2.0)).mean()
            a_opt.zero_grad()
            alpha_loss.backward()
            a_opt.step()
            box["alpha"] = log_alpha.exp().item()
            return q_loss, actor_loss
        return update, opts, box, [actor, q]
    f, _, box, mods = build()
    g, opts2, box2, mods2 = build()
    f = stepgraph.compile(f, backend=backend)
    data = torch.Generator().manual_seed(1)
    for i in range(9):
        if i == 1:
            same_form(*opts2)
        obs, rew = torch.randn(8, 4, generator=data).to(dev), torch.randn(8, 1, generator=data).to(dev)
        for a, b in zip(f(obs, rew), g(obs, rew)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert abs(box["alpha"] - box2["alpha"]) <= 1e-6 * abs(box2["alpha"]), (i, box, box2)
    for m, m2 in zip(mods, mods2):
        for p, p2 in zip(m.parameters(), m2.parameters()):
            torch.testing.assert_close(p, p2, rtol=1e-6, atol=1e-7)
    # On CUDA a float is baked until its value check misses once, then read live (each capture's
    # reason below): a few captures, then every call replays.
    assert f.stats.captures <= 3 and f.stats.replays == 8 - f.stats.captures, f.stats.recaptures
    assert "backend replay" not in f.explain(), f.explain()   # (a CUDA graph, not the fallback)


def _sac_delayed(compiled: bool, steps: int, backend: str):
    """cleanrl_sac's shape on a fused backend: the policy and alpha update only when
    ``global_step % 2 == 0``, so the critic-only path reads ``alpha`` (a closure float the other
    path rebinds from ``.item()``) live, as a 0-dim tensor made from it at each call."""
    torch.manual_seed(0)
    actor, q = nn.Linear(4, 2), nn.Linear(6, 1)
    log_alpha = torch.zeros(1, requires_grad=True)
    opts = [torch.optim.Adam(q.parameters(), lr=1e-2), torch.optim.Adam(actor.parameters(), lr=1e-2),
            torch.optim.Adam([log_alpha], lr=1e-2)]
    alpha = log_alpha.exp().item()
    global_step = 0

    def update(obs, rew):
        nonlocal alpha
        q_opt, actor_opt, a_opt = opts
        with torch.no_grad():
            x = actor(obs) + 0.1
            target = rew + 0.99 * (q(torch.cat([obs, torch.tanh(x)], 1)) - alpha * -(x ** 2).sum(1, keepdim=True))
        q_loss = F.mse_loss(q(torch.cat([obs, torch.tanh(actor(obs).detach())], 1)), target)
        q_opt.zero_grad()
        q_loss.backward()
        q_opt.step()
        if global_step % 2 == 0:
            x = actor(obs) + 0.1
            log_pi = -(x ** 2).sum(1, keepdim=True)
            actor_loss = ((alpha * log_pi) - q(torch.cat([obs, torch.tanh(x)], 1))).mean()
            actor_opt.zero_grad()
            actor_loss.backward()
            actor_opt.step()
            alpha_loss = (-log_alpha.exp() * (log_pi.detach() - 2.0)).mean()
            a_opt.zero_grad()
            alpha_loss.backward()
            a_opt.step()
            alpha = log_alpha.exp().item()
        return q_loss

    fn = stepgraph.compile(update, backend=backend) if compiled else update
    data = torch.Generator().manual_seed(1)
    records = []
    for global_step in range(steps):
        obs, rew = torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data)
        records.append((fn(obs, rew).detach().clone(), alpha, [p.detach().clone() for p in actor.parameters()]))
    return records, fn


def test_sac_delayed_alpha_on_a_fused_backend_reads_alpha_live(monkeypatch):
    # (cleanrl_sac on the H100 recaptured at every alpha update: "alpha cannot be fed to the
    # graph as a tensor (aten.scalar_tensor.default takes a live float)")
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_BACKGROUND", "0")
    got, fn = _sac_delayed(True, 10, "inductor")
    want, _ = _sac_delayed(False, 10, None)
    for i, ((gl, ga, gp), (wl, wa, wp)) in enumerate(zip(got, want)):
        torch.testing.assert_close(gl, wl, rtol=1e-5, atol=1e-6, msg=f"call {i}")
        assert abs(ga - wa) <= 1e-6 * abs(wa), f"call {i}: alpha {ga} != {wa}"
        for a, b in zip(gp, wp):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fn.stats.captures <= 3, fn.stats.recaptures
    assert not any("alpha" in r for r in fn.stats.recaptures), fn.stats.recaptures
