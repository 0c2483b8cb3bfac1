"""A tensor made from a Python number that changes at every call (capture/livefactory.py):
``torch.tensor(it)``, ``torch.full((B,), it % 10)``, ``torch.full_like(x, t)`` with ``it`` the
step's argument (a timestep, an iteration count a schedule computed on the device reads). Each
value was a new graph until max_captures, then eager (warned); now, after one miss, the fill is
read at each replay: one graph more, then replays, equal to eager."""
import os

import pytest
import torch

import stepgraph
from stepgraph.optimizers import same_form

DEVICE = "cuda" if os.environ.get("STEPGRAPH_TEST_CUDA") and torch.cuda.is_available() else "cpu"

FORMS = {
    "tensor": lambda x, it: torch.tensor(it, dtype=torch.float32, device=x.device) / 100 + 1,
    "tensor_int": lambda x, it: torch.tensor(it, device=x.device).float().sqrt() + 1,
    "tensor_float": lambda x, it: torch.tensor(it * 0.5, device=x.device) + 1,
    "scalar_tensor": lambda x, it: torch.scalar_tensor(it % 7, device=x.device) + 1,
    "full": lambda x, it: torch.full((x.shape[0], 1), it % 10, device=x.device) + 1,
    "full_float": lambda x, it: torch.full((x.shape[0], 1), 0.1 * it, dtype=torch.float64, device=x.device).float(),
    "full_like": lambda x, it: torch.full_like(x, it) / 10,
    "as_tensor": lambda x, it: torch.as_tensor(it + 3, device=x.device),
}


def _twin():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).to(DEVICE)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, opt, form):
    def step(x, it):
        loss = (model(x) * FORMS[form](x, it)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_tensor_made_from_an_argument_moving_every_call_is_one_graph(form):
    (me, oe), (mc, oc) = _twin(), _twin()
    eager, compiled = _step(me, oe, form), stepgraph.compile(_step(mc, oc, form))
    tol = {} if DEVICE == "cpu" else {"rtol": 1e-5, "atol": 1e-6}
    for it in range(12):
        x = torch.randn(3, 4, device=DEVICE)
        want, got = eager(x, it), compiled(x, it)
        if DEVICE == "cpu":
            assert torch.equal(want, got), (form, it)
            assert torch.equal(me.weight, mc.weight) and torch.equal(oe.state_dict()["state"][0]["exp_avg"],
                                                                     oc.state_dict()["state"][0]["exp_avg"])
        else:
            torch.testing.assert_close(got, want, **tol)
            torch.testing.assert_close(mc.weight, me.weight, **tol)
    s = compiled.stats
    assert s.captures == 2 and s.replays == 9, (s.captures, s.recaptures)
    assert "it" in s.recaptures[0]


def test_a_factory_the_step_makes_with_requires_grad_stays_keyed_by_value():
    """Not a fill read live (its grad would be a leaf's): each value is a graph, as before."""
    model, opt = _twin()

    def step(x, it):
        w = torch.tensor(float(it), device=x.device, requires_grad=True)
        loss = (model(x) * w).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return w.grad
    f = stepgraph.compile(step, max_captures=3)
    with pytest.warns(UserWarning, match="keeps changing"):
        for it in range(6):
            f(torch.randn(3, 4, device=DEVICE), it)
    assert f.stats.captures == 3


def test_a_seed_the_step_sets_from_its_argument_is_read_live():
    """``torch.manual_seed(1000 + it)`` at the top of the step (a reproducible draw per step):
    reseeded at each replay with the seed of that call, one graph more after the first miss (a CPU
    step; a CUDA step keeps a graph per seed, equal to eager)."""
    def mk(model, opt):
        def step(x, it):
            torch.manual_seed(1000 + it)
            loss = torch.nn.functional.dropout(model(x), 0.5).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    (me, oe), (mc, oc) = _twin(), _twin()
    eager, compiled = mk(me, oe), stepgraph.compile(mk(mc, oc))
    for it in range(10):
        x = torch.randn(3, 4, device=DEVICE)
        got = compiled(x, it)
        if it == 1:
            same_form(oe)   # (on CUDA the capture switched Adam to its capturable form)
        want = eager(x, it)
        assert torch.equal(want, got), it
        torch.manual_seed(it)   # (the loop's own state moves between calls: the step's seed wins)
    assert torch.equal(me.weight, mc.weight)
    if DEVICE == "cpu":
        assert compiled.stats.captures == 2 and compiled.stats.replays == 7, compiled.stats.recaptures
