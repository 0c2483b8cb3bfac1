"""Faults inside the step: nothing is lost, the exception reaches the caller unchanged, and
training goes on exactly as eager PyTorch would.

Every test drives a stepgraph step next to an eager twin (a deepcopy of the model with the same
optimizer) that raises at the same point. After every call both must hold bitwise-equal
parameters, ``.grad`` tensors (presence and value) and optimizer state, and the exception each
raised must have the same type and message (for stepgraph: the very object the step raised).

Faults are injected

* in user code (the step's Python) at the warm-up call (call 1) and the capturing call (call 2):
  before the forward, inside the backward (a tensor hook), after ``backward()`` and after
  ``opt.step()``; as ``ValueError``, a simulated OOM (``torch.OutOfMemoryError`` and a
  ``RuntimeError("CUDA out of memory...")``) and ``KeyboardInterrupt``;
* at replay time, where no user Python runs: by making the captured entry's ``run`` raise, and
  by an input that makes an aten op inside the graph fail (a label index out of range in the
  loss; an out-of-range ``index_select`` after the optimizer update).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

EXCEPTIONS = {
    "ValueError": lambda: ValueError("user code failed"),
    "OutOfMemoryError": lambda: torch.OutOfMemoryError("simulated"),
    "RuntimeError-oom": lambda: RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)"),
    "KeyboardInterrupt": lambda: KeyboardInterrupt(),
}
POINTS = ("start", "in_backward", "after_backward", "after_opt")


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


# ---- harness -----------------------------------------------------------------------------
class Fault:
    """Raises a prepared exception the first time the step reaches ``point`` while armed."""

    def __init__(self):
        self.point = None
        self.exc = None
        self.fired = []

    def arm(self, point, exc):
        self.point, self.exc = point, exc

    def disarm(self):
        self.point = self.exc = None

    def maybe(self, point):
        # Read through getattr: stepgraph guards the Python values a step reads (self.point
        # would be one), and a fault injector must be as invisible to them as a real fault.
        if getattr(self, "point") == point:
            exc = getattr(self, "exc")
            setattr(self, "point", None)
            setattr(self, "exc", None)
            getattr(self, "fired").append(point)
            raise exc


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def batch(k, n=8):
    g = torch.Generator().manual_seed(5000 + k)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def faulty_step(model, opt, fault):
    model[0].weight.register_hook(lambda g: fault.maybe("in_backward"))

    def step(x, y):
        fault.maybe("start")
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        fault.maybe("after_backward")
        opt.step()
        fault.maybe("after_opt")
        opt.zero_grad()
        return loss
    return step


def _call(f, args):
    try:
        return f(*args), None
    except BaseException as e:  # KeyboardInterrupt included: it must not escape the test
        return None, e


class Twin:
    """A stepgraph step and its eager twin, each with its own Fault injector."""

    def __init__(self, factory=faulty_step, opt_cls=torch.optim.Adam, opt_kw=None, **compile_kw):
        opt_kw = dict(lr=1e-2) if opt_kw is None else opt_kw
        self.model = make_model()
        self.twin = copy.deepcopy(self.model)
        self.opt = opt_cls(self.model.parameters(), **opt_kw)
        self.topt = opt_cls(self.twin.parameters(), **copy.deepcopy(opt_kw))
        self.fault, self.tfault = Fault(), Fault()
        self.step = stepgraph.compile(factory(self.model, self.opt, self.fault), **compile_kw)
        self.eager = factory(self.twin, self.topt, self.tfault)
        self.calls = 0

    def counts(self):
        s = self.step.stats
        return s.eager_calls, s.captures, s.replays

    def __call__(self, *args, fault=None):
        """One call of both; ``fault=(point, make_exc)`` arms both injectors for this call.

        Returns (stepgraph's exception, eager's exception); asserts they agree and that the
        state agrees afterwards."""
        self.calls += 1
        injected = None
        if fault is not None:
            point, make_exc = fault
            injected = make_exc()
            self.fault.arm(point, injected)
            self.tfault.arm(point, make_exc())
        clones = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got, gexc = _call(self.step, args)
        want, wexc = _call(self.eager, clones)
        self.fault.disarm()
        self.tfault.disarm()
        where = f"call {self.calls} (counts {self.counts()}, recaptures {self.step.stats.recaptures})"
        if wexc is None:
            assert gexc is None, f"{where}: stepgraph raised {type(gexc).__name__}: {gexc} where eager returned"
            assert torch.equal(got, want), f"{where}: result {got} != eager {want}"
        else:
            assert gexc is not None, f"{where}: eager raised {type(wexc).__name__}: {wexc}; stepgraph returned"
            assert type(gexc) is type(wexc), f"{where}: stepgraph raised {type(gexc)!r}, eager {type(wexc)!r}"
            assert str(gexc) == str(wexc), f"{where}: message {str(gexc)!r} != eager {str(wexc)!r}"
            if injected is not None and self.fault.fired:
                assert gexc is injected, f"{where}: the injected exception was replaced by {gexc!r}"
        self.check_state(where)
        return gexc, wexc

    def check_state(self, where=""):
        a, b = self.model.state_dict(), self.twin.state_dict()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{where}: {k} differs from eager"
        for (n, p), q in zip(self.model.named_parameters(), self.twin.parameters()):
            assert (p.grad is None) == (q.grad is None), (
                f"{where}: {n}.grad is {'None' if p.grad is None else 'a tensor'}, "
                f"eager's is {'None' if q.grad is None else 'a tensor'}")
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), f"{where}: {n}.grad differs from eager"
            sa, sb = self.opt.state.get(p, {}), self.topt.state.get(q, {})
            assert sa.keys() == sb.keys(), f"{where}: optimizer state keys of {n}: {sa.keys()} vs {sb.keys()}"
            for k in sa:
                if isinstance(sa[k], torch.Tensor):
                    assert torch.equal(sa[k], sb[k]), f"{where}: optimizer state {n}[{k!r}] differs"
                else:
                    assert sa[k] == sb[k], f"{where}: optimizer state {n}[{k!r}] differs"


def snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in opt.state.values()])


def same_snapshot(a, b):
    (pa, sa), (pb, sb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(pa, pb)) and len(sa) == len(sb)
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor)
                                                  else x[k] == y[k] for k in x) for x, y in zip(sa, sb)))


# ---- faults in user code at warm-up and at capture -----------------------------------------
# Every injection point at both phases; every exception type at both phases (the full
# 2 x 4 x 4 product costs ~30 s of captures on 2 cores, and the type matters only as
# Exception vs BaseException, so each point gets a rotating type, Ctrl-C at capture everywhere).
USER_FAULTS = [
    ("warmup", "start", "ValueError"),
    ("warmup", "in_backward", "OutOfMemoryError"),
    ("warmup", "after_backward", "KeyboardInterrupt"),
    ("warmup", "after_opt", "RuntimeError-oom"),
    ("capture", "start", "KeyboardInterrupt"),
    ("capture", "in_backward", "KeyboardInterrupt"),
    ("capture", "after_backward", "KeyboardInterrupt"),
    ("capture", "after_opt", "KeyboardInterrupt"),
    ("capture", "in_backward", "ValueError"),
    ("capture", "after_backward", "OutOfMemoryError"),
    ("capture", "after_opt", "RuntimeError-oom"),
]


@pytest.mark.parametrize("phase,point,exc", USER_FAULTS)
def test_user_fault(phase, point, exc):
    """A fault at call 1 (warm-up) or call 2 (capture): same exception as eager, same state, and
    the following calls capture/replay with eager parity."""
    t = Twin()
    at = 1 if phase == "warmup" else 2
    for k in range(1, at + 4):  # the fault, then 3 more calls
        gexc, wexc = t(*batch(k), fault=(point, EXCEPTIONS[exc]) if k == at else None)
        if k == at:
            assert wexc is not None and gexc is not None
            assert t.fault.fired == [point], t.fault.fired
    # after the fault the step is captured again and replays (not stuck in eager or failing)
    ec, cap, rep = t.counts()
    assert cap >= 1 and rep >= 1, (t.counts(), t.step.stats)
    # A warm-up that raised created no optimizer state, so stepgraph warms up again (<= 2 eager).
    assert t.step.stats.eager_calls <= 2, t.step.stats


@pytest.mark.parametrize("opt_name", ["sgd_momentum"])
def test_warmup_fault_before_optimizer_state_exists(opt_name):
    """The warm-up call fails before ``opt.step()``: the optimizer has no state yet when the next
    call runs. That call must still work like eager (no spurious CaptureError)."""
    opt_cls, kw = {"sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
                   "adagrad": (torch.optim.Adagrad, dict(lr=0.05))}[opt_name]
    t = Twin(opt_cls=opt_cls, opt_kw=kw)
    t(*batch(1), fault=("start", EXCEPTIONS["ValueError"]))
    for k in range(2, 7):
        t(*batch(k))
    assert t.counts()[2] >= 1, t.step.stats


def test_fault_during_recapture_keeps_the_old_graph():
    """A fault while capturing a second signature (a new batch size) leaves the first graph
    intact: the old signature still replays, the new one captures on its next call."""
    t = Twin()
    for k in range(1, 4):
        t(*batch(k))
    assert t.counts() == (1, 1, 1)
    # a fault before any work: nothing changed, so the first graph's signature still holds
    # (a fault after backward() would leave .grad set, a different signature, as in eager)
    t(*batch(4, n=4), fault=("start", EXCEPTIONS["KeyboardInterrupt"]))
    assert t.step.stats.failed_captures == 1
    t(*batch(5))  # old signature: replays the first graph
    assert t.counts() == (1, 1, 2), t.step.stats
    for k in range(6, 9):
        t(*batch(k, n=4))
    assert t.step.stats.captures >= 2 and len(t.step.graphs) >= 2
    t(*batch(9))
    t(*batch(10, n=4))


@pytest.mark.parametrize("exc", ["ValueError", "KeyboardInterrupt"])
def test_user_fault_at_capture_does_not_disable_capture_for_good(exc):
    """``on_capture_error="eager"`` is about steps that cannot be captured; an exception raised
    by the user's own code (or Ctrl-C) during the capturing call is not such a failure: later
    calls must still be captured and replayed."""
    t = Twin(on_capture_error="eager")
    t(*batch(1))
    t(*batch(2), fault=("after_backward", EXCEPTIONS[exc]))
    for k in range(3, 7):
        t(*batch(k))
    assert t.step.stats.captures >= 1 and t.step.stats.replays >= 1, t.step.stats


# ---- faults at replay time ---------------------------------------------------------------
@pytest.mark.parametrize("exc", list(EXCEPTIONS))
def test_replay_fault_in_run(exc, monkeypatch):
    """The captured graph's ``run`` raises (as a device OOM or Ctrl-C at launch would): the caller
    gets that exception, nothing is updated, and the same graph replays afterwards."""
    t = Twin()
    for k in range(1, 4):
        t(*batch(k))
    assert t.counts() == (1, 1, 1)
    entry = t.step.captures[0]
    before = snapshot(t.model, t.opt)
    injected = EXCEPTIONS[exc]()

    def failing_run(inputs):
        raise injected
    monkeypatch.setattr(entry, "run", failing_run)
    gexc, wexc = t(*batch(4), fault=("start", EXCEPTIONS[exc]))
    assert gexc is injected
    assert same_snapshot(snapshot(t.model, t.opt), before), "a failed replay changed the state"
    monkeypatch.undo()
    for k in range(5, 8):
        t(*batch(k))
    assert t.step.stats.captures == 1, t.step.stats  # nothing changed: no recapture needed
    assert t.step.stats.recaptures == []


@pytest.mark.parametrize("bad_label", [99, -7])
def test_replay_aten_failure_in_loss(bad_label):
    """A label out of range makes the loss op fail inside the replayed graph: same exception as
    eager, no parameter or optimizer state touched (the failing op precedes every update)."""
    t = Twin()
    for k in range(1, 4):
        t(*batch(k))
    assert t.counts() == (1, 1, 1)
    before = snapshot(t.model, t.opt)
    x, y = batch(4)
    y[3] = bad_label
    gexc, wexc = t(x, y)
    assert isinstance(gexc, (IndexError, RuntimeError)), gexc
    assert t.counts() == (1, 1, 2)  # it was a replay (counted), not a recapture
    assert same_snapshot(snapshot(t.model, t.opt), before)
    for k in range(5, 8):
        t(*batch(k))
    assert t.counts() == (1, 1, 5)


def aux_step(where):
    """A step that also gathers rows of x with a user index tensor, at ``where``."""
    def factory(model, opt, fault):
        def step(x, y, idx):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            aux = x.index_select(0, idx) if where == "before_opt" else None
            opt.step()
            aux = x.index_select(0, idx) if where == "before_zero_grad" else aux
            opt.zero_grad()
            aux = x.index_select(0, idx) if where == "after_zero_grad" else aux
            return loss + aux.sum()
        return step
    return factory


@pytest.mark.parametrize("where", ["before_opt", "before_zero_grad", "after_zero_grad"])
def test_replay_aten_failure_mid_graph(where):
    """An op after the backward (and after the optimizer update) fails inside the replay.

    Eager leaves exactly what ran before the failing op: updated parameters and optimizer state
    and, before ``zero_grad()``, the fresh ``.grad`` tensors, which the next call's backward
    accumulates into. stepgraph must leave the same: parameters not half-updated, optimizer
    state equal, ``.grad`` equal (presence and value), and the next 3 calls equal to eager."""
    t = Twin(factory=aux_step(where))
    good = torch.tensor([0, 5])
    for k in range(1, 4):
        t(*batch(k), good)
    assert t.counts() == (1, 1, 1)
    gexc, wexc = t(*batch(4), torch.tensor([0, 99]))
    assert isinstance(gexc, IndexError), gexc
    for k in range(5, 8):
        t(*batch(k), good)
