"""Batches a step takes with ``next(iterator)`` are taken before each call and fed in as inputs
(capture/fetches.py): NVlabs EDM's training loop (``images, labels = next(dataset_iterator)``
once per accumulation round) was refused. Each test runs the step eagerly and under stepgraph
from the same seed and compares every loss and parameter bitwise."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph
from stepgraph import CaptureError

from random import random as coin   # noqa: E402  (as a library imports it: test_a_coin_imported_...)

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


class Noisy(torch.utils.data.Dataset):
    """A dataset whose ``__getitem__`` draws from torch's global generator (an augmentation)."""
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i] + 0.1 * torch.rand(())


def _edm_like(use_sg, epochs=3, rounds=2, dataset=None, shuffle=True):
    """EDM's step: ``rounds`` batches per call from a loader the loop makes anew each epoch
    (a global of the test's module reached through a dict), CPU noise drawn between them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    data = torch.randn(30, 4)
    dl = torch.utils.data.DataLoader(dataset or torch.utils.data.TensorDataset(data), batch_size=4, shuffle=shuffle)
    loop = {}

    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(rounds):
            batch = next(loop["it"])
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            noise = torch.randn_like(x)                     # (EDM's sigma and noise: drawn here)
            loss = net(x + 0.1 * noise).square().mean()
            loss.backward()
            total = total + loss.detach()
        opt.step()
        return total
    f = stepgraph.compile(step) if use_sg else step
    losses = []
    for _ in range(epochs):
        loop["it"] = iter(dl)   # a new iterator each epoch: read through its source at each call
        for _ in range(len(dl) // rounds):
            losses.append(f())
    return losses, [p.detach().clone() for p in net.parameters()], f


def test_edm_batches_per_round_are_eagers_bitwise():
    want, pw, _ = _edm_like(False)
    got, pg, f = _edm_like(True)
    assert len(got) == len(want) == 12
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert all(torch.equal(a, b) for a, b in zip(pg, pw))
    s = f.stats
    # call 2 found the next() (a warm-up), 3 captured; the partial last batch (2 of 30) has its
    # own graph; every other call of the three epochs replays
    assert s.captures == 2 and s.replays == 8 and s.eager_calls == 2, s
    assert "taken before each call and fed in as inputs (2 per call): next(loop['it'])" in f.explain()


def test_a_loader_that_draws_in_each_batch_after_the_step_drew_is_still_refused():
    """Taken first, the dataset's draw for the second batch would come before the step's noise
    for the first: not eager's order, so the refusal stands."""
    with pytest.raises(CaptureError, match="takes its data with next"):
        _edm_like(True, epochs=1, dataset=Noisy(torch.randn(30, 4)))


def test_a_loader_that_draws_with_one_batch_per_call_is_fed_in():
    """One next() per call, first in the step: its draws come before the step's own, as in eager."""
    data = torch.randn(30, 4, generator=torch.Generator().manual_seed(1))
    want, pw, _ = _edm_like(False, rounds=1, dataset=Noisy(data))
    got, pg, f = _edm_like(True, rounds=1, dataset=Noisy(data))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(pg, pw))
    assert f.stats.replays >= 15, f.stats


def test_an_iterator_made_inside_the_step_is_refused():
    net = nn.Linear(4, 1)
    # (no shuffle: torch 2.11's tracer fails on the RandomSampler's torch.Generator, then runs eagerly)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)

    def step():
        (x,) = next(iter(dl))
        loss = net(x).square().mean()
        loss.backward()
        return loss.detach()
    f = stepgraph.compile(step)
    f()
    with pytest.raises(CaptureError, match="takes its data with next"):
        f()


def test_a_call_taking_fewer_batches_warns_that_they_were_skipped():
    net = nn.Linear(4, 1)
    data = iter([torch.randn(2, 4) for _ in range(20)])
    cfg = {"rounds": 2}

    def step():
        loss = 0.0
        for _ in range(cfg["rounds"]):
            loss = loss + net(next(data)).square().mean()
        loss.backward()
        return loss.detach()
    f = stepgraph.compile(step)
    for _ in range(3):
        f()
    cfg["rounds"] = 1
    with pytest.warns(UserWarning, match="took 1 batch\\(es\\) fewer than before from data"):
        f()


def test_a_trace_undone_after_next_gives_the_rerun_the_same_batch(monkeypatch):
    """A capture that fails after the step took its batch is undone and the call runs eagerly
    from its start (failures.py); the iterator cannot give that batch twice, so the rerun took
    the next one: a batch skipped, silently. Now the rerun gets the batch the trace took (a copy
    made before the step wrote into it: the mixup below is in place)."""
    from stepgraph.capture import trace as trace_mod

    def run(use_sg, fail=False):
        torch.manual_seed(0)
        net = nn.Linear(4, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        data = iter([torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)])

        def step():
            x = next(data)
            x.mul_(0.5)                       # (timm's mixup writes its batch in place)
            loss = net(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        f = stepgraph.compile(step) if use_sg else step
        out = [f()]
        if fail:   # the next call's trace fails after its matmul, inside torch
            orig = trace_mod._DispatchCheckMode.__torch_dispatch__

            def dispatch(self, func, types, args=(), kwargs=None):
                r = orig(self, func, types, args, kwargs)
                if "addmm" in str(func):
                    torch._check(False, lambda: "injected failure inside the tracer")
                return r
            monkeypatch.setattr(trace_mod._DispatchCheckMode, "__torch_dispatch__", dispatch)
            with pytest.warns(UserWarning, match="could not be captured"):
                out.append(f())
            monkeypatch.undo()
        out += [f() for _ in range(6 - len(out))]
        return out, [p.detach().clone() for p in net.parameters()]
    want, pw = run(False)
    got, pg = run(True, fail=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert all(torch.equal(a, b) for a, b in zip(pg, pw))


TEACHER_FORCING_RATIO = 0.5   # (a global float: read live, guarded where a decision uses it)


def _drawing(use_sg, body, calls=12, seed=3, **compile_kw):
    """``body(net, x)`` draws on the host inside the step; eager and stepgraph from the same
    seeds; returns the losses, the parameters, numpy's and random's state after, the step."""
    import random

    import numpy as np
    random.seed(seed), np.random.seed(seed), torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x, y):
        loss = F.mse_loss(body(net, x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    f = stepgraph.compile(step, **compile_kw) if use_sg else step
    g = torch.Generator().manual_seed(0)
    out = [f(torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)) for _ in range(calls)]
    return out, [p.detach().clone() for p in net.parameters()], (random.random(), np.random.rand()), f


def _same_as_eager(body, compile_kw=None, **kw):
    want, pw, rw, _ = _drawing(False, body, **kw)
    got, pg, rg, f = _drawing(True, body, **kw, **(compile_kw or {}))
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert all(torch.equal(a, b) for a, b in zip(pg, pw))
    assert rg == rw   # (random's and numpy's streams left where eager left them)
    return f


def test_a_teacher_forcing_coin_picks_one_of_two_graphs():
    """The PyTorch seq2seq tutorial's ``train()``: ``use_teacher_forcing = True if random.random()
    < teacher_forcing_ratio else False`` (refused before: a replay would reuse the first coin)."""
    import random

    def body(net, x):
        use_teacher_forcing = True if random.random() < TEACHER_FORCING_RATIO else False
        return net(x) if use_teacher_forcing else net(torch.tanh(net(x)))
    f = _same_as_eager(body)
    assert f.stats.captures == 2 and f.stats.replays == 8, f.stats
    assert "random.random() at" in f.explain()


def test_a_coin_imported_with_from_random_import_random_is_drawn_like_random_random():
    """x-transformers' layer dropout and denoising-diffusion-pytorch's self-conditioning draw with
    ``from random import random``: the name bound in the library's module, where the patch on
    ``random`` never reached -- the capture's coin was baked into every replay, silently (helper-77)."""
    def body(net, x):
        return net(x) if coin() < 0.5 else net(torch.tanh(net(x)))
    f = _same_as_eager(body)
    assert f.stats.captures == 2 and f.stats.replays == 8, f.stats


def test_a_mixing_weight_drawn_with_numpy_is_read_live():
    """mixup's ``lam = np.random.beta(alpha, alpha)`` mixing the batch with its reverse: the value
    enters the graph (live from its first change), one graph for every call."""
    import numpy as np

    def body(net, x):
        lam = np.random.beta(0.4, 0.4)
        return net(lam * x + (1 - lam) * x.flip(0))
    f = _same_as_eager(body)
    assert f.stats.replays >= 8, f.stats


def test_a_draw_only_one_branch_makes_is_given_back_on_the_other():
    """timm's mixup draws its weight only when its coin says mix: taken first, that draw is
    given back (random's and numpy's state rewound) on a call whose coin says no, eager's or a
    replay's."""
    import numpy as np

    def body(net, x):
        lam = 1.0
        if np.random.rand() < 0.5:
            lam = np.random.beta(1.0, 1.0)
        return net(lam * x + (1 - lam) * x.flip(0))
    f = _same_as_eager(body, seed=0)   # (the first coin says no: the plan grows at the first mix)
    assert f.stats.replays >= 5 and f.stats.captures <= 4, f.stats


def test_gan_noise_drawn_with_numpy_is_an_input():
    """PyTorch-GAN's every model: ``z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0],
    opt.latent_dim))))`` in the loop body. A float array drawn with constant arguments is taken
    before each call and fed in as a numpy argument is (its memory the graph's input): was
    refused (a replay would reuse the capture's noise). ``torch.FloatTensor(noise)`` asks the
    array's ``__index__`` first (is it a size?), which numpy refuses without reading: no value
    read, so no graph per draw."""
    import numpy as np

    def body(net, x):
        z = torch.FloatTensor(np.random.normal(0, 1, (x.shape[0], 4)))
        return net(x + z)
    f = _same_as_eager(body)
    assert f.stats.captures == 1 and f.stats.replays >= 9, f.stats


def test_drawn_indices_stay_refused():
    """``np.random.randint(0, n, size=b)``: indices the step reads in Python to pick items (a
    replay buffer's): not taken before the call; refused as before."""
    import numpy as np
    rows = [torch.randn(4) for _ in range(10)]

    def body(net, x):
        idx = np.random.randint(0, 10, size=x.shape[0])
        return net(x + torch.stack([rows[i] for i in idx]))
    with pytest.raises(CaptureError, match="draws host random numbers with numpy.random.randint"):
        _drawing(True, body)


@pytest.mark.parametrize("kind", ["numpy math", "coins"])
def test_draws_no_graph_can_follow_are_refused_with_state_as_eager(kind):
    """timm's cutmix box from ``np.sqrt(1 - lam)`` (a value no graph reads live: every call would
    capture again) and bentrevett's coin at each of 4 decoder steps (16 paths over max_captures=8):
    refused at the first capture, after a call that drew as eager did."""
    import math
    import random

    import numpy as np

    def body(net, x):
        if kind == "numpy math":
            lam = np.random.beta(1.0, 1.0)
            cut = int(x.shape[1] * math.sqrt(1 - lam))
            return net(torch.cat([x[:, :cut] * 0, x[:, cut:]], 1))
        h = x
        for _ in range(4):
            h = net(h) if random.random() < 0.5 else torch.tanh(net(h))
        return h
    with pytest.raises(CaptureError, match="draws host random numbers with") as e:
        _drawing(True, body)
    assert "test_fetches.py" in e.value.where and "torch.rand" in e.value.fix
    assert ("no graph can read it live" if kind == "numpy math" else "branches on 4 draws") in str(e.value)


def test_a_step_that_seeds_before_it_draws_is_refused_as_before():
    """``random.seed(k)`` then ``random.random()`` in the step: drawn before the call, the coin
    would come from the unseeded stream."""
    import random

    def body(net, x):
        random.seed(7)
        return net(x) if random.random() < 0.5 else net(torch.tanh(x))
    with pytest.raises(CaptureError, match="host random"):
        _drawing(True, body)


def test_mingpt_restarts_its_iterator_when_it_runs_out():
    """karpathy/minGPT's ``Trainer.run``: ``try: batch = next(data_iter) except StopIteration:
    data_iter = iter(train_loader); batch = next(data_iter)``. Taken before the call, the
    StopIteration would escape before the step's own ``except``: that call runs eagerly instead,
    its ``except`` makes the new iterator, and the next calls take from it."""
    def run(use_sg):
        torch.manual_seed(0)
        net = nn.Linear(4, 1)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(20, 4), torch.randn(20, 1)),
                                         batch_size=4, shuffle=True)
        trainer = {"data_iter": iter(dl)}

        def step():
            try:
                batch = next(trainer["data_iter"])
            except StopIteration:
                trainer["data_iter"] = iter(dl)
                batch = next(trainer["data_iter"])
            x, y = batch
            loss = F.mse_loss(net(x), y)
            net.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            return loss.detach()
        f = stepgraph.compile(step) if use_sg else step
        return [f() for _ in range(17)], [p.detach().clone() for p in net.parameters()], f
    want, pw, _ = run(False)
    got, pg, f = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert all(torch.equal(a, b) for a, b in zip(pg, pw))
    assert f.stats.replays >= 10, f.stats


def test_a_branch_drawing_with_another_function_draws_from_eagers_state():
    """A call whose path draws with a function the plan does not hold: the draws taken for the
    other path are given back first, so it draws from where eager does (it went to the
    unpatched function, from a stream moved by draws eager never made)."""
    import random

    import numpy as np

    def body(net, x):
        if random.random() < 0.5:
            w = np.random.uniform(0.5, 1.0)
        else:
            w = random.uniform(0.0, 0.5)
        return net(x * w)
    _same_as_eager(body, compile_kw={"on_capture_error": "eager"}, seed=1, calls=16)
