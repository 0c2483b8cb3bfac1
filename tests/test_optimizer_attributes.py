"""An optimizer's own number the step sets from values library code reads itself: pytorch_optimizer's
GSAM, run as its README writes the loop (``opt.step(); sched.step(); opt.update_rho_t()`` in the
step), sets ``self.rho_t`` from the lr its scheduler set. Replays left the capture's ``rho_t``:
the next steps perturbed with the wrong radius, silently (helper-93 F2). A float the graph
computes is now written after each replay; one it cannot follow is refused."""
import pytest
import torch
import torch.nn.functional as F

import stepgraph

_LIBRARY = '''
import torch


class RhoSGD(torch.optim.SGD):   # (GSAM's rho_t, from the lr: ProportionScheduler)
    def __init__(self, params, lr, scheduler_lr=None):
        super().__init__(params, lr=lr)
        self.rho_t, self.lr_of = 0.05, scheduler_lr

    def update_rho_t(self):
        lr = self.lr_of() if self.lr_of is not None else self.param_groups[0]["lr"]
        self.rho_t = 0.01 + 0.09 * lr / 0.05
        return self.rho_t

    @torch.no_grad()
    def perturb(self):
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(p.grad, alpha=-self.rho_t)


class Preconditioned(torch.optim.Optimizer):   # (SOAP: new eigenbases state['Q'] every 2nd step)
    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                st["n"] = st.get("n", 0) + 1
                if "Q" not in st or st["n"] % 2 == 0:
                    st["Q"] = [torch.eye(p.shape[0]) * (1.0 + 0.1 * st["n"])]
                p.sub_(st["Q"][0] @ p.grad.reshape(p.shape[0], -1).reshape(p.shape) * g["lr"]
                       if p.dim() == 2 else p.grad * g["lr"])
'''


@pytest.fixture
def lib(as_library):
    return as_library("rholib", _LIBRARY)


def _run(lib, compiled, via_scheduler, calls=7):
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 3)
    opt = lib.RhoSGD(m.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    if via_scheduler:
        opt.lr_of = lambda: sched.get_last_lr()[0]

    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.perturb()
        opt.step()
        if via_scheduler:
            sched.step()
        opt.update_rho_t()
        return loss.detach()
    f = stepgraph.compile(step) if compiled else step
    g = torch.Generator().manual_seed(3)
    out = []
    for k in range(calls):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        out.append((f(x, y), opt.rho_t))
        if not via_scheduler:
            for group in opt.param_groups:
                group["lr"] = (0.02, 0.05)[k % 2]   # (two values: a graph each, replayed in turn)
    return out, m.weight.detach().clone(), getattr(f, "stats", None)


def test_a_number_an_optimizer_computes_from_its_lr_is_written_after_each_replay(lib):
    """The lr alternating between two values: each graph's ``rho_t`` is written after its replay
    (it stayed at the value the other graph's call left)."""
    (want, we, _), (got, wg, st) = _run(lib, False, False), _run(lib, True, False)
    assert [r for _, r in want] == [r for _, r in got]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(want, got)) and torch.equal(we, wg)
    assert st.replays >= 4, st


def test_a_number_set_from_a_scheduler_the_step_steps_is_refused_as_eager_left_it(lib):
    want = _run(lib, False, True, calls=2)
    with pytest.raises(stepgraph.CaptureError, match="lr"):
        _run(lib, True, True, calls=2)


def test_a_graph_reading_a_list_of_tensors_the_optimizer_rebound_since_is_not_replayed(lib):
    """SOAP rebinds ``state['Q']`` to a new list every preconditioning step; that call is refused
    (run eagerly), and the next replayed the graph of the call before, holding the old Q tensors
    as constants: weights drifted from eager, silently (helper-93 F3)."""
    def run(compiled):
        torch.manual_seed(0)
        m = torch.nn.Linear(5, 5)
        opt = lib.Preconditioned(m.parameters())

        def step(x):
            loss = m(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        f = stepgraph.compile(step) if compiled else step
        g = torch.Generator().manual_seed(3)
        for _ in range(7):
            x = torch.randn(4, 5, generator=g)
            try:
                f(x)
            except stepgraph.CaptureError:
                pass   # (a refused call ran eagerly to its end, as the loop may go on)
        return m.weight.detach().clone()
    assert torch.equal(run(False), run(True))
