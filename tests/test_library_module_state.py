"""torchmetrics metrics updated inside the step (Lightning's ``self.train_acc(preds, y)`` idiom; a
loop's ``acc.update(preds, y)``), read, computed and reset outside it at an epoch's end.

Found by helper-76 (session 32), silently wrong before:
- ``reset()`` outside the step binds fresh state tensors; the graph kept updating the old ones
  (attrstores._Synced now copies a fresh tensor of the same layout into the graph's constant);
- ``update`` sets ``self._computed = None`` and counts ``self._update_count += 1``, Python a replay
  did not redo: ``compute()`` returned the value cached at the capture (modstate.py);
- list states (``BinaryAUROC``'s ``preds``/``target``) stopped growing at the capture;
- ``RunningMean``'s window slots share its default tensor: the capture copied the step's value
  into the default ``reset()`` restores from.
"""
import pytest
import torch

import stepgraph

torchmetrics = pytest.importorskip("torchmetrics")
pytestmark = pytest.mark.usefixtures("one_thread")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _twin(make_metrics, compiled, device, called=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = {k: m.to(device) for k, m in make_metrics().items()}

    def step(x, y):
        logits = model(x).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for name, m in metrics.items():
            f = m if called else m.update   # (called: Metric.forward, Lightning's ``self.train_acc(p, y)``)
            f(loss.detach()) if name.startswith("mean") else f(logits.detach().sigmoid(), y.long())
        return loss.detach()
    return (stepgraph.compile(step) if compiled else step), metrics, model


def _run(make_metrics, n=9, reset_every=3, compute_every=1, device="cpu", called=False):
    got = []
    for compiled in (False, True):
        fn, metrics, model = _twin(make_metrics, compiled, device, called)
        g = torch.Generator().manual_seed(1)
        seen = []
        for i in range(n):
            x, y = torch.randn(6, 4, generator=g).to(device), (torch.rand(6, generator=g) > 0.5).float().to(device)
            loss = fn(x, y)
            row = [loss] + [t.clone() for m in metrics.values() for t in _states(m)]
            if (i + 1) % compute_every == 0:
                row += [m.compute().clone() for m in metrics.values()]
            row += [m._update_count for m in metrics.values()]
            seen.append(row)
            if (i + 1) % reset_every == 0:
                for m in metrics.values():
                    m.reset()
        got.append((fn, seen, [p.detach().clone() for p in model.parameters()]))
    (_, want, want_p), (fn, seen, params) = got
    for i, (a, b) in enumerate(zip(seen, want)):
        assert len(a) == len(b), i
        for x, y in zip(a, b):
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), (i, a, b)
    assert all(torch.equal(p, q) for p, q in zip(params, want_p))
    return fn


def _states(m):
    for name in m._defaults:
        v = getattr(m, name)
        yield from (v if isinstance(v, list) else [v])


@pytest.mark.parametrize("device", DEVICES)
def test_a_reset_outside_the_step_is_what_the_next_replay_updates(device):
    fn = _run(lambda: {"mean": torchmetrics.MeanMetric(), "acc": torchmetrics.classification.BinaryAccuracy(),
                       "f1": torchmetrics.classification.BinaryF1Score()}, compute_every=3, device=device)
    # (the classification metrics validate their targets by default: ``torch.unique(target)``'s
    # size, one label or both in a batch, is a shape a graph is keyed by)
    assert fn.stats.captures <= 2 and fn.stats.replays >= 6, fn.stats


@pytest.mark.parametrize("device", DEVICES)
def test_compute_after_every_call_sees_each_replays_update(device):
    fn = _run(lambda: {"mean": torchmetrics.MeanMetric(),
                       "acc": torchmetrics.classification.BinaryAccuracy(validate_args=False)}, reset_every=100, device=device)
    assert fn.stats.captures == 1 and fn.stats.replays == 7, fn.stats


@pytest.mark.parametrize("device", DEVICES)
def test_list_states_grow_at_every_replay(device):
    fn = _run(lambda: {"auroc": torchmetrics.classification.BinaryAUROC(validate_args=False),
                       "ap": torchmetrics.classification.BinaryAveragePrecision(validate_args=False)},
              n=8, reset_every=4, compute_every=2, device=device)
    assert fn.stats.captures == 1 and fn.stats.replays == 6, fn.stats


@pytest.mark.parametrize("device", DEVICES)
def test_running_mean_keeps_its_window_and_its_default(device):
    fn = _run(lambda: {"mean": torchmetrics.aggregation.RunningMean(window=3)}, n=7, reset_every=100, device=device)
    assert fn.stats.captures >= 1   # (its window slot is a decision on a count: a graph per slot)


@pytest.mark.parametrize("device", DEVICES)
def test_a_metric_called_as_a_module_is_captured_again_once_per_kind_of_cache(device):
    """Lightning's ``self.train_acc(preds, y)``: ``Metric.forward`` writes ``_forward_cache`` before
    reading it, and ``reset()`` sets it to None. Its key told None from a tensor's dtype and shape
    even once known overwritten: 4 graphs for 9 calls with a reset every 3. Now 2 (helper-76)."""
    got = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = torchmetrics.classification.BinaryAccuracy(validate_args=False).to(device)

        def step(x, y):
            logits = model(x).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach(), acc(logits.detach().sigmoid(), y.long())
        fn = stepgraph.compile(step) if compiled else step
        g = torch.Generator().manual_seed(1)
        seen = []
        for i in range(9):
            x, y = torch.randn(6, 4, generator=g).to(device), (torch.rand(6, generator=g) > 0.5).float().to(device)
            seen.append(fn(x, y) + (acc.tp.clone(),))
            if i % 3 == 2:
                seen.append((acc.compute().clone(),))
                acc.reset()
        got.append((fn, seen))
    (_, want), (fn, seen) = got
    assert all(torch.equal(a, b) for r, w in zip(seen, want) for a, b in zip(r, w))
    assert fn.stats.captures <= 2, fn.stats


def test_a_metric_called_as_a_module_counts_its_updates_across_resets():
    """``self.train_acc(preds, y)`` (Metric.forward) in the step, reset each epoch outside it: the
    graph captured just after a reset also set ``_update_count`` as a constant of the library
    module (its counter slot is the module's __dict__, which the check did not match), written over
    the tracked count at every replay: 2, 2, 2 where eager counts 3, 1, 2 (helper-88 F5)."""
    _run(lambda: {"mean": torchmetrics.MeanMetric(), "acc": torchmetrics.classification.BinaryAccuracy()},
         reset_every=3, called=True)


@pytest.mark.parametrize("device", DEVICES)
def test_a_metric_updated_by_name_and_computed_between_calls_follows_eager(device):
    """``mean.update(loss.detach())`` on a closure's metric, ``mean.compute()`` between calls:
    torchmetrics' ``update`` wrapper sets ``self._computed = None`` over the tensor ``compute()``
    cached, a literal a replay writes again. It was refused, with a fix inside torchmetrics
    (helper-88, session 35)."""
    got = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mean = torchmetrics.MeanMetric().to(device)

        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean.update(loss.detach())
            return loss.detach()
        fn = stepgraph.compile(step) if compiled else step
        g = torch.Generator().manual_seed(1)
        seen = []
        for i in range(7):
            seen.append((fn(torch.randn(3, 4, generator=g).to(device)), mean.compute().clone(), mean._update_count))
            if i == 3:
                mean.reset()
        got.append((fn, seen))
    (_, want), (fn, seen) = got
    for a, b in zip(seen, want):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2], (a, b)
    assert fn.stats.captures <= 2 and fn.stats.replays >= 4, fn.stats


MEAN, CAT, MAX = (torchmetrics.MeanMetric(), torchmetrics.CatMetric(), torchmetrics.MaxMetric()) \
    if torchmetrics else (None, None, None)


class _Holder(torch.nn.Module):
    def update_metrics(self, loss):
        MEAN.update(loss)
        CAT.update(loss)
        MAX.update(loss)


update_metrics = _Holder().update_metrics   # (a bound method of a module, in a global)


def test_metrics_a_bound_method_in_a_global_updates_count_every_replay():
    """The step calls ``update_metrics(loss)``, a module's bound method kept in a global, whose
    code updates module-level metrics: they were not found as state (the bound method's code was
    not walked), so only one metric's Python ``_update_count`` advanced at replays (6 2 2 where
    eager counts 6 6 6), silently (helper-92 F7)."""
    import torch.nn.functional as F
    for m in (MEAN, CAT, MAX):
        m.reset()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    @stepgraph.compile
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        update_metrics(loss.detach())
        return loss.detach()
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        step(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))
    assert [m._update_count for m in (MEAN, CAT, MAX)] == [6, 6, 6]
    assert len(CAT.value) == 6 and step.stats.replays == 4
