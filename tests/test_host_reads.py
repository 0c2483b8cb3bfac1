"""Host reads inside a step (``loss.item()``, ``if torch.isfinite(loss):``, ``int(count)``):
captured by default, read live where the value only flows out, guarded where Python decides
something from it. A guard that sees another value undoes what the graph wrote (BatchNorm
running stats, the random stream) and that call is captured again for the new value.

Every test runs the step compiled and eagerly on twin models from the same batches and
compares loss, parameters, buffers, grads and optimizer state bitwise.
"""
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph


def model(bn=False, p=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16) if bn else nn.Identity(), nn.Dropout(p),
                         nn.ReLU(), nn.Linear(16, 4))


def batch(k, n=8):
    g = torch.Generator().manual_seed(300 + k)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


class Twin:
    def __init__(self, body, bn=False, p=0.0, **kw):
        self.m1 = model(bn, p)
        self.m2 = copy.deepcopy(self.m1)
        self.o1 = torch.optim.AdamW(self.m1.parameters(), lr=1e-2)
        self.o2 = torch.optim.AdamW(self.m2.parameters(), lr=1e-2)
        self.step = stepgraph.compile(lambda x, y: body(self.m1, self.o1, x, y), **kw)
        self.eager = lambda x, y: body(self.m2, self.o2, x, y)

    def __call__(self, x, y, seed=0):
        torch.manual_seed(seed)
        got = self.step(x, y)
        torch.manual_seed(seed)
        want = self.eager(x.clone(), y.clone())
        assert _equal(got, want), (got, want)
        for (k, a), b in zip(self.m1.state_dict().items(), self.m2.state_dict().values()):
            assert torch.equal(a, b), f"{k} differs from eager"
        for a, b in zip(self.m1.parameters(), self.m2.parameters()):
            assert (a.grad is None) == (b.grad is None)
            assert a.grad is None or torch.equal(a.grad, b.grad)
            for k in self.o1.state.get(a, {}):
                assert torch.equal(self.o1.state[a][k], self.o2.state[b][k]), k
        return got

    @property
    def stats(self):
        return self.step.stats


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.equal(torch.nan_to_num(a, nan=1234.5), torch.nan_to_num(b, nan=1234.5))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


def test_returned_item_is_live_not_the_capture_value():
    def body(m, o, x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.item(), {"scaled": loss.item() * 4}
    t = Twin(body)
    seen = [t(*batch(k)) for k in range(6)]
    assert len({v for v, _ in seen}) == 6  # each replay returned its own loss
    assert (t.stats.captures, t.stats.replays, t.stats.recaptures) == (1, 4, [])
    assert all(type(v) is float for v, _ in seen)


def test_skip_branch_on_a_non_finite_loss_recaptures_once_for_the_other_branch():
    def body(m, o, x, y):
        o.zero_grad()
        loss = F.cross_entropy(m(x), y)
        if not torch.isfinite(loss):
            return loss
        loss.backward()
        o.step()
        return loss
    t = Twin(body)
    for k in range(9):
        x, y = batch(k)
        if k in (4, 7):
            x[0, 0] = float("nan")
        t(x, y)
    s = t.stats
    # Captures: the finite branch; the skip branch (guard miss at call 5); the call after a
    # skip, whose grads are None (zero_grad ran, backward did not): a state change eager has too.
    reads = [r for r in s.recaptures if r.startswith("host read")]
    assert s.captures == 3 and len(reads) == 1, s
    line = "if not torch.isfinite(loss):"
    assert line in reads[0] and "True" in reads[0] and "False" in reads[0]
    assert sum(s.guard_misses.values()) == 2  # call 5 (then recaptured) and call 8 (other graph)


def test_a_miss_after_backward_restores_running_stats_and_the_random_stream():
    # The guard reads the grad norm after BatchNorm and dropout ran: a miss must undo both.
    def body(m, o, x, y):
        o.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(m.parameters(), 1e9)
        if (norm * 0 + y.sum()).item() > 12:   # decided after the backward, by the batch
            for p in m.parameters():
                p.grad.mul_(0.5)
        o.step()
        return loss
    t = Twin(body, bn=True, p=0.3)
    for k in range(10):
        x, y = batch(k)
        t(x * (0.01 if k % 3 == 0 else 3.0), y, seed=k)
    assert t.stats.captures == 2 and sum(t.stats.guard_misses.values()) >= 2, t.stats
    text = t.step.explain()
    assert "host reads" in text and "saved" in text, text


def test_a_returned_int_count_is_live_not_a_graph_per_count():
    """``return loss.item(), pred.eq(y).sum().item()`` (the accuracy idiom): the int count was a
    value guard, a graph per count until max_captures, then eager. Now computed from the graph's
    read at each replay, an int as eager's."""
    def body(m, o, x, y):
        out = m(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        o.step()
        o.zero_grad()
        correct = out.argmax(1).eq(y).sum().item()
        return loss.item(), correct, correct / y.size(0)
    t = Twin(body)
    seen = [t(*batch(k, n=16)) for k in range(10)]
    assert len({c for _, c, _ in seen}) > 2 and all(type(c) is int and type(a) is float for _, c, a in seen)
    assert (t.stats.captures, t.stats.replays) == (1, 8), t.stats.recaptures


def test_int_read_is_guarded_by_value():
    def body(m, o, x, y):
        n = int((y == 0).sum())
        loss = F.cross_entropy(m(x), y) * (n + 1)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss
    t = Twin(body)
    for k in range(8):
        x, y = batch(k % 2)
        t(x, y)
    assert t.stats.captures == 2 and t.stats.replays == 5, t.stats


def test_a_value_that_never_repeats_stops_at_max_captures_with_one_warning():
    def body(m, o, x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss * float(loss)   # float() of a tensor: a plain float, guarded by value
    t = Twin(body, max_captures=3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for k in range(8):
            t(*batch(k))
    msgs = [str(x.message) for x in w if "keeps changing" in str(x.message)]
    assert len(msgs) == 1 and "max_captures=3" in msgs[0], msgs
    assert t.stats.captures == 3 and t.stats.eager_calls == 1 + 8 - 4


def test_printing_read_values_is_redone_at_each_replay_and_appending_them_is_replayed(capsys):
    """``print(f"loss {loss.item():.3f}")`` in the step printed only at capture (warned); the
    print is now redone after each replay with that replay's value, as eager prints it."""
    import warnings
    logs = []

    def body(m, o, x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        print(f"loss {loss.item():.3f}")
        logs.append(loss.item())
        return loss
    t = Twin(body)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for k in range(4):
            t(*batch(k))
    text = " ".join(str(x.message) for x in w)
    assert "prints" not in text and "stores values read from tensors" not in text, text
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("loss ")]
    assert len(lines) == 8 and lines[0::2] == lines[1::2], lines   # stepgraph's, then eager's
    # each call appends its own read, the stepgraph call's then eager's (test_appends.py)
    assert len(logs) == 8 and logs[0::2] == logs[1::2], logs
    assert t.step.stats.replays == 2, t.step.stats


def test_str_and_empty_format_of_a_read_value_capture_and_warn():
    # tqdm's set_postfix(loss=loss.item()) does str(n); f"{loss.item()}" formats with an empty
    # spec. float.__format__(x, "") calls str(x): both recursed without end and the step
    # ran eagerly from then on ("please report this").
    def body(m, o, x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        str(loss.item()), f"{loss.item()}", format(loss.item())
        return loss
    t = Twin(body)
    with pytest.warns(UserWarning, match="prints/formats values read from tensors"):
        for k in range(4):
            t(*batch(k))
    assert t.stats.failed_captures == 0 and t.stats.captures == 1 and t.stats.replays == 2, t.stats


def test_math_isnan_of_a_read_value_is_guarded():
    def body(m, o, x, y):
        o.zero_grad()
        loss = F.cross_entropy(m(x), y)
        if math.isnan(loss.item()):
            return loss
        loss.backward()
        o.step()
        return loss
    t = Twin(body)
    for k in range(6):
        x, y = batch(k)
        if k == 4:
            x[1, 1] = float("nan")
        t(x, y)
    reads = [r for r in t.stats.recaptures if r.startswith("host read")]
    assert len(reads) == 1 and "isnan" in reads[0], t.stats


def test_host_reads_error_keeps_refusing():
    def body(m, o, x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.item()
    t = Twin(body, host_reads="error")
    t(*batch(0))
    with pytest.raises(stepgraph.CaptureError, match="item"):
        t.step(*batch(1))


def test_math_sqrt_of_a_live_float_stays_live():
    """``math.sqrt`` of a live global lr once returned a plain float the graph baked: later lr
    values were ignored by that term, silently."""
    import math
    import stepgraph
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    m2 = torch.nn.Linear(4, 2)
    m2.load_state_dict(m.state_dict())
    g = globals()
    g["LR_FOR_SQRT"] = 0.04

    def make(model):
        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-math.sqrt(LR_FOR_SQRT))  # noqa: F821
                    p.grad = None
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m)), make(m2)
    for i in range(6):
        g["LR_FOR_SQRT"] = 0.04 / (i + 1)
        x = torch.randn(3, 4)
        assert torch.equal(sg(x), eager(x))
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert sg.stats.captures == 1, sg.stats.recaptures
PHASE = 0.0


def test_math_functions_of_read_and_live_values_stay_live():
    # math.sqrt / math.cos read a float subclass's bits directly: they were baked at capture.
    def body(m, o, x, y):
        o.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        scale = math.sqrt(loss.item()) * math.cos(PHASE)   # a read value and a live global
        for p in m.parameters():
            p.grad.mul_(scale)
        o.step()
        return loss
    global PHASE
    t = Twin(body)
    for k in range(6):
        PHASE = 0.1 * k
        t(*batch(k))
    assert (t.stats.captures, t.stats.replays) == (1, 4), t.stats


def test_boolean_mask_shape_is_guarded_not_refused():
    """``logits[y != -100]`` (a data-dependent shape) was refused with a CaptureError; now the
    graph holds for the count the trace saw, a replay reads the shape (the op syncs in eager too)
    and a new count captures a sibling graph: bitwise with eager for every count."""
    import copy
    import stepgraph
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)

    def make(model, opt):
        def step(x, y):
            keep = y != -100
            loss = F.cross_entropy(model(x)[keep], y[keep])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m, o)), make(m2, o2)
    for i in range(10):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        y[: i % 3] = -100
        assert torch.equal(sg(x, y), eager(x, y)), i
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    assert sg.stats.captures == 3 and sg.stats.replays == 6, sg.stats   # one graph per count
    assert any("shape of aten.index.Tensor" in r for r in sg.stats.recaptures)


def test_tolist_of_a_small_tensor_is_read_at_each_replay():
    """``t.tolist()`` was refused; now each element is a host read: floats live (a returned list
    is this call's), ints guarded by value (a new value captures a sibling)."""
    import copy
    import stepgraph
    torch.manual_seed(0)
    m = nn.Linear(8, 4)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def make(model, opt):
        def step(x, y):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            per_class = logits.detach().mean(0).tolist()
            top = logits.detach().argmax(1)[:2].tolist()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach(), per_class, top
        return step
    sg, eager = stepgraph.compile(make(m, o)), make(m2, o2)
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        (a, pa, ta), (b, pb, tb) = sg(x, y), eager(x, y)
        assert torch.equal(a, b) and pa == pb and ta == tb, i
        assert all(type(v) is float for v in pa) and all(type(v) is int for v in ta)
    assert sg.stats.replays >= 1


def test_a_float_summed_from_micro_batch_reads_and_returned_is_live_and_not_warned():
    """``tot += (loss / k).item()`` over micro-batches, ``return tot``: live at each replay. It was
    warned as "stored in Python objects": the pipeline's own one-item tuple of the result."""
    torch.manual_seed(0)
    m = nn.Linear(8, 4)
    m2 = copy.deepcopy(m)
    o, o2 = (torch.optim.AdamW(x.parameters(), lr=1e-3) for x in (m, m2))

    def make(model, opt):
        def step(x, y):
            tot = 0.0
            for xs, ys in zip(x.chunk(4), y.chunk(4)):
                loss = F.cross_entropy(model(xs), ys) / 4
                loss.backward()
                tot += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return tot
        return step
    sg, eager = stepgraph.compile(make(m, o)), make(m2, o2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(5):
            x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
            assert sg(x, y) == eager(x, y), k
    assert sg.stats.captures == 1 and sg.stats.replays == 3, sg.stats


def test_one_hot_with_num_classes_is_captured_with_its_range_check_as_a_guard():
    """``F.one_hot(y, num_classes)`` on the CPU checks the class values on the host inside ATen
    (``y.min().item() >= 0``, ``num_classes > y.max().item()``): it was refused as "host sync in
    the step ... return the tensor from the step" (a fix no caller of one_hot can apply;
    TeaPearce's conditional DDPM, clients/ddpm.py). Now it is traced as eager's zeros +
    scatter_, with the range check as one value guard: bitwise with eager, one graph; a batch
    with a value out of range misses the guard and raises eager's error, state as eager's."""
    def body(m, o, x, y):
        target = F.one_hot(y, num_classes=4).float()
        loss = F.mse_loss(m(x).softmax(-1), target)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss
    t = Twin(body)
    for k in range(6):
        t(*batch(k))
    assert t.stats.captures == 1 and t.stats.replays == 4, t.stats
    x, y = batch(6)
    y[3] = 4
    for f in (t.step, t.eager):
        with pytest.raises(RuntimeError, match="Class values must be smaller than num_classes"):
            f(x, y)
    for k in range(7, 10):   # the twins still agree, and the graph is replayed again
        t(*batch(k))
    assert t.stats.captures == 1 and t.stats.replays == 7, t.stats


class _Queue(nn.Module):
    """MoCo's key queue: ``ptr = int(self.queue_ptr)`` positions the write of each batch's keys
    (``form="slice"``, as moco/builder.py), or the write stays a tensor (``"index_copy"``)."""

    def __init__(self, size, form):
        super().__init__()
        self.size, self.form = size, form
        self.lin = nn.Linear(4, 4)
        self.register_buffer("queue", torch.zeros(4, size))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        k = self.lin(x)
        loss = k.sum() + self.queue.sum() * 0.1
        with torch.no_grad():
            if self.form == "slice":
                ptr = int(self.queue_ptr)
                self.queue[:, ptr:ptr + 2] = k.detach().T
                self.queue_ptr[0] = (ptr + 2) % self.size
            else:
                idx = (self.queue_ptr + torch.arange(2)) % self.size
                self.queue.index_copy_(1, idx, k.detach().T)
                self.queue_ptr.add_(2).remainder_(self.size)
        return loss


def _queue_step(m, o):
    def step(x):
        loss = m(x)
        o.zero_grad()
        loss.backward()
        o.step()
        return loss
    return step


def test_moco_queue_pointer_buffer_read_and_written_in_the_step():
    """MoCo's ``_dequeue_and_enqueue`` without DDP: ``ptr = int(self.queue_ptr)`` of a buffer no op
    touched yet (it was refused as a host sync), then ``self.queue_ptr[0] = ptr`` (refused as a
    changed Python value: indexing a tensor makes a new view at each read). Now the read is a
    value guard -- one graph per pointer position -- and every call equals eager."""
    import copy
    torch.manual_seed(0)
    a = _Queue(8, "slice")
    b = copy.deepcopy(a)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))
    sg, eager = stepgraph.compile(_queue_step(a, oa)), _queue_step(b, ob)
    for i in range(12):
        x = torch.randn(2, 4)
        assert torch.equal(sg(x), eager(x)), i
        assert torch.equal(a.queue, b.queue) and torch.equal(a.queue_ptr, b.queue_ptr), i
    assert (sg.stats.captures, sg.stats.replays) == (4, 7), sg.stats.recaptures
    assert all("int() of a int64 tensor" in r for r in sg.stats.recaptures)


def test_a_percent_formatted_read_is_printed_at_every_replay(recwarn, capsys):
    """``print('loss = %.4f' % loss.item())`` formats in C, past every hook of the read value:
    replays printed nothing and nothing said so, then it was named at capture. The text is now
    rebuilt from the line's format at each replay (percent.py); a print with a tensor in it
    (``'%.4f' % loss``) is still named once, at capture."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def make(tensor):
        def step(x):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if tensor:
                print("loss = %.4f" % loss)
            else:
                print("loss = %.4f" % loss.item())
            return loss
        return stepgraph.compile(step)
    step = make(False)
    losses = [step(torch.randn(8, 2)) for _ in range(4)]
    assert capsys.readouterr().out.splitlines() == ["loss = %.4f" % v for v in losses]
    assert not [w for w in recwarn if "print()" in str(w.message)]
    step = make(True)
    for _ in range(4):
        step(torch.randn(8, 2))
    msgs = [str(w.message) for w in recwarn if "replays print nothing" in str(w.message)]
    assert len(msgs) == 1 and "test_host_reads.py" in msgs[0], msgs


def test_percent_formatting_of_a_tensor_for_a_print_is_no_value_guard():
    """RealNVP prints ``'loss = %.3f' % loss`` every few iterations inside the step: ``%``
    converts the tensor with float() from C, which was a value guard -- a recapture at every
    printing call, then eager. It is formatting, as ``f'{loss:.3f}'`` is: one graph per branch."""
    import contextlib
    import io
    model = nn.Linear(2, 1)
    twin = copy.deepcopy(model)
    opt, topt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(twin.parameters(), lr=1e-2)

    def mk(m, o):
        def step(x, t):
            loss = m(x).pow(2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
            if t % 2 == 0:
                print('iter %s:' % t, 'loss = %.3f' % loss)
            return loss
        return step
    sg, eager = stepgraph.compile(mk(model, opt)), mk(twin, topt)
    with contextlib.redirect_stdout(io.StringIO()):
        for t in range(12):
            x = torch.randn(8, 2)
            assert torch.equal(sg(x, t), eager(x, t)), t
    assert (sg.stats.captures, sg.stats.replays) == (2, 9), sg.stats.recaptures


@pytest.mark.parametrize("form", ["slice", "index_copy"])
def test_a_ring_buffer_pointer_names_the_tensor_fix_that_works(form):
    """A pointer read with int() that positions a write takes one graph per value (MoCo's queue:
    K / batch positions). Past max_captures the warning names the tensor form, which is one graph."""
    import copy
    torch.manual_seed(0)
    a = _Queue(16, form)
    b = copy.deepcopy(a)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))
    sg, eager = stepgraph.compile(_queue_step(a, oa), max_captures=3), _queue_step(b, ob)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(10):
            x = torch.randn(2, 4)
            assert torch.equal(sg(x), eager(x)), i
            assert torch.equal(a.queue, b.queue) and torch.equal(a.queue_ptr, b.queue_ptr), i
    if form == "slice":
        msg = next(str(m.message) for m in w if "keeps changing" in str(m.message))
        assert "index_copy_" in msg and "ptr_tensor.add_" in msg, msg
    else:
        assert (sg.stats.captures, sg.stats.replays) == (1, 8), sg.stats.recaptures


class _Meter:
    """pytorch/examples imagenet's AverageMeter."""
    def __init__(self):
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def _timed_loop(compiled: bool, monkeypatch, device="cpu"):
    """pytorch/examples imagenet: ``data_time.update(time.time() - end)`` at the top of the
    step and ``end = time.time()`` at its end, on a clock the test drives."""
    import time
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    torch.manual_seed(0)
    model = nn.Linear(2, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data_time, seen = _Meter(), []
    box = {"end": time.time()}

    def step(x):
        data_time.update(time.time() - box["end"])
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        box["end"] = time.time()
        return loss
    fn = stepgraph.compile(step) if compiled else step
    for i in range(6):
        now[0] += 0.25 * (i + 1)   # (the loader's time)
        fn(torch.randn(8, 2, device=device))
        seen.append((data_time.val, data_time.sum, data_time.count, data_time.avg, box["end"]))
        now[0] += 0.5   # (the rest of the loop)
    return seen, fn, model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_clock_read_in_the_step_is_read_again_at_each_replay(monkeypatch, recwarn, device):
    """``time.time()`` in the step is a number read from the clock: the meter it updates and the
    ``end`` it sets are evaluated again after each replay, as eager's Python would (they used to
    keep the capture's values: stale, then negative durations)."""
    want, _, m_eager = _timed_loop(False, monkeypatch, device)
    got, fn, m = _timed_loop(True, monkeypatch, device)
    assert fn.stats.replays >= 3, fn.stats
    assert not [w for w in recwarn if "backend" in str(w.message)], [str(w.message) for w in recwarn]
    assert got == want
    assert torch.equal(m.weight, m_eager.weight)
    assert not [w for w in recwarn if "reads the clock" in str(w.message)]


def test_a_clock_value_the_graph_needs_is_named_at_capture(monkeypatch, recwarn):
    """A duration fed to a tensor op is read live on the CPU; a clock value the step converts
    with ``int()`` keeps the capture's value at every replay: named once, at capture."""
    import time
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.time()

    @stepgraph.compile
    def step(x):
        elapsed = torch.tensor(time.time() - start)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss, elapsed, int(time.time())
    for i in range(5):
        now[0] += 1
        _, elapsed, stamp = step(torch.randn(8, 2))
        assert float(elapsed) == i + 1 and stamp == (1000 + i + 1 if i < 2 else 1002)
    assert step.stats.replays == 3, step.stats
    msgs = [str(w.message) for w in recwarn if "reads the clock" in str(w.message)]
    assert len(msgs) == 1 and "test_host_reads.py" in msgs[0], msgs


def test_packed_batch_sizes_behind_dropout_are_no_random_read():
    """bentrevett's sentiment LSTM: ``pack_padded_sequence(dropout(embedded), lengths)``. The packed
    batch sizes come from the lengths argument; the walk back from their guard went through the
    embeddings into dropout's draw and refused the step as reading a random value."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn, self.fc, self.drop = nn.Embedding(10, 4), nn.LSTM(4, 3), nn.Linear(3, 1), nn.Dropout(0.5)

        def forward(self, text, lengths):
            packed = nn.utils.rnn.pack_padded_sequence(self.drop(self.emb(text)), lengths)
            _, (h, _) = self.rnn(packed)
            return self.fc(h[-1]).squeeze(1)
    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))

    def mk(m, o):
        def step(text, lengths, y):
            loss = F.binary_cross_entropy_with_logits(m(text, lengths), y)
            o.zero_grad()
            loss.backward()
            o.step()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(a, oa)), mk(b, ob)
    lengths = torch.tensor([5, 4, 2])
    for k in range(5):
        text, y = torch.randint(0, 10, (5, 3)), torch.rand(3)
        torch.manual_seed(100 + k)
        got = sg(text, lengths, y)
        torch.manual_seed(100 + k)
        assert torch.equal(got, eager(text, lengths, y)), k
    assert (sg.stats.captures, sg.stats.replays) == (1, 3), sg.stats


def test_a_print_of_a_tracked_number_in_an_fstring_is_redone_with_this_calls_number(capsys, recwarn):
    """``print(f"step {i}")`` formats the call's number into the text before print: redone as
    captured, it would print the capture's number at every replay. The text is rebuilt with each
    call's number (formats.py); before, the print ran at capture only."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @stepgraph.compile
    def step(x, i):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {i}")
        return loss
    for i in range(5):
        step(torch.randn(8, 2), i)
    out = capsys.readouterr().out.splitlines()
    assert out == [f"step {i}" for i in range(5)], out
    assert not any("print()" in str(w.message) for w in recwarn)
    assert step.stats.replays == 3, step.stats


def test_after_a_flag_flips_for_good_the_graph_that_last_ran_is_tried_first():
    """QAT's ``disable_observer``: a buffer flag the forward branches on flips once. Each later
    call tried the stale graph first, ran it up to the host read, missed and undid it (a wasted
    partial run per call); the graph the chain replayed last is now tried first."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    m.register_buffer("observe", torch.tensor(True))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        y = m(x)
        if m.observe:               # a host read of a flag
            y = y * 1.0
        loss = y.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    f = stepgraph.compile(step)
    for i in range(10):
        if i == 4:
            m.observe.fill_(False)  # flipped for good
        f(torch.randn(3, 4))
    # (the flip's call misses and captures; the next one tries the old graph once more, then
    # the new graph is the one the chain last ran)
    assert sum(f.stats.guard_misses.values()) == 2, f.stats.guard_misses
    assert f.stats.captures == 2 and f.stats.replays == 7


@pytest.mark.parametrize("every,kind", [(1, "float"), (3, "float"), (3, "tensor")])
def test_a_variable_reset_to_a_literal_at_a_logging_step(every, kind):
    """pytorch/examples word_language_model: ``total_loss += loss.item()`` every batch and
    ``total_loss = 0`` after printing every ``log_interval`` batches (a float read live); the
    Annotated Transformer's ``tokens += batch.ntokens`` (a tensor) and ``tokens = 0``. The reset
    was refused; it is now written again after each replay of that branch's graph -- also when
    every call resets it (the value before the step is then that same literal)."""
    def run(compiled):
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        total, seen = 0., []

        def train_batch(batch, x):
            nonlocal total
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() if kind == "float" else (x > 0).sum()
            if batch % every == 0 and batch > 0:
                total = 0
        fn = stepgraph.compile(train_batch) if compiled else train_batch
        for batch in range(8):
            fn(batch, torch.randn(4, 3))
            seen.append(float(total))
        return seen, fn
    want, _ = run(False)
    got, fn = run(True)
    assert got == want, (got, want)
    assert fn.stats.replays >= 2, fn.stats   # (a tensor, 0 and a float: each its own graph)


@pytest.mark.parametrize("form", ["arange", "new_ones"])
def test_an_integer_tensor_torch_takes_as_a_number_is_guarded_by_value(form):
    """``torch.arange(n)`` / ``x.new_ones(b, n)`` with ``n = counts.max()`` (Longformer's global
    attention indices): torch's C parser reads the 0-dim tensor itself, no ``Tensor.__index__``
    the torch-function mode sees, only ``aten._local_scalar_dense``. It was refused as a host
    sync the user could not move; now it is guarded by value like ``int(n)``, and a new value
    captures a sibling graph."""
    def body(m, o, x, y):
        n = (y < 2).long().sum()
        h = m(x)
        extra = torch.arange(n).float().sum() if form == "arange" else h.new_ones(2, n).sum()
        loss = F.cross_entropy(h, y) + extra
        loss.backward()
        o.step()
        o.zero_grad()
        return loss
    t = Twin(body)
    for k in range(6):
        x, _ = batch(k)
        y = torch.tensor([0, 1, 2, 3, 2, 3, 2, 3] if k < 4 else [0, 1, 1, 0, 0, 3, 2, 3])
        t(x, y)
    assert (t.stats.captures, t.stats.replays) == (2, 3), t.stats


def test_a_count_taken_with_int_says_to_use_item_which_replays(caplog):
    """``total += int((pred == y).sum())`` (a loop's accuracy count; HF MLM's count of masked
    tokens behind a draw): int() hands Python a plain copy, a graph per count; behind a random
    draw it was refused with the fix for building batches outside (nanoGPT's get_batch). Both
    now name ``.item()``, whose count replays, equal to eager's."""
    import torch.nn.functional as F

    def run(body, compiled, n=8):
        torch.manual_seed(0)
        m = nn.Linear(8, 4)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        box = type("Counts", (), {"total": 0})()
        f = stepgraph.compile(lambda x, y: body(m, opt, x, y, box)) if compiled else (lambda x, y: body(m, opt, x, y, box))
        g = torch.Generator().manual_seed(1)
        for _ in range(n):
            f(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
        return box.total, f

    def with_int(m, opt, x, y, box):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step()   # noqa: E702
        box.total += int((m(x).argmax(1) == y).sum())
        return loss.detach()

    def with_item(m, opt, x, y, box):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step()   # noqa: E702
        box.total += (m(x).argmax(1) == y).sum().item()
        return loss.detach()

    def drawn(m, opt, x, y, box):
        mask = torch.bernoulli(torch.full((8,), 0.5))
        loss = (F.cross_entropy(m(x), y, reduction="none") * mask).mean()
        opt.zero_grad(); loss.backward(); opt.step()   # noqa: E702
        box.total += int(mask.sum())
        return loss.detach()
    with caplog.at_level("WARNING", logger="stepgraph"):
        total, f = run(with_int, True)
    assert total == run(with_int, False)[0]
    assert f.stats.captures > 2 and "use t.item()" in caplog.text, caplog.text
    total, f = run(with_item, True)
    assert total == run(with_item, False)[0] and f.stats.captures == 1, f.stats
    with pytest.raises(stepgraph.CaptureError, match="int") as e:
        run(drawn, True)
    assert "t.item()" in e.value.fix, e.value.fix


def test_a_mask_selection_names_its_fix_at_the_first_recapture(caplog):
    """``logits[attention_mask == 1]`` (ELECTRA pretraining's loss): a graph per token count. The
    fix (a mask that keeps the shape, or graph_module in a model the user does not own) came only
    with the give-up, after max_captures captures; now at the first recapture."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x, y, mask):
        loss = F.cross_entropy(m(x)[mask], y[mask])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    f = stepgraph.compile(step)
    g = torch.Generator().manual_seed(0)
    with caplog.at_level("WARNING", logger="stepgraph"):
        for n in (5, 5, 6):
            mask = torch.arange(8) < n
            f(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g), mask)
    assert f.stats.captures == 2 and "stepgraph.graph_module(model)" in caplog.text, caplog.text
