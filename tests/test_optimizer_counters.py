"""Optimizers that keep their step count as a Python number in their per-parameter state (or param group) and
increment it each step: microsoft/LoRA examples/NLG/src/optimizer.py's AdamW (older Hugging Face
AdamW), transformers' Adafactor, torch's SparseAdam (``state['step'] += 1``, ``bias_correction =
1 - beta ** state['step']``). A replay runs no Python: it used to write back the captured call's
count every step and bake it into the update -- silently wrong -- and was then refused. The
count is now a tracked number (capture/trackplan.py, ``Root("slot")``): the arithmetic on it is
read live at each replay and the increment written after it, as the optimizer's Python does."""
import math

import pytest
import torch

import stepgraph

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs CUDA"))]


class CountingSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                state["step"] += 1
                p.data.add_(p.grad, alpha=-group["lr"] / state["step"])


class AdamW(torch.optim.Optimizer):
    """microsoft/LoRA's examples/NLG/src/optimizer.py AdamW (the old Hugging Face one): a class
    named AdamW that is not torch's."""
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias))

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                step_size = group["lr"]
                if group["correct_bias"]:
                    bias_correction1 = 1.0 - beta1 ** state["step"]
                    bias_correction2 = 1.0 - beta2 ** state["step"]
                    step_size = step_size * math.sqrt(bias_correction2) / bias_correction1
                p.data.addcdiv_(exp_avg, denom, value=-step_size)
                if group["weight_decay"] > 0.0:
                    p.data.add_(p.data, alpha=-group["lr"] * group["weight_decay"])


class ConstantFlag(torch.optim.Optimizer):
    """A number set to the same value every step: no counter, captured and replayed."""
    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["scale"] = 2
                p.data.add_(p.grad, alpha=-group["lr"] * self.state[p]["scale"])


class GroupStepAdam(torch.optim.Optimizer):
    """The count in the param group (timm's Adan, ``group['step'] += 1``; Lookahead's
    ``group['lookahead_step']``): keyed by value, it recaptured at every call."""
    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    def step(self):
        for group in self.param_groups:
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = 1
            bias_correction = 1.0 - group["beta"] ** group["step"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["m"] = torch.zeros_like(p)
                state["m"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.data.add_(state["m"], alpha=-group["lr"] / bias_correction)


class RebindingMomentum(torch.optim.Optimizer):
    """State rebound to a new tensor each step, not updated in place (``state['m'] = beta * m +
    g``: hand-written optimizers; timm LaProp's ``exp_avg_lr_2``). The graph read the captured
    tensor at every replay: silently wrong."""
    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["m"] = torch.zeros_like(p)
                state["m"] = 0.9 * state["m"] + p.grad
                p.data.add_(state["m"], alpha=-group["lr"])


class LrAverage(torch.optim.Optimizer):
    """timm LaProp's float state computed from the lr (``state['exp_avg_lr_1'] =
    state['exp_avg_lr_1'] * beta1 + (1 - beta1) * group['lr']``, a comparison on it): checked by
    value, it recaptured at every call and then wrote the capture's value back."""
    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["lr_avg"] = 0.
                state["lr_avg"] = state["lr_avg"] * group["beta"] + (1 - group["beta"]) * group["lr"]
                step_size = group["lr"] / state["lr_avg"] if state["lr_avg"] != 0. else 0.
                p.data.add_(p.grad, alpha=-step_size)


class AttrCounter(torch.optim.Optimizer):
    """The count as the optimizer's own attribute (pytorch_optimizer AdaLOMO's ``self.num_steps
    += 1``), the bias correction with ``math.pow`` (pytorch_optimizer's ``debias``), a global
    entry of ``opt.state`` that is no parameter's (MADGRAD's ``state['k']`` tensor, SPAM's
    ``state['total_step']`` int: a crash at the first call) and a dict in the param group (SCION's
    ``norm_kwargs``: a crash). Installed, the attribute was seen by no guard: silently wrong."""
    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta, norm_kwargs={}))
        self.num_steps = 0
        self.state["k"] = torch.zeros(())
        self.state["total_step"] = 0

    def step(self):
        self.num_steps += 1
        self.state["total_step"] += 1
        self.state["k"].add_(1)
        for group in self.param_groups:
            bias_correction = 1.0 - math.pow(group["beta"], self.num_steps)
            for p in group["params"]:
                scale = self.state["total_step"] / self.state["k"]
                p.data.add_(p.grad * scale, alpha=-group["lr"] / bias_correction)


class ScheduleFreeSGD(torch.optim.Optimizer):
    """schedulefree.SGDScheduleFree's step, reduced: running sums its step writes back into the
    param group (``group['weight_sum']``, ``group['lr_max']``, ``group['k']``), the lerp weight
    ``weight / weight_sum``. The floats were keyed by value, not being LIVE_HYPERS names: a
    capture per call."""
    def __init__(self, params, lr=1e-2, momentum=0.9):
        super().__init__(params, dict(lr=lr, k=0, weight_sum=0.0, lr_max=-1.0, momentum=momentum))

    def step(self):
        for group in self.param_groups:
            lr, k, momentum = group["lr"], group["k"], group["momentum"]
            lr_max = group["lr_max"] = max(lr, group["lr_max"])
            weight = lr_max ** 2
            weight_sum = group["weight_sum"] = group["weight_sum"] + weight
            try:
                ckp1 = weight / weight_sum
            except ZeroDivisionError:
                ckp1 = 0
            for p in group["params"]:
                state = self.state[p]
                if "z" not in state:
                    state["z"] = torch.clone(p.data)
                p.data.lerp_(end=state["z"], weight=ckp1)
                p.data.add_(p.grad, alpha=lr * (momentum * (1 - ckp1) - 1))
                state["z"].sub_(p.grad, alpha=lr)
            group["k"] = k + 1


def _library_attr_counter(params):
    """AttrCounter compiled as installed code (a site-packages file name): pyvalues reads no
    library code, so only the optimizer's registry sees its number."""
    import inspect
    import sysconfig
    ns = {"torch": torch, "math": math}
    exec(compile(inspect.getsource(AttrCounter), sysconfig.get_paths()["purelib"] + "/_sg_attr_counter.py", "exec"), ns)
    return ns["AttrCounter"](params)


def _adafactor(params):
    transformers = pytest.importorskip("transformers")
    return transformers.optimization.Adafactor(params, lr=None, relative_step=True, scale_parameter=True,
                                               warmup_init=True)


OPTS = {
    "counting_sgd": CountingSGD,
    "lora_adamw": lambda p: AdamW(p, lr=1e-2, weight_decay=0.01),
    "hf_adafactor": _adafactor,
    "constant_flag": ConstantFlag,
    "group_step": GroupStepAdam,
    "rebinding": RebindingMomentum,
    "lr_average": LrAverage,
    "attr_counter": AttrCounter,
    "library_attr_counter": _library_attr_counter,
    "schedule_free": ScheduleFreeSGD,
}


def _run(opt_name, compiled, calls=8, device="cpu", backend="auto"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)
    opt = OPTS[opt_name](model.parameters())

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    fn = stepgraph.compile(step, backend=backend) if compiled else step
    g = torch.Generator().manual_seed(1)
    losses = [fn(torch.randn(2, 4, generator=g).to(device)) for _ in range(calls)]
    return model, opt, losses, fn


def _assert_equal(got_model, got_opt, got, want_model, want_opt, want):
    assert all(torch.equal(a, b) for a, b in zip(got, want)), [float((a - b).abs().max()) for a, b in zip(got, want)]
    for p, q in zip(got_model.parameters(), want_model.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(got_model.parameters(), want_model.parameters()):
        for k, v in want_opt.state[q].items():
            w = got_opt.state[p][k]
            assert type(w) is type(v) and (torch.equal(w, v) if isinstance(v, torch.Tensor) else w == v), k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTS))
def test_a_python_step_count_in_optimizer_state_replays_equal_to_eager(opt_name, device):
    want_model, want_opt, want, _ = _run(opt_name, False, device=device)
    got_model, got_opt, got, fn = _run(opt_name, True, device=device)
    if device == "cpu" or opt_name not in ("hf_adafactor", "lr_average", "schedule_free"):
        # (schedule_free on the GPU: its group sums are keyed by value there, a capture per call --
    # read live into the CUDA graph, it replayed wrong: livefloats.after_prepare)
    # (on the GPU the numbers computed from the count reach the graph as one device tensor
        # (passes/device_scalars.py); Adafactor's also meet a value read from a tensor (its RMS):
        # those run between graph segments)
        assert fn.stats.captures == 1 and fn.stats.replays == 6, (fn.stats, fn.explain())
    _assert_equal(got_model, got_opt, got, want_model, want_opt, want)


def test_a_count_derived_number_reaches_a_fused_graph_as_a_device_scalar(monkeypatch):
    """Inductor (the CPU here; CUDA graphs alike): the old AdamW's ``step_size`` (lr and the
    count's bias corrections) is computed on the host at each call and fed in with the live
    floats as one tensor -- no graph segments, no recapture (they were: one segment per
    parameter's update). Compiled inside the capturing call (no background process): the fused
    graph's rounding differs from eager's, so close, not bitwise."""
    monkeypatch.setenv("STEPGRAPH_INDUCTOR_BACKGROUND", "0")
    want_model, want_opt, want, _ = _run("lora_adamw", False)
    got_model, got_opt, got, fn = _run("lora_adamw", True, backend="inductor")
    assert fn.stats.captures == 1 and fn.stats.replays == 6, (fn.stats, fn.explain())
    text = fn.explain()
    assert "into one device tensor" in text and "opt.state[model.0.weight]['step']" in text, text
    assert "segment" not in text, text
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, want))


@pytest.mark.parametrize("name", ["NAdam", "ASGD", "Adafactor"])
def test_torch_optimizers_step_counters_are_not_stored_reads(name):
    """torch's NAdam, ASGD and Adafactor (default args) hand their step counters' read floats to
    foreach ops in lists: hostscalar.substitute's recursive closure held them in a reference
    cycle until the next gc, and the capture warned "stores values read from tensors ... in
    Python objects" whenever gc had not run yet (here never: gc off): spurious, replays equal.
    Probe /work/repros/s26_probeB/nadam_spurious_warning.py."""
    import gc
    import warnings
    if not hasattr(torch.optim, name):
        pytest.skip(f"no torch.optim.{name}")
    OPTS[name] = getattr(torch.optim, name)
    try:
        want_model, want_opt, want, _ = _run(name, False)
        gc.collect()
        gc.disable()
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                got_model, got_opt, got, fn = _run(name, True)
        finally:
            gc.enable()
    finally:
        del OPTS[name]
    assert not [str(x.message) for x in w if str(x.message).startswith("stepgraph")]
    # (Adafactor's ``max(1.0, update.norm(2).item() / d)``: a value of the graph, not a branch on
    # the comparison -- it flipped as the norm crossed 1.0, a capture per call: hostreads._pick_live)
    assert fn.stats.captures == 1 and fn.stats.replays == 6, (fn.stats, fn.explain())
    _assert_equal(got_model, got_opt, got, want_model, want_opt, want)


class GrowingHistory(torch.optim.Optimizer):
    """State rebound to a tensor of another shape while it grows (the last 3 grads), then of the
    same shape: the graph captured while it grew read the old tensor as its constant."""
    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["h"] = p.grad.reshape(1, -1).clone()
                state["h"] = torch.cat([state["h"], p.grad.reshape(1, -1)])[-3:]
                p.data.sub_(group["lr"] * state["h"].mean(0).reshape(p.shape))


def test_state_rebound_to_another_shape_is_captured_again_once_it_keeps_its_shape():
    OPTS["growing"] = GrowingHistory
    try:
        want_model, want_opt, want, _ = _run("growing", False)
        got_model, got_opt, got, fn = _run("growing", True)
    finally:
        del OPTS["growing"]
    assert fn.stats.captures == 2 and fn.stats.replays == 5, (fn.stats, fn.explain())
    assert "same tensor as captured(opt.state[model.0.weight]['h'])" in fn.stats.recaptures[0]
    _assert_equal(got_model, got_opt, got, want_model, want_opt, want)


class ListHistory(torch.optim.Optimizer):
    """A history rebuilt as a new list each step (``state['h'] = [state['h'][1], grad]``): the
    graph read the old list's tensors as constants and each replay wrote back the capture's list,
    silently wrong. Refused, naming the optimizer's line."""
    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["h"] = [torch.zeros_like(p), torch.zeros_like(p)]
                state["h"] = [state["h"][1], p.grad.clone()]
                p.data.sub_(group["lr"] * (state["h"][0] + state["h"][1]) / 2)


def test_state_rebound_to_a_new_list_of_tensors_is_refused_at_its_line():
    OPTS["list_history"] = ListHistory
    try:
        want_model, want_opt, _, _ = _run("list_history", False, calls=2)
        with pytest.raises(stepgraph.CaptureError, match=r"rebinds opt.state\[model.0.weight\]\['h'\] to a new list") as e:
            _run("list_history", True, calls=2)
    finally:
        del OPTS["list_history"]
    assert 'state["h"] = [state["h"][1], p.grad.clone()]' in e.value.where


class MSchedule(torch.optim.Optimizer):
    """timm's NAdamLegacy, reduced: a Python step count and a float recurrence on a live
    hyper-parameter in the same per-parameter state. The count's replayed effect refers to that
    dict, so the capture took it for stepgraph's own and left its traced float in it."""
    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["step"], state["m_schedule"] = 0, 1.0
                state["step"] += 1
                state["m_schedule"] = state["m_schedule"] * group["beta"]
                p.data.add_(p.grad, alpha=-group["lr"] * state["m_schedule"] / state["step"])


def test_a_state_float_next_to_a_python_count_is_a_plain_float_after_the_capture():
    OPTS["m_schedule"] = MSchedule
    try:
        _, got_opt, _, fn = _run("m_schedule", True, calls=2)
    finally:
        del OPTS["m_schedule"]
    assert fn.stats.captures == 1
    assert all(type(st["m_schedule"]) is float and type(st["step"]) is int for st in got_opt.state.values())


_PROJECTOR = '''
import torch
class Projector:   # pytorch_optimizer's GaLoreProjector, reduced: a matrix remade every ``gap`` steps
    def __init__(self, gap):
        self.gap, self.matrix = gap, None

    def project(self, grad, step):
        if self.matrix is None or step % self.gap == 0:
            self.matrix = grad.sign().clone()
        return grad * self.matrix
'''


class Projected(torch.optim.Optimizer):
    """An installed class's object in the per-parameter state whose tensor the step rebinds
    every few steps: graphs captured between two remakings read the captured matrix after a
    replay had made a new one (and the replay did not rebind it) -- silently wrong."""
    def __init__(self, params, lr=1e-2):
        import sysconfig
        super().__init__(params, dict(lr=lr))
        ns = {}
        exec(compile(_PROJECTOR, sysconfig.get_paths()["purelib"] + "/_sg_projector.py", "exec"), ns)
        self.projector_cls = ns["Projector"]
        self.count = 0

    def step(self):
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "projector" not in state:
                    state["projector"] = self.projector_cls(3)
                p.data.add_(state["projector"].project(p.grad, self.count), alpha=-group["lr"])


def test_an_installed_object_in_optimizer_state_rebinding_its_tensor_is_replayed_equal_to_eager():
    OPTS["projected"] = Projected
    try:
        want_model, want_opt, want, _ = _run("projected", False, calls=10)
        got_model, got_opt, got, fn = _run("projected", True, calls=10)
    finally:
        del OPTS["projected"]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), [float((a - b).abs().max()) for a, b in zip(got, want)]
    for p, q in zip(got_model.parameters(), want_model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(got_opt.state[p]["projector"].matrix, want_opt.state[q]["projector"].matrix)
    assert fn.stats.replays >= 3, fn.stats
