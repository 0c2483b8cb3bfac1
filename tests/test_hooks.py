"""Issue 6: backward hooks under whole-step capture.

Every case drives a stepgraph step and an eager twin (a deepcopy with the same optimizer) with
the same fresh batches for CALLS calls (call 1 eager warm-up, call 2 capture, then replays) and
asserts, after every call, bitwise equality of the returned values, parameters, grads and
optimizer state, and exactly one capture. Cases whose hook changes gradients also run a third,
hook-free copy and assert it ends elsewhere: a capture that dropped the hook could not pass.

Hook kinds: tensor hooks on parameters (registered before the first call, or inside the step),
tensor hooks on activations registered in forward (observer and modifier), module full
backward hooks and pre-hooks, post-accumulate-grad hooks (in-place scaling, optimizer in
backward), retain_grad on a returned intermediate, hooks with Python side effects (run at
warm-up and capture only; stepgraph warns at capture), and the hooked_mlp model with AdamW.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import stepgraph
from stepgraph import models

CALLS = 7  # 1 warm-up + 1 capture + 5 replays


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def batch(k, n=8):
    g = torch.Generator().manual_seed(4000 + k)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def plain(model, opt):
    """The step every case builds on: grads are fresh each call and still bound when it returns."""
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def opt_list(opt):
    return opt if isinstance(opt, (list, tuple)) else [opt]


def assert_same(a, b, what):
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb), f"{what}: {len(la)} vs {len(lb)} leaves"
    for i, (x, y) in enumerate(zip(la, lb)):
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor), f"{what}[{i}]: {type(x).__name__}, eager has a tensor"
            assert torch.equal(x.detach(), y.detach()), f"{what}[{i}] differs from eager"
        else:
            assert x == y, f"{what}[{i}]: {x!r} vs eager {y!r}"


def assert_state_equal(model, opt, twin, topt, when):
    for (n, p), p2 in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.detach(), p2.detach()), f"{when}: param {n} differs from eager"
        assert (p.grad is None) == (p2.grad is None), f"{when}: grad presence of {n} differs"
        if p2.grad is not None:
            assert torch.equal(p.grad, p2.grad), f"{when}: grad {n} differs from eager"
    for o1, o2 in zip(opt_list(opt), opt_list(topt)):
        assert len(o1.state) == len(o2.state), f"{when}: optimizer state sizes differ"
        for s1, s2 in zip(o1.state.values(), o2.state.values()):
            assert s1.keys() == s2.keys(), f"{when}: optimizer state keys differ"
            for k in s1:
                assert_same(s1[k], s2[k], f"{when}: opt state {k}")


def run_twins(build, *, setup=None, make=make_model, opt_fn=sgd, calls=CALLS, hook_changes=True):
    """Drive ``stepgraph.compile(build(model, opt))`` and ``build(twin, topt)`` with the same batches.

    ``setup(model)`` (hooks registered before the first call) is applied to both copies; it may
    return per-copy data (a list a hook appends to), handed back as ``(mine, twins)``. With
    ``hook_changes``, a hook-free copy trained with ``plain`` must end with different weights.
    """
    model = make()
    twin, ref = copy.deepcopy(model), copy.deepcopy(model)
    extra = (setup(model), setup(twin)) if setup else (None, None)
    opt, topt = opt_fn(model.parameters()), opt_fn(twin.parameters())
    step = stepgraph.compile(build(model, opt))
    eager = build(twin, topt)
    outs = []
    for k in range(calls):
        out = step(*batch(k))
        want = eager(*batch(k))
        assert_same(out, want, f"call {k + 1} output")
        assert_state_equal(model, opt, twin, topt, f"after call {k + 1}")
        outs.append(out)
    st = step.stats
    assert (st.eager_calls, st.captures, st.replays) == (1, 1, calls - 2), step.explain()
    if hook_changes:
        ref_step = plain(ref, opt_fn(ref.parameters()))
        for k in range(calls):
            ref_step(*batch(k))
        assert any(not torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters())), \
            "the hook changed nothing: this case could not catch a dropped hook"
    return step, model, outs, extra


def halve(g):
    return g * 0.5


# ---------------------------------------------------------------- 1. tensor hooks on parameters

def test_param_hooks_registered_before_first_call():
    def setup(m):
        for p in m.parameters():
            p.register_hook(halve)
        m[2].bias.register_hook(lambda g: g.clamp(-0.05, 0.05))  # two hooks on one tensor, in order
    run_twins(plain, setup=setup)


def test_param_hooks_registered_and_removed_inside_the_step():
    def build(model, opt):
        inner = plain(model, opt)

        def step(x, y):
            handles = [p.register_hook(halve) for p in model.parameters()]
            try:
                return inner(x, y)
            finally:
                for h in handles:
                    h.remove()
        return step
    step, model, _, _ = run_twins(build)
    assert all(not p._backward_hooks for p in model.parameters())  # the step left none behind


def test_param_hook_registered_once_inside_the_step():
    """Register-if-absent inside the step: eager registers at call 1, capture bakes it in."""
    def build(model, opt):
        inner = plain(model, opt)
        done = []

        def step(x, y):
            if not done:
                done.append(model[0].weight.register_hook(halve))
            return inner(x, y)
        return step
    run_twins(build)


def test_param_hook_left_registered_by_every_step_call_warns_at_capture():
    """Spec: a step that registers a hook on a parameter every call and never removes it stacks
    hooks in eager (g * 0.5**k at call k), while the graph bakes the two present at capture.
    stepgraph must say so at the capture call: hooks added to state during the step persist."""
    model = make_model()
    opt = sgd(model.parameters())
    inner = plain(model, opt)

    def step(x, y):
        model[0].weight.register_hook(halve)
        return inner(x, y)
    compiled = stepgraph.compile(step)
    compiled(*batch(0))
    with pytest.warns(UserWarning, match="hook"):
        compiled(*batch(1))
    assert compiled.stats.captures == 1
    assert len(model[0].weight._backward_hooks) == 2  # replays do not register more
    compiled(*batch(2))
    assert len(model[0].weight._backward_hooks) == 2


# ---------------------------------------------------------------- 2. tensor hooks on activations

class ActHooked(nn.Module):
    def __init__(self, observer=True, modifier=True):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.observer, self.modifier = observer, modifier

    def forward(self, x):
        h1 = F.gelu(self.fc1(x))
        h2 = torch.tanh(self.fc2(h1))
        if self.observer:
            h1.register_hook(lambda g: None)  # observer: returns None, gradient unchanged
        if self.modifier:
            h2.register_hook(lambda g: g.clamp(-0.02, 0.02) * 2.0)
            h1.register_hook(halve)
        return self.fc3(h2)


def make_act(**kw):
    def make():
        torch.manual_seed(0)
        return ActHooked(**kw)
    return make


@pytest.mark.parametrize("opt_fn", [sgd, adamw], ids=["sgd", "adamw"])
def test_activation_hooks_registered_in_forward(opt_fn):
    run_twins(plain, make=make_act(), opt_fn=opt_fn)


def test_activation_observer_hook_only():
    run_twins(plain, make=make_act(modifier=False), hook_changes=False)


# ---------------------------------------------------------------- 3. module backward hooks

def test_module_full_backward_hook_modifies_grad_input():
    def setup(m):
        m[1].register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0.25,))
        m[2].register_full_backward_hook(lambda mod, gi, go: (gi[0].clamp(-0.01, 0.01),))
    run_twins(plain, setup=setup)


def test_module_full_backward_hook_observer():
    def setup(m):
        def observe(mod, gi, go):
            assert go[0].shape[-1] == mod.out_features  # shape checks only: no host reads
            return None
        m[0].register_full_backward_hook(observe)
        m[2].register_full_backward_hook(observe)
    run_twins(plain, setup=setup, hook_changes=False)


def test_module_full_backward_pre_hook_modifies_grad_output():
    def setup(m):
        m[2].register_full_backward_pre_hook(lambda mod, go: (go[0] * 3.0,))
        m[0].register_full_backward_pre_hook(lambda mod, go: (go[0] - go[0].mean(0, keepdim=True),))
    run_twins(plain, setup=setup)


def test_module_hooks_together_with_tensor_hooks():
    def setup(m):
        m[1].register_full_backward_pre_hook(lambda mod, go: (go[0] * 0.5,))
        m[1].register_full_backward_hook(lambda mod, gi, go: (gi[0] + 0.01 * go[0],))
        m[0].weight.register_hook(halve)
    run_twins(plain, setup=setup, make=make_act(observer=True, modifier=False))


# ---------------------------------------------------------------- 4. post-accumulate-grad hooks

def test_post_accumulate_grad_hook_scales_grad_in_place():
    def setup(m):
        def scale(p):
            p.grad.mul_(0.5)
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(scale)
    run_twins(plain, setup=setup)


def test_post_accumulate_grad_hook_with_adamw():
    def setup(m):
        m[0].weight.register_post_accumulate_grad_hook(lambda p: p.grad.clamp_(-1e-3, 1e-3))
    run_twins(plain, setup=setup, opt_fn=adamw)


@pytest.mark.parametrize("opt_fn", [sgd, adamw], ids=["sgd", "adamw"])
def test_optimizer_in_backward(opt_fn):
    """One optimizer per parameter, stepped and zeroed inside its post-accumulate-grad hook."""
    def per_param(ps):
        return [opt_fn([p]) for p in ps]

    def build(model, opts):
        by_param = {p: o for p, o in zip(model.parameters(), opts)}

        def hook(p):
            by_param[p].step()
            by_param[p].zero_grad()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        return step
    step, model, _, _ = run_twins(build, opt_fn=per_param, hook_changes=False)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- 5. retain_grad

def test_retain_grad_on_returned_intermediate():
    def build(model, opt):
        def step(x, y):
            opt.zero_grad()
            h = model[1](model[0](x))
            h.retain_grad()
            loss = F.cross_entropy(model[2](h), y)
            loss.backward()
            opt.step()
            return loss, h.grad
        return step
    step, _, outs, _ = run_twins(build, hook_changes=False)
    grads = [g for _, g in outs]
    assert all(g is not None and g.shape == (8, 16) for g in grads)
    assert not torch.equal(grads[-1], grads[-2])  # replays return this call's h.grad


def test_retain_grad_with_activation_hook():
    def build(model, opt):
        def step(x, y):
            opt.zero_grad()
            h = model[1](model[0](x))
            h.retain_grad()
            h.register_hook(halve)  # registered after retain_grad: h.grad is the pre-hook grad
            loss = F.cross_entropy(model[2](h), y)
            loss.backward()
            opt.step()
            return loss, h.grad
        return step
    run_twins(build)


# ---------------------------------------------------------------- 6. hooks with Python side effects

def _side_effect_setup(m):
    log, count = [], [0]

    def tensor_hook(g):
        log.append(tuple(g.shape))
        return None

    def module_hook(mod, gi, go):
        count[0] += 1

    def post_acc(p):
        count[0] += 10
    m[0].weight.register_hook(tensor_hook)
    m[2].register_full_backward_hook(module_hook)
    m[2].weight.register_post_accumulate_grad_hook(post_acc)
    return log, count


def test_side_effect_hooks_run_only_at_warmup_and_capture():
    _, _, _, (mine, theirs) = run_twins(plain, setup=_side_effect_setup, hook_changes=False)
    (log, count), (tlog, tcount) = mine, theirs
    assert len(tlog) == CALLS and tcount == [11 * CALLS]  # eager: every call
    assert log == [(16, 8)] * 2 and count == [22]  # stepgraph: warm-up and capture only


def test_side_effect_hooks_warn_at_capture():
    """Spec (issue 6): a hook with Python side effects runs only at warm-up and capture, so the
    capture call warns, naming the hook. Warm-up and replays do not warn."""
    model = make_model()
    _side_effect_setup(model)
    step = stepgraph.compile(plain(model, sgd(model.parameters())))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(*batch(0))  # warm-up: plain eager, no warning
    with pytest.warns(UserWarning, match="hook") as rec:
        step(*batch(1))
    text = " ".join(str(w.message) for w in rec)
    assert "tensor_hook" in text or "module_hook" in text or "post_acc" in text, text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(2, 5):
            step(*batch(k))
    assert (step.stats.captures, step.stats.replays) == (1, 3)


def test_activation_hook_with_side_effect_warns_at_capture():
    seen = []

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            h = self.a(x)
            h.register_hook(lambda g: seen.append(1))
            return self.b(h)
    torch.manual_seed(0)
    model = M()
    step = stepgraph.compile(plain(model, sgd(model.parameters())))
    step(*batch(0))
    with pytest.warns(UserWarning, match="hook"):
        step(*batch(1))
    for k in range(2, 5):
        step(*batch(k))
    assert len(seen) == 2


def test_pure_hooks_do_not_warn():
    """No false alarm: hooks that only compute on the gradient are captured silently."""
    def setup(m):
        for p in m.parameters():
            p.register_hook(halve)
        m[1].register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0.5,))
    model = make_model()
    setup(model)
    step = stepgraph.compile(plain(model, sgd(model.parameters())))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(5):
            step(*batch(k))
    assert step.stats.captures == 1


# ---------------------------------------------------------------- model level

def test_hooked_mlp_adamw():
    case = models.build("hooked_mlp", width=16, batch=8, classes=4)

    def make():
        return case.fresh().model  # hooks are registered by the constructor

    def step_for(model, opt):
        def step(x, y):
            opt.zero_grad()
            loss = case.loss_fn(model, x, y)
            loss.backward()
            opt.step()
            return loss
        return step

    model, twin = make(), make()
    opt, topt = adamw(model.parameters()), adamw(twin.parameters())
    step, eager = stepgraph.compile(step_for(model, opt)), step_for(twin, topt)
    for k in range(CALLS):
        b = case.make_batch(100 + k)
        assert torch.equal(step(*b), eager(*b)), f"call {k + 1} loss"
        assert_state_equal(model, opt, twin, topt, f"after call {k + 1}")
    assert (step.stats.captures, step.stats.replays) == (1, CALLS - 2)
    # The hooks matter: the same model without its parameter hook trains elsewhere.
    bare = make()
    next(iter(bare.fc1.weight._backward_hooks.values()))  # the constructor registered one
    bare.fc1.weight._backward_hooks.clear()
    bopt = adamw(bare.parameters())
    bstep = step_for(bare, bopt)
    for k in range(CALLS):
        bstep(*case.make_batch(100 + k))
    assert not torch.equal(bare.fc1.weight, model.fc1.weight)
