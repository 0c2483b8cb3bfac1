"""A custom optimizer that keeps a Python int in its per-parameter state and increments it each
step (microsoft/LoRA examples/NLG/src/optimizer.py's AdamW, older Hugging Face AdamW:
``state['step'] += 1``, ``bias_correction = 1 - beta ** state['step']``). A replay runs no
Python: it wrote back the captured call's count every step and baked it into the update --
silently wrong. The capture is refused, naming the line, and state is what eager leaves."""
import copy

import pytest
import torch

import stepgraph


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


class ConstantFlag(torch.optim.Optimizer):
    """A number set to the same value every step: no counter, captured and replayed."""
    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["scale"] = 2
                p.data.add_(p.grad, alpha=-group["lr"] * self.state[p]["scale"])


def _run(opt_cls, compiled, calls=5):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = opt_cls(model.parameters())

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    fn = stepgraph.compile(step) if compiled else step
    errors = []
    for i in range(calls):
        try:
            fn(torch.full((2, 4), float(i + 1)))
        except stepgraph.CaptureError as e:
            errors.append(e)
    return model, opt, errors, fn


def test_python_int_counter_in_optimizer_state_is_refused_not_replayed():
    want_model, want_opt, _, _ = _run(CountingSGD, False, calls=2)
    got_model, got_opt, errors, _ = _run(CountingSGD, True, calls=2)
    assert len(errors) == 1
    e = errors[0]
    assert "Python number in its per-parameter state" in str(e)
    assert __file__ in e.where and 'state["step"] += 1' in e.where
    assert "torch.optim" in e.fix
    # the refused call ran eagerly: state is eager's
    for p, q in zip(got_model.parameters(), want_model.parameters()):
        assert torch.equal(p, q)
    assert got_opt.state[got_model.weight]["step"] == want_opt.state[want_model.weight]["step"] == 2


def test_later_calls_stay_equal_to_eager():
    want_model, want_opt, _, _ = _run(CountingSGD, False)
    got_model, got_opt, _, _ = _run(CountingSGD, True)
    for p, q in zip(got_model.parameters(), want_model.parameters()):
        assert torch.equal(p, q)
    assert got_opt.state[got_model.weight]["step"] == 5


def test_a_number_set_to_a_constant_still_replays():
    want_model, _, _, _ = _run(ConstantFlag, False)
    got_model, _, errors, fn = _run(ConstantFlag, True)
    assert not errors and fn.stats.replays == 3
    for p, q in zip(got_model.parameters(), want_model.parameters()):
        assert torch.equal(p, q)
