"""Two threads calling one step function: stepgraph serializes the calls (``StepFunction._lock``).

The step's loss is linear in the model's output, ``(model(x) * c).sum()``, so each batch's
gradient does not depend on the parameters, and plain SGD (no momentum, no weight decay)
updates commute: whatever order the threads interleave in, the final parameters equal an eager
twin that ran the same 100 batches in one order, up to float summation order (1e-6).
"""
import copy
import threading
import time

import pytest
import torch
from torch import nn

import stepgraph

N_PER_THREAD = 50


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def setup():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    topt = torch.optim.SGD(twin.parameters(), lr=0.01)

    def factory(m, o, probe=None):
        def step(x, c):
            if probe is not None:
                probe.enter()
            loss = (m(x) * c).sum()
            loss.backward()
            o.step()
            o.zero_grad()
            if probe is not None:
                probe.leave()
            return loss
        return step
    return model, opt, twin, topt, factory


def batches(seed, n_batches, size=8, bad_every=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_batches):
        x, c = torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)
        if bad_every and i % bad_every == bad_every - 1:
            x = x[:, :7]  # wrong feature count: the matmul raises, as in eager
        out.append((x, c))
    return out


class Probe:
    """Counts how many calls are inside the step (or the graph) at once."""

    def __init__(self):
        self.inside = 0
        self.max_inside = 0
        self.count = 0
        self._mutex = threading.Lock()

    def enter(self):
        with self._mutex:
            self.inside += 1
            self.count += 1
            self.max_inside = max(self.max_inside, self.inside)
        time.sleep(0.0002)  # let the other thread run, were it not blocked

    def leave(self):
        with self._mutex:
            self.inside -= 1


def run_threads(step, work):
    """Run ``work[i]`` (a list of batches) in thread i, started together; collect exceptions."""
    barrier = threading.Barrier(len(work))
    errors = [[] for _ in work]
    done = [0 for _ in work]

    def worker(i):
        barrier.wait()
        for args in work[i]:
            try:
                step(*args)
            except Exception as e:  # recorded: the test decides which ones were expected
                errors[i].append(e)
            done[i] += 1
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock?)"
    assert done == [len(w) for w in work], done
    return errors


def assert_close(model, twin, where):
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        err = (p - q).abs().max().item()
        assert err <= 1e-6, f"{where}: {n} differs from eager by {err:.3g}"


def test_two_threads_100_calls_from_the_start():
    """Warm-up and capture happen under contention too (the threads start together)."""
    model, opt, twin, topt, factory = setup()
    probe = Probe()
    step = stepgraph.compile(factory(model, opt, probe))
    work = [batches(1, N_PER_THREAD), batches(2, N_PER_THREAD)]
    errors = run_threads(step, work)
    assert errors == [[], []], errors
    s = step.stats
    assert s.eager_calls + s.captures + s.replays == 2 * N_PER_THREAD, s
    assert (s.eager_calls, s.captures) == (1, 1), s
    assert probe.max_inside == 1, "two calls ran the step's Python at once"
    # (the step's Python ran at warm-up and capture only: (eager_calls, captures) above; the
    # probe's own counter is a number the step changes, replayed as eager counts it)
    assert probe.count == 2 * N_PER_THREAD
    eager = factory(twin, topt)
    for args in work[0] + work[1]:
        eager(*args)
    assert_close(model, twin, "after 2 x 50 threaded calls")


def test_replays_never_overlap(monkeypatch):
    """After capture, the graph's ``run`` is never entered by two threads at once."""
    model, opt, twin, topt, factory = setup()
    step = stepgraph.compile(factory(model, opt))
    eager = factory(twin, topt)
    warm = batches(3, 2)
    for args in warm:
        step(*args)
        eager(*args)
    entry = step.captures[0]
    probe = Probe()
    inner = entry.run

    def probed_run(inputs):
        probe.enter()
        try:
            return inner(inputs)
        finally:
            probe.leave()
    monkeypatch.setattr(entry, "run", probed_run)
    work = [batches(4, N_PER_THREAD), batches(5, N_PER_THREAD)]
    errors = run_threads(step, work)
    assert errors == [[], []], errors
    assert probe.count == 2 * N_PER_THREAD and probe.max_inside == 1, (probe.count, probe.max_inside)
    s = step.stats
    assert (s.eager_calls, s.captures, s.replays) == (1, 1, 2 * N_PER_THREAD), s
    for args in work[0] + work[1]:
        eager(*args)
    assert_close(model, twin, "after threaded replays")


def test_threads_with_different_shapes_share_two_graphs():
    """Thread A uses batch 8, thread B batch 4: two graphs, interleaved replays."""
    model, opt, twin, topt, factory = setup()
    step = stepgraph.compile(factory(model, opt))
    work = [batches(6, N_PER_THREAD, size=8), batches(7, N_PER_THREAD, size=4)]
    errors = run_threads(step, work)
    assert errors == [[], []], errors
    s = step.stats
    assert s.eager_calls + s.captures + s.replays == 2 * N_PER_THREAD, s
    assert s.captures == 2 and len(step.graphs) == 2, s
    eager = factory(twin, topt)
    for args in work[0] + work[1]:
        eager(*args)
    assert_close(model, twin, "after two shapes from two threads")


def test_failing_calls_in_one_thread_do_not_disturb_the_other():
    """Every 10th call of thread A has a wrong feature count (raises like eager, nothing
    updated); thread B never sees an error, and the good calls' updates all land."""
    model, opt, twin, topt, factory = setup()
    step = stepgraph.compile(factory(model, opt))
    work = [batches(8, N_PER_THREAD, bad_every=10), batches(9, N_PER_THREAD)]
    errors = run_threads(step, work)
    assert len(errors[0]) == N_PER_THREAD // 10 and errors[1] == [], errors
    for e in errors[0]:
        assert isinstance(e, RuntimeError) and "shapes cannot be multiplied" in str(e), e
    s = step.stats
    assert s.eager_calls + s.captures + s.replays + s.failed_captures >= 2 * N_PER_THREAD, s
    eager = factory(twin, topt)
    for args in work[0] + work[1]:
        if args[0].shape[1] == 8:
            eager(*args)
    assert_close(model, twin, "after threaded calls with failures")
