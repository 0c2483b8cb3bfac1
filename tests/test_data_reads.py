"""Data calls found by what they read (capture/dataorder.py): nanoGPT's ``X, Y = get_batch('train')``
inside the step (``torch.randint`` offsets, Python slices of a numpy token array) and llm.c's
``train_loader.next_batch()`` (slices ``self.tokens`` and advances ``self.current_position``). Before,
both were refused at the numpy read. Each test runs the program eagerly beside stepgraph on the
same data and torch CPU stream and compares bitwise, the stream and the loader included."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")
V, B, T = 32, 4, 8
DATA = np.random.default_rng(0).integers(0, V, 4096).astype(np.uint16)   # (8192 bytes: not keyed by value)


def get_batch(split):
    """nanoGPT's train.py ("poor man's data loader")."""
    data = DATA
    ix = torch.randint(len(data) - T, (B,))
    x = torch.stack([torch.from_numpy((data[i:i + T]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + T]).astype(np.int64)) for i in ix])
    return x, y


class Net(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.emb, self.drop, self.head = nn.Embedding(V, 16), nn.Dropout(p), nn.Linear(16, V)

    def forward(self, x, y):
        logits = self.head(self.drop(self.emb(x)))
        return F.cross_entropy(logits.view(-1, V), y.view(-1))


def _model(p=0.0):
    torch.manual_seed(0)
    m = Net(p)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _nanogpt_step(model, opt):
    def train_step(X, Y):
        for _ in range(2):   # (gradient_accumulation_steps)
            loss = model(X, Y) / 2
            X, Y = get_batch('train')   # (prefetch the next batch, as train.py does)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, X, Y
    return train_step


def _run(step, calls=7):
    torch.manual_seed(123)
    X, Y = get_batch('train')
    out = []
    for _ in range(calls):
        loss, X, Y = step(X, Y)
        out.append((loss.detach().clone(), X.clone(), Y.clone()))
    return out, torch.get_rng_state()


def test_nanogpt_get_batch_in_step_is_taken_first():
    m1, o1 = _model()
    m2, o2 = _model()
    sg = stepgraph.compile(_nanogpt_step(m1, o1))
    got, rng_got = _run(sg)
    want, rng_want = _run(_nanogpt_step(m2, o2))
    assert sg.stats.replays >= 3, sg.stats
    for (l1, x1, y1), (l2, x2, y2) in zip(got, want):
        assert torch.equal(l1, l2) and torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(rng_got, rng_want)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
    assert "get_batch('train')" in sg.explain()


def test_get_batch_after_cpu_dropout_is_refused():
    """On the CPU the forward's dropout draws from the generator get_batch draws from, before it:
    taken first, the draws would come in another order. Refused; state as eager's."""
    m1, o1 = _model(0.2)
    m2, o2 = _model(0.2)
    sg = stepgraph.compile(_nanogpt_step(m1, o1))
    with pytest.raises(stepgraph.CaptureError, match="draws from a random generator the step drew from before"):
        _run(sg, calls=2)
    torch.manual_seed(123)
    X, Y = get_batch('train')
    for _ in range(2):
        _, X, Y = _nanogpt_step(m2, o2)(X, Y)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)


class DataLoaderLite:
    """llm.c's train_gpt2.py loader: a token shard held as a numpy array, a moving position."""

    def __init__(self):
        self.tokens = DATA[:2600]   # (5200 bytes: not keyed by value)
        self.reset()

    def reset(self):
        self.current_position = 0

    def next_batch(self):
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        buf = torch.tensor(buf.astype(np.int32), dtype=torch.long)
        x, y = (buf[:-1]).view(B, T), (buf[1:]).view(B, T)
        self.current_position += B * T
        if self.current_position + (B * T + 1) > len(self.tokens):
            self.reset()
        return x, y


def _llmc_step(model, opt, loader, overfit=False):
    def train_step():
        opt.zero_grad(set_to_none=True)
        if overfit:
            loader.reset()
        lossf = 0.0
        for _ in range(2):
            x, y = loader.next_batch()
            loss = model(x, y) / 2
            lossf += loss.detach()
            loss.backward()
        opt.step()
        return lossf
    return train_step


@pytest.mark.parametrize("overfit", [False, True])
def test_llmc_next_batch_in_step(overfit):
    """The loader advances at each call (wrapping around its shard). With ``--overfit_single_batch``
    the step resets it first: taken before the step, the batch would be read before the reset, so
    that call runs it where the step does (warned) and the step is refused from then on."""
    (m1, o1), (m2, o2) = _model(), _model()
    l1, l2 = DataLoaderLite(), DataLoaderLite()
    sg = stepgraph.compile(_llmc_step(m1, o1, l1, overfit))
    eager = _llmc_step(m2, o2, l2, overfit)
    for i in range(14):
        try:
            a = sg()
        except stepgraph.CaptureError:
            assert overfit
            a = None
        b = eager()
        assert a is None or torch.equal(a, b), i
        assert l1.current_position == l2.current_position, i
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p1, p2), i
    if not overfit:
        assert sg.stats.replays >= 8, sg.stats


IT_A = IT_B = 0   # (test_a_data_call_whose_argument_the_step_changes_first_is_refused's counters)


def get_rows(i):
    return torch.from_numpy(DATA[i * 8:i * 8 + 8].astype(np.int64)).view(2, 4)


def _counting_steps(m1, o1, m2, o2):
    def step_a():
        global IT_A
        IT_A += 1
        x = get_rows(IT_A)
        loss = m1(x, x)
        loss.backward()
        o1.step()
        o1.zero_grad()
        return loss.detach()

    def step_b():
        global IT_B
        IT_B += 1
        x = get_rows(IT_B)
        loss = m2(x, x)
        loss.backward()
        o2.step()
        o2.zero_grad()
        return loss.detach()
    return step_a, step_b


def test_a_data_call_whose_argument_the_step_changes_first_is_refused():
    """``IT += 1`` then ``get_rows(IT)``: taken before the step, the call would read the old
    ``IT`` at every replay (one window behind eager's). The capturing call sees other arguments:
    it runs the call where the step does, warns, and the step is refused from then on."""
    (m1, o1), (m2, o2) = _model(), _model()
    step_a, eager = _counting_steps(m1, o1, m2, o2)
    sg = stepgraph.compile(step_a)
    refused = 0
    for i in range(8):
        try:
            a = sg()
        except stepgraph.CaptureError:
            a, refused = None, refused + 1
        b = eager()
        assert IT_A == IT_B, i
        assert a is None or torch.equal(a, b), i
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p1, p2), i


class _Loader:
    def __init__(self):
        self.pos = 0

    def next_batch(self, bs):
        x = torch.from_numpy(DATA[self.pos:self.pos + 4 * bs].astype(np.int64)).view(bs, 4)
        self.pos += 4 * bs
        return x


def test_a_data_call_through_functools_partial():
    """``next_batch = functools.partial(loader.next_batch, 2)`` called by the step: the loader's
    read was baked (the source finder did not look through the partial) and the loader never
    advanced at replays, silently; now it is a data call like ``loader.next_batch(2)``."""
    import functools
    (m1, o1), (m2, o2) = _model(), _model()
    l1, l2 = _Loader(), _Loader()

    def mk(model, opt, get):
        def step():
            x = get()
            loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    sg = stepgraph.compile(mk(m1, o1, functools.partial(l1.next_batch, 2)))
    eager = mk(m2, o2, functools.partial(l2.next_batch, 2))
    for i in range(6):
        assert torch.equal(sg(), eager()), i
        assert l1.pos == l2.pos
    assert sg.stats.replays >= 2


def test_a_generator_reading_a_numpy_array_is_taken_with_next():
    """``x = next(it)`` in the step, ``it`` a generator slicing a numpy array, a new one at
    ``StopIteration``: the array read was refused from inside the generator, which closed it; the
    eager rerun then met StopIteration and started an epoch eager never started (the loss, the
    weights and the epoch count went apart). Now the read is the batch's: next() is taken first."""
    def batches():
        for p in range(0, 64, 16):
            yield torch.from_numpy(DATA[p:p + 16].astype(np.int64)).view(2, 8)

    def make():
        m, opt = _model()
        state = {"epochs": 0}
        it = batches()

        def step():
            nonlocal it
            try:
                x = next(it)
            except StopIteration:
                state["epochs"] += 1
                it = batches()
                x = next(it)
            loss = m(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step, state, m
    (a, sa, m1), (b, sb, m2) = make(), make()
    sg = stepgraph.compile(a)
    for i in range(7):
        assert torch.equal(sg(), b()), i
        assert sa == sb
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)


class _ShardLoader:
    """A loader that says None at the end of its shard; the step resets it (a new epoch)."""

    def __init__(self):
        self.pos, self.epoch = 0, 0

    def reset(self):
        self.pos = 0
        self.epoch += 1

    def next_batch(self):
        if self.pos + 16 > 64:
            return None
        x = torch.from_numpy(DATA[self.pos:self.pos + 16].astype(np.int64)).view(2, 8)
        self.pos += 16
        return x


def test_a_loader_reset_at_an_epoch_boundary_is_counted_once():
    """``x = loader.next_batch(); if x is None: loader.reset(); x = loader.next_batch()``: the
    boundary call's second data call was not recognised inside a planned trace (the step's hidden
    argument broke its binding), the trace stopped mid-step and the eager rerun reset the loader
    a second time (epoch 2 where eager has 1)."""
    def make():
        m, opt = _model()
        loader = _ShardLoader()

        def step():
            x = loader.next_batch()
            if x is None:
                loader.reset()
                x = loader.next_batch()
            loss = m(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step, loader, m
    (a, la, m1), (b, lb, m2) = make(), make()
    sg = stepgraph.compile(a)
    for i in range(9):
        try:
            got = sg()
        except stepgraph.CaptureError:
            got = None
        want = b()
        assert got is None or torch.equal(got, want), i
        assert (la.pos, la.epoch) == (lb.pos, lb.epoch), i
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p1, p2), i


SPLIT = "val"


def _split_batch():
    off = 0 if SPLIT == "train" else 100
    ix = torch.randint(1000, (2,))
    return torch.stack([torch.from_numpy(DATA[off + i:off + i + 8].astype(np.int64)) for i in ix])


def test_a_data_call_run_again_in_place_draws_once():
    """``SPLIT = 'train'`` in the step, then ``_split_batch()`` (which reads SPLIT and draws with
    torch.randint): taken first, the call read the old SPLIT, so the capturing call runs it again
    where the step calls it; torch's CPU generator is put back first, or it drew twice."""
    def make():
        m, opt = _model()

        def step():
            global SPLIT
            SPLIT = "train"
            x = _split_batch()
            loss = m(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step, m
    global SPLIT
    (a, m1), (b, m2) = make(), make()
    sg = stepgraph.compile(a)
    for k, run in ((0, sg), (1, b)):
        torch.manual_seed(5)
        got = []
        for i in range(5):
            SPLIT = "val"
            try:
                got.append(run())
            except stepgraph.CaptureError:
                got.append(None)
            got.append(torch.get_rng_state())
        if k == 0:
            first = got
    for i, (x, y) in enumerate(zip(first, got)):
        assert x is None or torch.equal(x, y), i
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
