"""Issue 6: backward hooks under whole-step capture.

Each case drives a stepgraph step and an eager twin (identical copy, same optimizer) with the
same fresh batches (call 1 eager warm-up, call 2 capture, then replays), asserting after every
call bitwise equality of outputs, parameters, grads and optimizer state, and one capture. Cases
whose hook changes gradients also train a hook-free copy that must end elsewhere, so a capture
that dropped the hook cannot pass. Hooks with Python side effects run at warm-up and capture
only, and stepgraph warns at capture (spec tests).
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import stepgraph
from stepgraph.tools import models

CALLS = 7  # 1 warm-up + 1 capture + 5 replays


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def adamw(ps, **kw):
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw)


def make_model():
    # Built anew (same seed) rather than deepcopied: deepcopy drops a Parameter's tensor hooks.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def batch(k, n=8):
    g = torch.Generator().manual_seed(4000 + k)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def plain(model, opt):
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def halve(g):
    return g * 0.5


def scale_grad(p):  # post-accumulate-grad hooks: in place, and by rebinding .grad
    p.grad.mul_(0.5).clamp_(-0.02, 0.02)


def rebind_grad(p):
    p.grad = p.grad * 0.5


def assert_same(a, b, what):
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb), f"{what}: {len(la)} vs {len(lb)} leaves"
    for i, (x, y) in enumerate(zip(la, lb)):
        if isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and torch.equal(x.detach(), y.detach())
            assert same, f"{what}[{i}] differs from eager"
        else:
            assert x == y, f"{what}[{i}]: {x!r} vs eager {y!r}"


def assert_state_equal(model, opt, twin, topt, when):
    for (n, p), p2 in zip(model.named_parameters(), twin.parameters()):
        assert_same(p, p2, f"{when}: param {n}")
        assert (p.grad is None) == (p2.grad is None), f"{when}: grad presence of {n} differs"
        assert_same(p.grad, p2.grad, f"{when}: grad {n}")
    opts, topts = (o if isinstance(o, list) else [o] for o in (opt, topt))
    for o1, o2 in zip(opts, topts):
        assert len(o1.state) == len(o2.state), f"{when}: optimizer state sizes differ"
        for s1, s2 in zip(o1.state.values(), o2.state.values()):
            assert s1.keys() == s2.keys(), f"{when}: optimizer state keys differ"
            for k in s1:
                assert_same(s1[k], s2[k], f"{when}: opt state {k}")


def run_twins(build, *, setup=None, make=make_model, opt_fn=sgd, hook_changes=True, strip=None,
              state=None):
    """Drive ``stepgraph.compile(build(model, opt))`` and ``build(twin, topt)`` on the same batches.
    ``setup(m)`` registers hooks on each copy (its results come back as ``(mine, twins)``); with
    ``hook_changes`` a copy without them (``strip`` removes built-in ones) must end elsewhere."""
    model, twin, ref = make(), make(), make()
    extra = (setup(model), setup(twin)) if setup else (None, None)
    opt, topt = opt_fn(model.parameters()), opt_fn(twin.parameters())
    step = stepgraph.compile(build(model, opt), state=state(opt) if state else ())
    eager = build(twin, topt)
    outs = []
    for k in range(CALLS):
        out = step(*batch(k))
        assert_same(out, eager(*batch(k)), f"call {k + 1} output")
        assert_state_equal(model, opt, twin, topt, f"after call {k + 1}")
        outs.append(out)
    st = step.stats
    assert (st.eager_calls, st.captures, st.replays) == (1, 1, CALLS - 2), step.explain()
    if hook_changes:
        strip and strip(ref)
        ref_step = plain(ref, opt_fn(ref.parameters()))
        [ref_step(*batch(k)) for k in range(CALLS)]
        moved = any(not torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters()))
        assert moved, "the hook changed nothing: this case could not catch a dropped hook"
    return step, model, outs, extra


def capture_warnings(step, calls=5, eager=None):
    """stepgraph's hook warnings, per call (torch's own 'Full backward hook...' does not count);
    with ``eager``, each call's output must equal the eager twin's."""
    per_call = []
    for k in range(calls):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            out = step(*batch(k))
        eager and assert_same(out, eager(*batch(k)), f"call {k + 1} output")
        per_call.append([str(w.message) for w in rec if issubclass(w.category, UserWarning)
                         and "hook" in str(w.message) and "stepgraph" in str(w.message)])
    assert eager or (step.stats.captures, step.stats.replays) == (1, calls - 2)
    return per_call


# ---------------------------------------------------------------- 1. tensor hooks on parameters
def test_param_hooks_registered_before_first_call():
    def setup(m):
        for p in m.parameters():
            p.register_hook(halve)
        m[2].bias.register_hook(lambda g: g.clamp(-0.05, 0.05))  # two hooks on one tensor, in order
    run_twins(plain, setup=setup)


def test_param_hooks_registered_and_removed_inside_the_step():
    def build(model, opt):
        def step(x, y):
            handles = [p.register_hook(halve) for p in model.parameters()]
            try:
                return plain(model, opt)(x, y)
            finally:
                [h.remove() for h in handles]
        return step
    _, model, _, _ = run_twins(build)
    assert all(not p._backward_hooks for p in model.parameters())


def test_param_hook_registered_once_inside_the_step():  # eager registers at call 1
    def build(model, opt):
        def step(x, y):
            if not model[0].weight._backward_hooks:
                model[0].weight.register_hook(halve)
            return plain(model, opt)(x, y)
        return step
    run_twins(build)


def test_param_hook_left_registered_by_every_step_call():
    """Spec: hooks stack in eager (g * 0.5**k at call k); replays must not freeze the count seen
    at capture (recapture or run eagerly), and the capture warns that the step leaves hooks."""
    model, twin = make_model(), make_model()

    def build(m):
        inner = plain(m, sgd(m.parameters()))

        def step(x, y):
            m[0].weight.register_hook(halve)
            return inner(x, y)
        return step
    per_call = capture_warnings(stepgraph.compile(build(model)), CALLS, eager=build(twin))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert not per_call[0] and per_call[1], f"no stepgraph warning at capture: {per_call}"


def test_hook_removed_or_added_after_capture_is_seen_by_replays():
    """Spec: replays must not apply a hook removed after capture, nor miss one added since."""
    model, twin = make_model(), make_model()
    handles = [m[0].weight.register_hook(halve) for m in (model, twin)]
    opt, topt = sgd(model.parameters()), sgd(twin.parameters())
    step, eager = stepgraph.compile(plain(model, opt)), plain(twin, topt)
    for k in range(8):
        if k == 3:
            [h.remove() for h in handles]
        if k == 5:
            [m[2].register_full_backward_pre_hook(lambda mod, go: (go[0] * 3.0,)) for m in (model, twin)]
        assert_same(step(*batch(k)), eager(*batch(k)), f"call {k + 1} loss")
        assert_state_equal(model, opt, twin, topt, f"after call {k + 1}")
    assert step.stats.captures <= 3 and step.stats.replays >= 3


# ---------------------------------------------------------------- 2. tensor hooks on activations
class ActHooked(nn.Module):
    def __init__(self, modifier=True):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.modifier = modifier

    def forward(self, x):
        h1 = F.gelu(self.fc1(x))
        h2 = torch.tanh(self.fc2(h1))
        h1.register_hook(lambda g: None)  # observer: returns None, gradient unchanged
        if self.modifier:
            h2.register_hook(lambda g: g.clamp(-0.02, 0.02) * 2.0)
            h1.register_hook(halve)
        return self.fc3(h2)


def make_act(modifier=True):
    return lambda: (torch.manual_seed(0), ActHooked(modifier))[1]


@pytest.mark.parametrize("opt_fn,modifier", [(sgd, True), (adamw, True), (sgd, False)],
                         ids=["sgd", "adamw", "observer_only"])
def test_activation_hooks_registered_in_forward(opt_fn, modifier):
    run_twins(plain, make=make_act(modifier), opt_fn=opt_fn, hook_changes=modifier,
              strip=lambda m: setattr(m, "modifier", False))


# ---------------------------------------------------------------- 3. module backward hooks
def _observe(mod, gi, go):
    assert go[0].shape[-1] == mod.out_features  # shape checks only: no host reads


MODULE_HOOKS = {  # name -> ([(module index, kind, hook)], changes gradients)
    "full_hook_modifies_grad_input": ([(1, "full", lambda mod, gi, go: (gi[0] * 0.25,)),
                                       (2, "full", lambda mod, gi, go: (gi[0].clamp(-0.01, 0.01),))], True),
    "full_hook_observer": ([(0, "full", _observe), (2, "full", _observe)], False),
    "full_pre_hook_modifies_grad_output": ([(2, "pre", lambda mod, go: (go[0] * 3.0,)),
                                            (0, "pre", lambda mod, go: (go[0] - go[0].mean(0, keepdim=True),))],
                                           True),
    "pre_and_full_and_tensor_hook": ([(1, "pre", lambda mod, go: (go[0] * 0.5,)),
                                      (1, "full", lambda mod, gi, go: (gi[0] + 0.01 * go[0],)),
                                      (0, "weight", halve)], True),
}


@pytest.mark.parametrize("name", list(MODULE_HOOKS))
def test_module_backward_hooks(name):
    hooks, changes = MODULE_HOOKS[name]

    def setup(m):
        for i, kind, fn in hooks:
            target = m[i].weight if kind == "weight" else m[i]
            getattr(target, {"full": "register_full_backward_hook", "pre": "register_full_backward_pre_hook",
                             "weight": "register_hook"}[kind])(fn)
    run_twins(plain, setup=setup, hook_changes=changes)


# ---------------------------------------------------------------- 4. post-accumulate-grad hooks
@pytest.mark.parametrize("opt_fn", [sgd, adamw], ids=["sgd", "adamw"])
def test_post_accumulate_grad_hook_changes_grad(opt_fn):
    """In place (mul_, clamp_) and by rebinding ``p.grad`` (the graph rebinds it every replay)."""
    def setup(m):
        m[2].weight.register_post_accumulate_grad_hook(scale_grad)
        m[0].weight.register_post_accumulate_grad_hook(scale_grad)
        m[2].bias.register_post_accumulate_grad_hook(rebind_grad)
    run_twins(plain, setup=setup, opt_fn=opt_fn)


OIB = {"sgd": (sgd, False), "adamw_fused": (lambda ps: adamw(ps, fused=True), False),
       "adamw_state": (adamw, True), "adamw": (adamw, False)}


@pytest.mark.parametrize("kind", list(OIB))
def test_optimizer_in_backward(kind):
    """One optimizer per parameter, stepped and zeroed inside its post-accumulate-grad hook.
    The step never names the optimizers (only the hooks do); ``adamw_state`` hands them over
    with ``compile(state=...)``, ``adamw`` expects stepgraph to find them through the hooks."""
    opt_fn, pass_state = OIB[kind]

    def build(model, opts):
        by_param = dict(zip(model.parameters(), opts))

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
    _, model, _, _ = run_twins(build, opt_fn=lambda ps: [opt_fn([p]) for p in ps], hook_changes=False,
                               state=(lambda opts: opts) if pass_state else None)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- 5. retain_grad
@pytest.mark.parametrize("with_hook", [False, True], ids=["plain", "with_activation_hook"])
def test_retain_grad_on_returned_intermediate(with_hook):
    def build(model, opt):
        def step(x, y):
            opt.zero_grad()
            h = model[1](model[0](x))
            h.retain_grad()
            if with_hook:
                h.register_hook(halve)  # after retain_grad: h.grad is the pre-hook gradient
            loss = F.cross_entropy(model[2](h), y)
            loss.backward()
            opt.step()
            return loss, h.grad
        return step
    _, _, outs, _ = run_twins(build, hook_changes=with_hook)
    grads = [g for _, g in outs]
    assert all(g is not None and g.shape == (8, 16) for g in grads)
    assert not torch.equal(grads[-1], grads[-2])  # each replay returns its own call's h.grad


# ---------------------------------------------------------------- 6. hooks with Python side effects
def _side_effect_setup(m):
    log, count = [], [0]

    def tensor_hook(g):
        log.append(tuple(g.shape))

    def module_hook(mod, gi, go):
        count[0] += 1

    def post_acc(p):
        count[0] += 10
    m[0].weight.register_hook(tensor_hook)
    m[2].register_full_backward_hook(module_hook)
    m[2].weight.register_post_accumulate_grad_hook(post_acc)
    return log, count


def test_side_effect_hooks_run_only_at_warmup_and_capture():
    _, _, _, ((log, count), (tlog, tcount)) = run_twins(plain, setup=_side_effect_setup, hook_changes=False)
    assert len(tlog) == CALLS and tcount == [11 * CALLS]  # eager: every call
    assert log == [(16, 8)] * 2  # stepgraph: warm-up and capture only
    # (a counter the hooks add to is replayed as the step's own are: their code is scanned)
    assert count == tcount


def test_side_effect_hooks_warn_at_capture():
    """Spec (issue 6): a hook with Python side effects runs only at warm-up and capture, so the
    capture call warns, naming the hook(s); warm-up and replays do not warn."""
    model = make_model()
    _side_effect_setup(model)
    per_call = capture_warnings(stepgraph.compile(plain(model, sgd(model.parameters()))))
    assert not per_call[0] and not any(per_call[2:]), per_call
    text = " ".join(per_call[1])
    assert any(n in text for n in ("tensor_hook", "module_hook", "post_acc")), per_call


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
    per_call = capture_warnings(stepgraph.compile(plain(model, sgd(model.parameters()))))
    assert len(seen) == 2
    assert not per_call[0] and per_call[1], f"no stepgraph warning at capture: {per_call}"


@pytest.mark.parametrize("read", ["item", "tolist", "numpy"])
def test_host_read_inside_a_hook(read):
    """A hook runs under the step's modes (capture/fnbackward.py): item and tolist are read at each
    replay, as in the step's own code (they were refused); float(t.numpy()) is refused there too."""
    get = {"item": lambda t: t.item(), "tolist": lambda t: t.tolist(), "numpy": lambda t: float(t.numpy())}[read]
    setup = lambda m: m[0].weight.register_hook(lambda g: g / get(g.abs().max()))   # noqa: E731
    if read != "numpy":
        return run_twins(plain, setup=setup)
    model = make_model()
    setup(model)
    step = stepgraph.compile(plain(model, sgd(model.parameters())))
    step(*batch(0))
    with pytest.raises(stepgraph.CaptureError, match="numpy"):
        step(*batch(1))


def test_pure_hooks_do_not_warn():
    """No false alarm: hooks whose effects are all on tensors (captured) warn nothing."""
    model = make_model()
    for p in model.parameters():
        p.register_hook(halve)
    model[1].register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0.5,))
    model[2].weight.register_post_accumulate_grad_hook(scale_grad)
    model[2].bias.register_post_accumulate_grad_hook(rebind_grad)
    per_call = capture_warnings(stepgraph.compile(plain(model, sgd(model.parameters()))))
    assert not any(per_call), per_call


def test_hooked_mlp_adamw():
    # stepgraph.models.hooked_mlp: activation hook in forward + fc1.weight hook from __init__
    run_twins(plain, make=lambda: models.build("hooked_mlp", width=8, batch=8, classes=4).model,
              opt_fn=adamw, strip=lambda m: m.fc1.weight._backward_hooks.clear())


def test_hooks_whose_effects_replays_make_are_not_warned():
    """A full backward hook appending ``.item()`` norms to a list and a Grad-CAM tensor hook
    storing the grad in a dict: replays make both (pyeffects.py), bitwise as eager, yet the
    warning said they run only at capture and told the user to restructure working code
    (helper-91 F6)."""
    import warnings

    def run(compiled):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        norms, cam = [], {}
        net[2].register_full_backward_hook(lambda m, gi, go: norms.append(go[0].norm().item()))

        def save(g):
            cam["g"] = g

        def step(x):
            h = net[0](x)
            h.register_hook(save)
            loss = net[2](torch.relu(h)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        f = stepgraph.compile(step) if compiled else step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(5):
                f(torch.full((3, 4), 1.0 + i))
        return norms, cam["g"], [str(w.message) for w in caught if "side effects" in str(w.message)]
    (ne, ge, _), (nc, gc, notes) = run(False), run(True)
    assert ne == nc and torch.equal(ge, gc)
    assert notes == [], notes
