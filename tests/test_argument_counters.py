"""Counters on an object passed to the step (capture/argchanges.py): the Annotated Transformer's
``run_batch(..., train_state)`` does ``train_state.step += 1``, ``samples += batch.src.shape[0]``,
``tokens += batch.ntokens`` (a 0-dim tensor: the int becomes a tensor) and, every
``accum_iter`` calls, ``accum_step += 1``. A TrainState holding a tensor is opened like a batch
object (argtree.py), so the trace ran on a copy and the step was refused ("the step changes
argument #...step ... a replay runs no Python code"). Now an attribute advanced by a value the
graph recomputes (a constant, a shape, a tensor it computes) is written again after each replay
on the call's own object, as eager leaves it; anything else stays refused. Compared with the
same loop run eagerly, bitwise: loss, parameters, counters and their types after every call."""
import dataclasses
import types

import pytest
import torch

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclasses.dataclass
class TrainState:
    step: int = 0
    accum_step: int = 0
    samples: int = 0
    tokens: object = 0     # an int, then a tensor after the first ``+=`` of one


class Batch:
    def __init__(self, x, y):
        self.x, self.y = x, y
        self.ntokens = (y > 0).sum()


def _counters(ts):
    return {k: (type(v), v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(ts).items()}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _run(compiled, states, calls=9, accum_iter=2, keyword=False):
    """``states(call)``: the TrainState of that call (one for all, or a new one per epoch)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run_batch(i, batch, accum_iter, train_state):
        loss = (model(batch.x) - batch.y).pow(2).mean()
        loss.backward()
        train_state.step += 1
        train_state.samples += batch.x.shape[0]
        train_state.tokens += batch.ntokens
        if i % accum_iter == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
            train_state.accum_step += 1
        return loss.detach(), train_state.step   # (read again after the increment)
    fn = stepgraph.compile(run_batch) if compiled else run_batch
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(calls):
        ts = states(i)
        batch = Batch(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g))
        r = fn(i, batch, accum_iter, train_state=ts) if keyword else fn(i, batch, accum_iter, ts)
        out.append((r, _counters(ts), [p.detach().clone() for p in model.parameters()]))
    return out, fn


def _compare(states_eager, states_compiled, **kw):
    want, _ = _run(False, states_eager, **kw)
    got, fn = _run(True, states_compiled, **kw)
    for i, (a, b) in enumerate(zip(got, want)):
        assert _same(a, b), (i, a, b)
    return fn


def test_counters_on_one_train_state_replay_as_eager():
    """The Annotated Transformer's run_epoch: one TrainState for the whole run."""
    one, other = TrainState(), TrainState()
    fn = _compare(lambda i: one, lambda i: other)
    assert fn.stats.replays >= 5, fn.stats
    assert type(other.tokens) is torch.Tensor and other.step == 9 and other.accum_step == 5


def test_a_train_state_holding_a_tensor_from_the_start():
    """Opened like a batch object at the first call already (its counters are the copy's)."""
    one = TrainState(tokens=torch.tensor(0))
    other = TrainState(tokens=torch.tensor(0))
    fn = _compare(lambda i: one, lambda i: other)
    assert fn.stats.replays >= 5, fn.stats


def test_a_new_train_state_each_epoch_is_written_not_the_captured_one():
    """A different object at a later call: the replay writes the call's own object."""
    eager = [TrainState() for _ in range(3)]
    compiled = [TrainState() for _ in range(3)]
    fn = _compare(lambda i: eager[i // 4], lambda i: compiled[i // 4], calls=12)
    assert fn.stats.replays >= 4, fn.stats
    assert [s.step for s in compiled] == [4, 4, 4]


def test_a_counter_on_a_namespace_passed_in():
    one = types.SimpleNamespace(step=0, accum_step=0, samples=0, tokens=torch.tensor(0))
    other = types.SimpleNamespace(step=0, accum_step=0, samples=0, tokens=torch.tensor(0))
    fn = _compare(lambda i: one, lambda i: other)
    assert fn.stats.replays >= 5, fn.stats


def test_an_attribute_set_to_what_no_replay_computes_is_still_refused():
    """``state.last = <a Python value read from a global list>``: no graph recomputes it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = ["a", "b", "c", "d"]

    @stepgraph.compile
    def step(i, x, state):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        state.step += 1
        state.last = names[len(state.seen) % 4]
        state.seen = state.seen + (1,)
        return loss.detach()
    state = TrainState(tokens=torch.tensor(0))
    state.seen, state.last = (), ""
    with pytest.raises(stepgraph.CaptureError) as e:
        for i in range(3):
            step(i, torch.randn(4, 3), state)
    assert "passed to it" in str(e.value) and "a replay runs no Python code" in str(e.value)
    assert "argument #2" in str(e.value)


def test_a_train_state_passed_by_keyword_is_still_refused():
    """A replay finds the object it writes by position among the call's arguments; passed by
    keyword it is refused as before, not left silently unchanged."""
    with pytest.raises(stepgraph.CaptureError) as e:
        _run(True, lambda i, s=TrainState(tokens=torch.tensor(0)): s, calls=3, keyword=True)
    assert "passed to it" in str(e.value) and "a replay runs no Python code" in str(e.value)
