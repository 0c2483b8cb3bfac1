"""Steps stepgraph knows it would not capture equal to eager run eagerly, warned (errors.RunsEagerly):
MoCo v2 on the GPU (its own collectives and a host read: gradients 0.29 from eager's on the
H200, with every backend). The call that finds out is undone and runs eagerly from its start."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import stepgraph
from stepgraph.backends.refusals import refuse_collectives_with_reads
from stepgraph.errors import RunsEagerly


def test_a_cuda_step_with_its_own_collectives_and_a_host_read_runs_eagerly():
    reads = SimpleNamespace(guards=[("moco.py:109 (ptr = int(self.queue_ptr))", "int()", 4)])
    with pytest.raises(RunsEagerly, match="moco.py:109"):
        refuse_collectives_with_reads(SimpleNamespace(collective_groups=[object()]), "cuda", SimpleNamespace(reads=reads))
    refuse_collectives_with_reads(SimpleNamespace(collective_groups=[object()]), "cpu", SimpleNamespace(reads=reads))
    refuse_collectives_with_reads(SimpleNamespace(collective_groups=[]), "cuda", SimpleNamespace(reads=reads))
    # a read only logged (an all-reduced loss for a meter) has no guard: the graph stays
    refuse_collectives_with_reads(SimpleNamespace(collective_groups=[object()]), "cuda",
                                  SimpleNamespace(reads=SimpleNamespace(guards=[])))


def test_runs_eagerly_undoes_the_trace_and_warns_once(monkeypatch):
    import stepgraph.pipeline as pipeline

    def refuse(reg, device, tr):
        raise RunsEagerly("known to differ from eager here")
    monkeypatch.setattr(pipeline, "refuse_collectives_with_reads", refuse)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    t = copy.deepcopy(m)
    o, to = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(t.parameters(), lr=1e-2)

    def make(model, opt):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    f, eager = stepgraph.compile(make(m, o)), make(t, to)
    with pytest.warns(UserWarning, match="runs eagerly from now on: known to differ") as rec:
        for i in range(5):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)
            torch.manual_seed(10 + i)
            a = f(x, y)
            torch.manual_seed(10 + i)
            assert torch.equal(a, eager(x, y)), i
    assert sum("runs eagerly" in str(w.message) for w in rec) == 1
    assert f.stats.captures == 0 and f.stats.replays == 0
    for p, q in zip(m.parameters(), t.parameters()):
        assert torch.equal(p, q)
