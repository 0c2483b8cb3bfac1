"""A module that keeps a tensor its forward computes in an attribute (the Annotated
Transformer's ``self.attn = p_attn``, kept for visualisation; a last hidden state, a cache of
the latest logits). The step rebinds the attribute at every call and a replay writes the graph's
tensor there; the tensor held before the call was keyed by identity, so every call missed the
graph that had seen the previous call's tensor: recaptured at every call, never replayed. Its
value before the call is no input of the graph (the forward writes it before any read): keyed by
whether it is None and its dtype and shape. A forward that READS the old tensor keeps it an
input (a recurrent state), checked below too."""
import pytest
import torch
from torch import nn

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class KeepsAttn(nn.Module):
    def __init__(self, reads_old=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.attn = None
        self.reads_old = reads_old

    def forward(self, x):
        p = torch.softmax(self.lin(x), -1)
        if self.reads_old and self.attn is not None:
            p = p + 0.5 * self.attn.detach()
        self.attn = p
        return p.sum(-1)


def _run(compiled, reads_old=False, n=7, shapes=None):
    torch.manual_seed(0)
    m = KeepsAttn(reads_old)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)

    def step(x):
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    fn = stepgraph.compile(step) if compiled else step
    g = torch.Generator().manual_seed(1)
    seen = []
    for i in range(n):
        rows = shapes[i] if shapes else 3
        seen.append((fn(torch.randn(rows, 4, generator=g)), m.attn.detach().clone()))
    return fn, seen, [p.detach().clone() for p in m.parameters()]


def test_a_tensor_the_forward_keeps_in_an_attribute_replays():
    sg, got, params = _run(True)
    _, want, want_params = _run(False)
    for (a, at), (b, bt) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(at, bt)
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert sg.stats.captures == 1 and sg.stats.replays == 5, sg.stats


def test_a_kept_tensor_the_forward_reads_back_is_still_refused():
    """``p + 0.5 * self.attn.detach()``: the old tensor (with the history eager's call left) is
    read by the graph -- not overwritten first, so still refused, naming the line."""
    with pytest.raises(stepgraph.CaptureError, match="computed before the step"):
        _run(True, reads_old=True)


def test_a_kept_tensor_of_another_shape_is_another_graph():
    """Its shape is in the key: a batch of another size leaves a kept tensor of that size, which
    the next call's graph (for the first size again) sees as another key -- and replays right."""
    shapes = [3, 3, 3, 5, 5, 3, 3, 5]
    sg, got, params = _run(True, shapes=shapes, n=len(shapes))
    _, want, want_params = _run(False, shapes=shapes, n=len(shapes))
    for (a, at), (b, bt) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(at, bt)
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert sg.stats.replays >= 3, sg.stats


_last_loss = None


class Trainer:
    """A trainer object keeping the latest loss and output: ``self.last = loss.detach()``,
    ``self.info["loss"] = ...`` into a dict empty before the first call, and a global."""

    def __init__(self, m, opt):
        self.m, self.opt, self.last, self.info = m, opt, None, {}

    def step(self, x):
        out = self.m(x)
        loss = out.pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.last = loss.detach()
        self.info["loss"] = loss.detach()
        self.info["out"] = out.detach()
        global _last_loss
        _last_loss = loss.detach()
        return loss.detach()


def _trainer(compiled):
    global _last_loss
    _last_loss = None
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    t = Trainer(m, torch.optim.Adam(m.parameters(), lr=0.01))
    f = stepgraph.compile(t.step) if compiled else t.step
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(7):
        r = f(torch.randn(3, 4, generator=g))
        seen.append((r.clone(), t.last.clone(), t.info["loss"].clone(), t.info["out"].clone(), _last_loss.clone()))
    return f, seen


def test_a_trainer_keeping_its_latest_tensors_replays():
    """Refused ("stores a new value into self.info['loss']": the dict had no such key when the
    step's code was scanned) or recaptured at every call (``self.last``, the global: keyed by
    identity) before."""
    sg, got = _trainer(True)
    _, want = _trainer(False)
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert sg.stats.captures == 1 and sg.stats.replays == 5, sg.stats


class Pyramid(nn.Module):
    """torchvision RAFT's CorrBlock: ``build_pyramid`` rebinds ``self.corr_pyramid`` to a list it
    fills, ``index_pyramid`` reads it in the same forward. It was refused ("rebinds
    self.corr_pyramid to a list of 4 tensors it computes"), then keyed by identity: a list the
    forward writes before any read is scratch, written back after each replay."""
    def __init__(self, reads_old=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.reads_old = reads_old

    def build_pyramid(self, x):
        old = getattr(self, "corr_pyramid", None)
        self.corr_pyramid = [x if not (self.reads_old and old) else x + old[0].detach()]
        for _ in range(2):
            self.corr_pyramid.append(self.corr_pyramid[-1] * 0.5)

    def forward(self, x):
        self.build_pyramid(self.lin(x))
        return sum(p.sum() for p in self.corr_pyramid)


@pytest.mark.parametrize("reads_old", [False, True])
def test_a_list_of_tensors_the_forward_rebuilds_replays(reads_old):
    def run(compiled):
        torch.manual_seed(0)
        m = Pyramid(reads_old)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x):
            loss = m(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        fn = stepgraph.compile(step) if compiled else step
        out = [fn(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))) for i in range(5)]
        return fn, out, m
    if reads_old:   # (the old list is read: a recurrent state, refused as before)
        with pytest.raises(stepgraph.CaptureError, match="corr_pyramid"):
            run(True)
        return
    sg, got, m1 = run(True)
    _, want, m2 = run(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert type(m1.corr_pyramid) is list and len(m1.corr_pyramid) == 3
    assert all(torch.equal(a, b) for a, b in zip(m1.corr_pyramid, m2.corr_pyramid))
    assert sg.stats.captures == 1 and sg.stats.replays == 3, sg.stats


class Anchors(nn.Module):
    """torchvision's AnchorGenerator (RetinaNet, FCOS, the R-CNNs): every forward runs
    ``self.cell_anchors = [a.to(dtype=dtype, device=device) for a in self.cell_anchors]``, a no-op
    ``.to()`` that rebinds the list to the very tensors it held. Refused before ("rebinds
    self.cell_anchors to a list of 2 tensors it computes", a fix inside torchvision)."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cell_anchors = [torch.randn(3, 4), torch.randn(2, 4)]

    def forward(self, x):
        self.cell_anchors = [a.to(dtype=x.dtype, device=x.device) for a in self.cell_anchors]
        return (self.lin(x) @ torch.cat(self.cell_anchors).t()).pow(2).mean()


def test_a_list_rebound_to_the_tensors_it_held_replays():
    def run(compiled):
        torch.manual_seed(0)
        m = Anchors()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x):
            loss = m(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        fn = stepgraph.compile(step) if compiled else step
        out = []
        for i in range(6):
            if i == 4:   # the user swaps an anchor tensor: the graph's constant no longer holds
                m.cell_anchors = [m.cell_anchors[0], torch.ones(2, 4)]
            out.append(fn(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))))
        return fn, out, m
    sg, got, m1 = run(True)
    _, want, m2 = run(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    assert sg.stats.captures == 2 and sg.stats.replays == 3, sg.stats


def test_a_kept_tensor_of_each_module_of_a_class_is_known_before_the_call():
    """The Annotated Transformer's ``self.attn`` in each of its attention modules: pyvalues scans
    one module's forward per class and keys the others' attributes as that one's (``from_step``
    False). Only the first was known before the call, so on CUDA (where these sources exist) the
    others stayed keyed by identity: a capture per call (RECAPTURES on the H200 until session 36)."""
    from types import SimpleNamespace
    from stepgraph.capture.pybefore import py_before_call
    from stepgraph.capture.pyvalues import Source
    mods = [KeepsAttn(), KeepsAttn()]
    for m in mods:
        m.attn = torch.ones(2)
    py = SimpleNamespace(sources=[Source("object", m, "self", (("attr", "attn"),), "", from_step=k == 0)
                                  for k, m in enumerate(mods)])
    before = py_before_call(py, ())
    assert set(before.tensors) == {0, 1} and before.tensors[1] is mods[1].attn
