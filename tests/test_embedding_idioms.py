"""Idioms of embedding-heavy training programs (clients/text_classification_embeddingbag.py,
dlrm.py, word2vec_sgns.py) that stepgraph got wrong, each a minimal step compared with eager
PyTorch on a twin: fresh batches per call; loss, parameters, grads (sparse ones too) and
optimizer state compared at every call.

* DLRM's ``optimizer.step(); lr_scheduler.step()`` inside the step (any LR scheduler that
  changes the lr there): the scheduler's new lr was taken for a constant the step assigned to
  the param group and written back after every replay, over the value the re-run scheduler had
  just set (the lr froze at the capturing call's value).
* word2vec's ``torch.optim.SparseAdam`` on ``nn.Embedding(sparse=True)``: SparseAdam keeps
  ``state['step']`` as a Python int. It was refused (naming a line of torch's code, then the
  user's ``optimizer.step()``); the count is now a tracked number (test_optimizer_counters.py),
  and stepping it inside or after the compiled step both replay.
* The text classification tutorial's ``collate_batch``: ``text`` is the batch's sentences
  concatenated, a new length at nearly every call. Each length is a graph; past max_captures the
  step ran eagerly with a warning that said nothing the user could do. It now says what to
  change (pad the flat tensor to a few lengths). (A graph for all lengths needs symbolic
  shapes: not done.)"""
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


def _sgns(sparse_step_inside):
    torch.manual_seed(0)
    model = nn.ModuleDict({"u": nn.Embedding(30, 4, sparse=True), "v": nn.Embedding(30, 4, sparse=True)})
    twin = copy.deepcopy(model)
    opt, topt = (torch.optim.SparseAdam(list(m.parameters()), lr=0.05) for m in (model, twin))

    def make(m, o):
        def step(u, v, neg):
            o.zero_grad()
            eu = m["u"](u)
            score = nn.functional.logsigmoid((eu * m["v"](v)).sum(1))
            neg_score = nn.functional.logsigmoid(-torch.bmm(m["v"](neg), eu.unsqueeze(2)).squeeze(2)).sum(1)
            loss = -(score + neg_score).mean()
            loss.backward()
            if sparse_step_inside:
                o.step()
            return loss
        return step
    return model, twin, opt, topt, stepgraph.compile(make(model, opt)), make(twin, topt)


def _batch(g):
    return torch.randint(0, 30, (6,), generator=g), torch.randint(0, 30, (6,), generator=g), \
        torch.randint(0, 30, (6, 5), generator=g)


def test_sparse_adam_stepped_inside_replays_equal_to_eager():
    """SparseAdam's Python ``state['step']`` is a tracked number: its bias corrections are read
    live at each replay and the increment is written after it (it was refused)."""
    model, twin, opt, topt, f, eager = _sgns(True)
    g, h = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(6):
        _same(f(*_batch(g)), eager(*_batch(h)), "loss")
        compare(model, twin, opt, topt)
    assert f.stats.captures == 1 and f.stats.replays == 4, f.stats


def test_sparse_adam_stepped_after_the_compiled_step_replays_sparse_grads():
    model, twin, opt, topt, f, eager = _sgns(False)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        b = _batch(g)
        _same(f(*b), eager(*b), "loss")
        opt.step()
        topt.step()
        assert model["u"].weight.grad.is_sparse
        compare(model, twin, opt, topt)
    assert f.stats.replays == 4


def test_a_flat_index_tensor_of_varying_length_warns_with_a_fix_past_max_captures():
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(20, 4), "fc": nn.Linear(4, 2)})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(label, text, offsets):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model["fc"](model["emb"](text, offsets)), label)
        loss.backward()
        opt.step()
        return loss

    f = stepgraph.compile(step, max_captures=3)
    with pytest.warns(UserWarning, match=r"max_captures=3.*shape.*pad text to one of a few fixed lengths"):
        for n in range(8, 14):
            f(torch.tensor([0, 1]), torch.randint(0, 20, (n,)), torch.tensor([0, 3]))


def test_batches_padded_to_their_longest_sequence_warn_with_the_collator_fix_past_max_captures():
    """transformers' examples pad each batch to its longest sequence by default
    (DataCollatorWithPadding): each length is a graph; past max_captures the warning names the
    fix for that (a fixed length, or pad_to_multiple_of), not the flat-batch one."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(20, 4, padding_idx=0), "fc": nn.Linear(4, 2)})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(batch):
        mask = batch["attention_mask"].unsqueeze(-1)
        pooled = (model["emb"](batch["input_ids"]) * mask).sum(1) / mask.sum(1)
        loss = nn.functional.cross_entropy(model["fc"](pooled), batch["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    f = stepgraph.compile(step, max_captures=3)
    with pytest.warns(UserWarning, match=r"max_captures=3.*batch\['input_ids'\] is padded to the longest"
                                         r".*pad_to_multiple_of"):
        for n in range(8, 14):
            ids = torch.randint(1, 20, (4, n))
            f({"input_ids": ids, "attention_mask": torch.ones(4, n), "labels": torch.tensor([0, 1, 0, 1])})
    assert f.stats.captures == 3 and f.stats.eager_calls == 3
