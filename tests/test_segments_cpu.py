"""CUDA-graph segments (backends/segments.py) exercised on the CPU: each "CUDA graph" is
emulated by re-running the segment into the static outputs a recording would own, so the
splitting, the order of segments and host reads, the guard miss and the fixed values a
segment takes are tested in CI (the real recording runs in tests/test_cuda_segments.py)."""
import copy
import dataclasses

import pytest
import torch

import stepgraph
from stepgraph import backends
from stepgraph.backends import cudagraph, segments


class _EmulatedGraph:
    def __init__(self, fn, args, outs):
        self.fn, self.args, self.outs = fn, args, outs

    def replay(self):
        with torch.no_grad():
            res = self.fn(*self.args)
        for s, o in zip(self.outs, res):
            if isinstance(s, torch.Tensor):
                s.copy_(o)


@pytest.fixture
def emulated_cudagraph(monkeypatch):
    state: list = []

    def record(fn, args, pool):
        # A recording runs nothing; here the segment runs once on copies of the state it
        # writes, only for its output shapes (the state is put back).
        with torch.no_grad():
            saved = [(t, t.clone()) for t in state]
            res = list(fn(*args))
            for t, c in saved:
                t.copy_(c)
        # (the values it computed, not garbage: a later segment's recording run reads them, and
        # a CPU masked_scatter checks its mask against its source, which CUDA's does not)
        outs = [o.clone() if isinstance(o, torch.Tensor) else o for o in res]
        return _EmulatedGraph(fn, args, outs), outs
    monkeypatch.setattr(segments, "_record", record)
    cpu = dataclasses.replace(cudagraph.BACKEND, device_types=("cpu", "cuda"))
    orig = backends._registry
    monkeypatch.setattr(backends, "_registry", lambda: {**orig(), "cudagraph": cpu})
    return state


def _pair():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    m2 = copy.deepcopy(m)
    o, o2 = (torch.optim.SGD(x.parameters(), lr=0.1, momentum=0.9) for x in (m, m2))
    return m, m2, o, o2


def _skip_step(model, opt):
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if not torch.isfinite(loss):
            opt.zero_grad()
            return {"loss": loss.item(), "skipped": True}
        loss.backward()
        opt.step()
        opt.zero_grad()
        return {"loss": loss.item(), "skipped": False}
    return step


def test_segments_between_host_reads_match_eager(emulated_cudagraph):
    m, m2, o, o2 = _pair()
    sg, eager = stepgraph.compile(_skip_step(m, o), backend="cudagraph"), _skip_step(m2, o2)
    for i in range(7):
        if i == 1:  # the state a segment writes, for the emulated recording to put back
            emulated_cudagraph += list(m.parameters()) + [v for s in o.state.values() for v in s.values()]
        x, y = torch.randn(4, 8), torch.randn(4, 2)
        if i == 4:
            x[0, 0] = float("nan")
        a, b = sg(x, y), eager(x, y)
        assert a["skipped"] == b["skipped"] and (a["loss"] == b["loss"] or a["skipped"]), i
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    first = sg.captures[0]
    assert first.backend == "cudagraph" and len(first.run.segments) == 2, sg.explain()
    assert "CUDA graph segments: 2" in sg.explain()
    assert sg.stats.captures == 2 and sum(sg.stats.guard_misses.values()) >= 1, sg.stats


def test_a_read_only_returned_needs_one_segment(emulated_cudagraph):
    m, m2, o, o2 = _pair()

    def make(model, opt):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()
        return step
    sg, eager = stepgraph.compile(make(m, o), backend="cudagraph"), make(m2, o2)
    for i in range(5):
        if i == 1:
            emulated_cudagraph += list(m.parameters()) + [v for s in o.state.values() for v in s.values()]
        x, y = torch.randn(4, 8), torch.randn(4, 2)
        assert sg(x, y) == eager(x, y), i
    assert len(sg.captures[-1].run.segments) == 1


class _Meter:
    def __init__(self):
        self.val = self.sum = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n


def test_python_fed_by_reads_runs_after_the_last_segment(emulated_cudagraph):
    """``train_loss += loss.item()``, a meter's ``sum += loss.item() * n`` and an append of a read:
    the live read of the user's number once ran inside a recorded segment, which froze it (every
    replay added to the first value: 4.63 where eager had 6.14 on an H100). Now that Python runs
    after the step's one graph, and the user's numbers are read at each replay."""
    m, m2, o, o2 = _pair()

    def make(model, opt):
        box = {"train_loss": 0.0, "meter": _Meter(), "losses": []}

        def step(x, y):
            nonlocal_total = box["train_loss"]
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            box["train_loss"] = nonlocal_total + loss.item()
            box["meter"].update(loss.item(), x.shape[0])
            box["losses"].append(loss.item())
            return loss.detach()
        return step, box
    (f, mine), (g, theirs) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(f, backend="cudagraph")
    for i in range(8):
        if i == 1:
            emulated_cudagraph += list(m.parameters()) + [v for s in o.state.values() for v in s.values()]
        if i == 4:  # a new epoch: fresh meters
            mine["meter"], theirs["meter"] = _Meter(), _Meter()
        x, y = torch.randn(4, 8), torch.randn(4, 2)
        assert torch.equal(sg(x, y), g(x, y)), i
        assert mine["train_loss"] == theirs["train_loss"], (i, mine, theirs)
        assert vars(mine["meter"]) == vars(theirs["meter"]), i
        assert mine["losses"] == theirs["losses"], i
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    run = sg.captures[-1].run
    assert sg.captures[-1].backend == "cudagraph" and len(run.segments) == 1, sg.explain()


class _AverageMeter:
    """torchvision's references/classification AverageMeter (also pytorch/examples imagenet)."""
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def test_a_device_op_taking_a_live_number_runs_on_the_host(emulated_cudagraph):
    """``top1.update(acc1[0], n)``: ``avg = sum / count`` divides a tensor by the meter's int
    count, which changes every call. Read live, the division runs on the host after the step's
    graph (eager's kernel, Python scalar): no recapture per call, bitwise equal meters."""
    m, m2, o, o2 = _pair()

    def make(model, opt):
        meters = {"loss": _AverageMeter(), "acc": _AverageMeter()}

        def step(x, y):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            acc = (out.argmax(1) == y).float().sum(0, keepdim=True).mul_(100.0 / x.shape[0])
            meters["loss"].update(loss.item(), x.shape[0])
            meters["acc"].update(acc[0], x.shape[0])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step, meters
    (f, mine), (g, theirs) = make(m, o), make(m2, o2)
    sg = stepgraph.compile(f, backend="cudagraph")
    for i in range(9):
        if i == 1:
            emulated_cudagraph += list(m.parameters()) + [v for s in o.state.values() for v in s.values()]
        if i == 5:  # a new epoch: fresh meters
            for d in (mine, theirs):
                for v in d.values():
                    v.__init__()
        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        assert torch.equal(sg(x, y), g(x, y)), i
        for k in mine:
            a, b = vars(mine[k]), vars(theirs[k])
            assert a.keys() == b.keys() and all(
                torch.equal(a[n], b[n]) if isinstance(a[n], torch.Tensor) else a[n] == b[n] for n in a), (i, k, a, b)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    assert not [r for r in sg.stats.recaptures if "count" in r], sg.stats.recaptures
    assert sg.stats.captures <= 2 and all(e.backend == "cudagraph" for e in sg.captures), sg.explain()


def test_a_sparse_input_is_refused_before_recording(emulated_cudagraph):
    """pygcn's sparse adjacency matrix with a host read in the step once reached the segments'
    static-buffer copy ("copy_() between dense and sparse Tensors"), an unclear failure after
    which every call ran eagerly; now it is NeedsReplay (backend "auto" runs such a step on the
    replay backend)."""
    from stepgraph.errors import NeedsReplay
    m, m2, o, o2 = _pair()
    adj = torch.eye(4).to_sparse()

    def step(a, x, y):
        loss = torch.nn.functional.mse_loss(m(torch.sparse.mm(a, x)), y)
        loss.backward()
        o.step()
        o.zero_grad()
        print(f"{loss.item():.4f}")
        return loss.detach()
    sg = stepgraph.compile(step, backend="cudagraph")
    sg(adj, torch.randn(4, 8), torch.randn(4, 2))
    with pytest.raises(NeedsReplay, match="sparse"):
        sg(adj, torch.randn(4, 8), torch.randn(4, 2))


def _mask_step(model, opt):
    def step(x, y):
        keep = y != -100   # a data-dependent count: x[keep] syncs to allocate, in eager too
        loss = torch.nn.functional.cross_entropy(model(x)[keep], y[keep])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _mask_batch(i, dropped):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 2, (6,), generator=g)
    y[:dropped] = -100
    return x, y


def test_a_data_dependent_shape_runs_between_segments(emulated_cudagraph):
    """``x[mask]`` ends a segment: the op runs on the host as in eager, its shape is guarded, its
    output is copied into the static buffer the next segment reads; a new count -> a sibling."""
    m, m2, o, o2 = _pair()
    sg, eager = stepgraph.compile(_mask_step(m, o), backend="cudagraph"), _mask_step(m2, o2)
    counts = [1, 1, 1, 1, 3, 3, 1, 3, 0, 1]
    for i, dropped in enumerate(counts):
        if i == 1:
            emulated_cudagraph += list(m.parameters()) + [v for s in o.state.values() for v in s.values()]
        x, y = _mask_batch(i, dropped)
        assert torch.equal(sg(x, y), eager(x, y)), i
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    assert all(e.backend == "cudagraph" for e in sg.captures), sg.explain()
    run = sg.captures[0].run
    # forward x[keep] and y[keep], and the backward's index_put of the mask: each on the host
    assert len(run.segments) >= 3 and sum(len(s.materialise) for s in run.segments) >= 3, sg.explain()
    assert sg.stats.captures == 3, sg.stats   # one graph per count: 1, 3, 0
    assert any("shape of aten.index.Tensor" in r for r in sg.stats.recaptures), sg.stats.recaptures
    assert sum(sg.stats.guard_misses.values()) >= 3, sg.stats


def test_a_count_that_never_repeats_stops_at_max_captures_with_one_warning(emulated_cudagraph):
    """A mask count new at every call: at most ``max_captures`` graphs, then ONE warning naming
    the site, then eager calls (bitwise throughout); misses counted per site in stats."""
    import warnings
    m, m2, o, o2 = _pair()
    sg = stepgraph.compile(_mask_step(m, o), backend="cudagraph", max_captures=3)
    eager = _mask_step(m2, o2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(7):
            if i == 1:
                emulated_cudagraph += list(m.parameters()) + [v for s in o.state.values() for v in s.values()]
            x, y = _mask_batch(i, i % 6)   # 0, 1, 2, ... dropped: never the same count twice
            assert torch.equal(sg(x, y), eager(x, y)), i
    msgs = [str(x.message) for x in w if "keeps changing" in str(x.message)]
    assert len(msgs) == 1 and "max_captures=3" in msgs[0] and "test_segments_cpu.py:" in msgs[0], msgs
    assert "keep the shape with a mask" in msgs[0], msgs   # (the fix for a size that follows the data)
    assert sg.stats.captures == 3 and sg.stats.eager_calls == 1 + 3, sg.stats
    site = next(iter(sg.stats.guard_misses))
    assert "model(x)[keep]" in site and list(sg.stats.guard_misses) == [site], sg.stats.guard_misses
    assert f"guard misses at {site}: " in sg.explain()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


def test_explain_lists_segments_and_what_each_sync_costs(emulated_cudagraph):
    m, m2, o, o2 = _pair()
    sg = stepgraph.compile(_skip_step(m, o), backend="cudagraph")
    for i in range(5):
        if i == 1:
            emulated_cudagraph += list(m.parameters()) + [v for s in o.state.values() for v in s.values()]
        sg(torch.randn(4, 8), torch.randn(4, 2))
    syncs = sg.captures[0].run.syncs
    assert syncs and all(p.count == 3 and p.seconds > 0 for p in syncs), syncs
    text = sg.explain()
    assert "segment 0:" in text and "segment 1:" in text, text
    line = next(x for x in text.splitlines() if "sync:" in x and "isfinite" in x)
    assert "test_segments_cpu.py:" in line and "µs host wait per call (3 calls)" in line, line


def test_nonzero_unique_and_masked_select_run_between_segments(emulated_cudagraph):
    m, m2, o, o2 = _pair()

    def make(model, opt):
        def step(x, y):
            out = model(x)
            sel = torch.masked_select(out, y > 0)        # backward: masked_scatter
            idx = (y[:, 0] > 0).nonzero().squeeze(1)     # integer indices: a static shape after it
            classes = torch.unique(y.sign())
            loss = sel.sum() + out[idx].square().mean() + classes.sum() * 0.1
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach(), classes
        return step
    sg, eager = stepgraph.compile(make(m, o), backend="cudagraph"), make(m2, o2)
    for i in range(8):
        if i == 1:
            emulated_cudagraph += list(m.parameters()) + [v for s in o.state.values() for v in s.values()]
        g = torch.Generator().manual_seed(i % 2)   # two batches: two sets of counts
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        (a, ca), (b, cb) = sg(x, y), eager(x, y)
        assert torch.equal(a, b) and torch.equal(ca, cb), i
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    assert all(e.backend == "cudagraph" for e in sg.captures) and sg.stats.captures == 2, sg.explain()
    assert sg.stats.replays == 5, sg.stats
    ops = {str(p.what.split()[0]) for p in sg.captures[0].run.syncs}
    assert {"aten.masked_select.default", "aten.nonzero.default"} <= ops, ops
    assert any("unique" in op for op in ops), ops


def test_collectives_in_a_step_cut_into_segments_go_to_the_replay_backend(emulated_cudagraph, tmp_path):
    """A step with collectives and a host read: recorded as NCCL segments it left eager's results
    (MoCo v2, DINO on the H200), so the segmented backend refuses it (NeedsReplay: 'auto' runs
    it on replay) and the refused call is eager's."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        m, m2, o, o2 = _pair()

        def make(model, opt):
            def step(x, y):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                if loss.item() > 0:        # a host read: segments
                    opt.step()
                opt.zero_grad()
                return loss
            return step
        sg, eager = stepgraph.compile(make(m, o), backend="cudagraph"), make(m2, o2)
        g = torch.Generator().manual_seed(0)
        err = None
        for _ in range(3):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
            eager(x, y)
            try:
                sg(x, y)
            except stepgraph.errors.NeedsReplay as e:   # (backend='auto' takes replay on it)
                err = str(e)
        assert err is not None and "segments are not recorded" in err, err
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    finally:
        dist.destroy_process_group()
