"""Batch objects passed to the step (capture/argtree.py): Hugging Face's BatchEncoding (every
tokenizer's and data collator's output), a dataclass and a plain batch class are opened into
their tensors like a dict: a new batch object each call replays the same graph (each was a new
graph per call, then eager past max_captures), and the results stay eager's."""
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import stepgraph


@dataclasses.dataclass
class DataBatch:
    src: torch.Tensor
    tgt: torch.Tensor


class PlainBatch:   # the Annotated Transformer's Batch: tensors (and a count) as attributes
    def __init__(self, src, tgt):
        self.src, self.tgt = src, tgt
        self.ntokens = (tgt != 0).sum()


def _hf(src, tgt):
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding({"src": src, "tgt": tgt})


@dataclasses.dataclass
class MetaBatch:   # a dataclass batch with a dict field (keyed by identity before: a graph per batch)
    src: torch.Tensor
    tgt: torch.Tensor
    meta: dict = dataclasses.field(default_factory=lambda: {"source": "train", "weight": 1.0})


MAKERS = {"BatchEncoding": _hf, "dataclass": DataBatch, "plain class": PlainBatch, "dataclass with a dict": MetaBatch}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_new_batch_object_each_call_replays_one_graph(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 16), torch.nn.Linear(16, 11))
    twin = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]

    def make(m, opt):
        def step(batch):
            src = batch["src"] if kind == "BatchEncoding" else batch.src
            tgt = batch["tgt"] if kind == "BatchEncoding" else batch.tgt
            loss = F.cross_entropy(m(src).flatten(0, 1), tgt.flatten())
            if kind == "dataclass with a dict":
                loss = loss * batch.meta["weight"]
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(model, opts[0])), make(twin, opts[1])
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        src, tgt = torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)
        assert torch.equal(sg(MAKERS[kind](src, tgt)), eager(MAKERS[kind](src, tgt)))
    assert sg.stats.captures == 1 and sg.stats.replays == 4, (sg.stats, sg.stats.recaptures)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


class TrainState:
    """The Annotated Transformer's TrainState: counters, and ``tokens``, which becomes a tensor
    (``train_state.tokens += batch.ntokens``) and so makes the object opened like a batch."""
    step: int = 0
    accum_step: int = 0
    tokens: int = 0


def test_numbers_the_step_sets_on_an_opened_argument_object_reach_the_users_object():
    """The trace runs the step on a copy of an opened object: ``train_state.step += 1`` changed
    the copy only, so the capturing call left the user's count one behind eager's, silently
    (replays then wrote theirs); now the copy's changes are set on the user's object."""
    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state, seen = TrainState(), []

        def step(i, x, train_state):
            loss = model(x).pow(2).mean()
            loss.backward()
            train_state.step += 1
            train_state.tokens += torch.tensor(x.shape[0])
            if i % 2 == 0:
                opt.step()
                opt.zero_grad()
                train_state.accum_step += 1
            return loss.detach()
        fn = stepgraph.compile(step) if compiled else step
        for i in range(7):
            fn(i, torch.randn(4, 3), state)
            seen.append((state.step, state.accum_step, int(state.tokens)))
        return seen, fn, model
    want, _, m0 = run(False)
    got, fn, m1 = run(True)
    assert got == want, (got, want)
    assert fn.stats.replays >= 3, fn.stats
    assert torch.equal(m0.weight, m1.weight)
