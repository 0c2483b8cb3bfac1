"""Idioms of embedding-heavy training programs (clients/text_classification_embeddingbag.py,
dlrm.py, word2vec_sgns.py) that stepgraph got wrong, each a minimal step compared with eager
PyTorch on a twin: fresh batches per call; loss, parameters, grads (sparse ones too) and
optimizer state compared at every call.

* DLRM's ``optimizer.step(); lr_scheduler.step()`` inside the step (any LR scheduler that
  changes the lr there): the scheduler's new lr was taken for a constant the step assigned to
  the param group and written back after every replay, over the value the re-run scheduler had
  just set (the lr froze at the capturing call's value)."""
import copy

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")   # (conftest.py)


def _same(a, b, what):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.layout == b.layout, what
        if a.is_sparse:
            a, b = a.coalesce(), b.coalesce()
            assert torch.equal(a.indices(), b.indices()), what
            a, b = a.values(), b.values()
        assert torch.equal(a, b), what
    else:
        assert a == b, what


def compare(model, twin, opt, topt):
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        _same(p.detach(), q.detach(), n)
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            _same(p.grad, q.grad, n + ".grad")
    for p, q in zip(model.parameters(), twin.parameters()):
        sa, sb = opt.state.get(p, {}), topt.state.get(q, {})
        assert sa.keys() == sb.keys()
        for k in sa:
            _same(sa[k], sb[k], k)
    for ga, gb in zip(opt.param_groups, topt.param_groups):
        for k in ga:
            if k != "params":
                _same(ga[k], gb[k], k)


class _WarmupDecay(LRScheduler):
    """DLRM's LRPolicyScheduler, reduced: a get_lr on ``_step_count`` with branches."""

    def get_lr(self):
        n = self._step_count
        scale = n / 2 if n < 2 else max(0.0, 1 - (n - 2) / 6) ** 2
        return [b * scale for b in self.base_lrs]


SCHEDULERS = {
    "lambda": lambda opt: LambdaLR(opt, lambda i: 1.0 / (i + 1)),
    "subclass": _WarmupDecay,
}


@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_lr_scheduler_stepped_inside_the_step(sched, sparse):
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(20, 4, mode="sum", sparse=sparse), "fc": nn.Linear(4, 1)})
    twin = copy.deepcopy(model)
    opt, topt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    s, ts = SCHEDULERS[sched](opt), SCHEDULERS[sched](topt)

    def make(m, o, sc):
        def step(idx, offsets, y):
            z = m["fc"](m["emb"](idx, offsets)).squeeze(1)
            loss = nn.functional.binary_cross_entropy_with_logits(z, y)
            o.zero_grad()
            loss.backward()
            o.step()
            sc.step()
            return loss
        return step

    f, eager = stepgraph.compile(make(model, opt, s)), make(twin, topt, ts)
    g = torch.Generator().manual_seed(1)
    for _ in range(7):
        idx, offsets, y = torch.randint(0, 20, (8,), generator=g), torch.arange(0, 8, 2), torch.rand(4, generator=g)
        _same(f(idx, offsets, y), eager(idx, offsets, y), "loss")
        compare(model, twin, opt, topt)
    assert f.stats.replays >= 4
