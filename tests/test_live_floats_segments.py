"""A scheduled lr that a Python optimizer mixes with its own step count, in a step that reads a
value on the host (microsoft/LoRA's AdamW: ``step_size = lr * math.sqrt(1 - beta2 ** step) /
(1 - beta1 ** step)``, then ``p.data.addcdiv_(-step_size, exp_avg, denom)``; the loop's
``avg_lm_loss.update(loss.item())`` in the step).

The read cuts the graph into segments, and a segmented graph does not feed the optimizer's
Python step count to the device, so the lr met a number it could not be fed with: it was baked
and guarded, and every call of the warm-up schedule recaptured (the lora_finetune client on an
H200: 6 recaptures at one site). Now such live floats stay Python the segments run on the host,
with the ops they feed (livefloats.LiveFloats.to_device): one capture, replays equal to eager.
"""
import copy
import math

import pytest
import torch

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [("cpu", "inductor"),
         pytest.param("cuda", "cudagraph", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="needs CUDA"))]


class PyAdamW(torch.optim.Optimizer):
    """microsoft/LoRA's AdamW (examples/NLG/src/optimizer.py), its arithmetic in Python floats."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                step_size = group["lr"] * math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
                p.data.addcdiv_(exp_avg, denom, value=-step_size)


class Meter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n


@pytest.mark.parametrize("device,backend", CASES)
def test_a_scheduled_lr_meeting_a_python_step_count_is_read_live_in_a_segmented_graph(device, backend):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    m2 = copy.deepcopy(m)

    def make(model):
        opt = PyAdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)   # a warm-up: a new lr per call
        meter = Meter()

        def step(x):
            loss = model(x).square().mean()
            meter.update(loss.item())   # a host read: the graph is cut into segments
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            return loss
        return step, opt, meter
    (sg_fn, opt, meter), (eager, opt2, meter2) = make(m), make(m2)
    step = stepgraph.compile(sg_fn, backend=backend)
    g = torch.Generator().manual_seed(1)
    for _ in range(7):
        x = torch.randn(4, 8, generator=g).to(device)
        torch.testing.assert_close(step(x), eager(x), rtol=2e-5, atol=1e-7)
    for p, q in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=1e-7)
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]
    assert meter.count == meter2.count == 7
    assert meter.sum == pytest.approx(meter2.sum, rel=1e-5)
    assert (step.stats.captures, step.stats.recaptures) == (1, []), step.stats.recaptures
    assert step.stats.replays == 5
