"""Metrics logged into nested dicts of lists, as TRL's trainers log them:
``self._metrics[mode][key].append(loss.item())`` (a dict of ``defaultdict(list)``), directly or
through a local (``m = self._metrics[mode]``). The chain broke at ``[mode]``, so the whole dict
was keyed by value: its lists grew at every call, every call was a new graph (7 captures, 0
replays in 8 calls), then eager (capture/varitems.py)."""
from collections import defaultdict

import pytest
import torch

import stepgraph


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


def direct(t):
    def step(x):
        loss = t.model(x).pow(2).mean()
        mode = "train" if t.model.training else "eval"
        if t.model.training:
            loss.backward()
            t.opt.step()
            t.opt.zero_grad()
        t._metrics[mode]["loss"].append(loss.item())
        t._metrics[mode]["out"].append(loss.detach())
        return loss.detach()
    return step


def aliased(t):
    def step(x):
        loss = t.model(x).pow(2).mean()
        loss.backward()
        t.opt.step()
        t.opt.zero_grad()
        m = t._metrics["train"]
        m["loss"].append(loss.item())
        m["norm"].extend([x.norm().item()])
        return loss.detach()
    return step


def _both(fe, fc):
    """One call of each on the same batch and dropout draws; the same loss."""
    x = torch.randn(4, 8)
    torch.manual_seed(1)
    want = fe(x)
    torch.manual_seed(1)
    assert torch.equal(want, fc(x))


def _same(a, b):
    assert a.keys() == b.keys()
    for mode in a:
        assert a[mode].keys() == b[mode].keys(), mode
        for k in a[mode]:
            assert len(a[mode][k]) == len(b[mode][k]), (mode, k)
            for u, v in zip(a[mode][k], b[mode][k]):
                assert (torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v), (mode, k)


@pytest.mark.parametrize("make", [direct, aliased])
def test_metrics_appended_through_a_variable_key_replay_one_graph(make):
    te, tc = Trainer(), Trainer()
    fe, fc = make(te), stepgraph.compile(make(tc))
    for _ in range(8):
        _both(fe, fc)
    _same(te._metrics, tc._metrics)
    assert all(torch.equal(a, b) for a, b in zip(te.model.parameters(), tc.model.parameters()))
    assert fc.stats.captures == 1 and fc.stats.replays == 6, fc.stats.recaptures


def test_the_key_the_code_picks_is_the_graphs_own():
    """Train, then eval, then train again: each mode's graph appends to its own lists."""
    te, tc = Trainer(), Trainer()
    fe, fc = direct(te), stepgraph.compile(direct(tc))
    for phase in ["train"] * 4 + ["eval"] * 4 + ["train"] * 3:
        for t in (te, tc):
            t.model.train(phase == "train")
        _both(fe, fc)
    _same(te._metrics, tc._metrics)
    assert len(tc._metrics["eval"]["loss"]) == 4 and len(tc._metrics["train"]["loss"]) == 7
    assert fc.stats.replays >= 6, fc.stats.recaptures


def test_a_new_key_in_the_dict_is_a_new_graph():
    """The lists are keyed through the chains, the dict by its keys: a mode the dict did not hold
    at the capture gets a graph of its own (scanned anew), not a replay appending elsewhere."""
    te, tc = Trainer(), Trainer()
    for t in (te, tc):
        t._metrics = defaultdict(lambda: defaultdict(list))
    mode = ["a"]

    def make(t):
        def step(x):
            loss = t.model(x).pow(2).mean()
            loss.backward()
            t.opt.step()
            t.opt.zero_grad()
            key = mode[0]
            t._metrics[key]["loss"].append(loss.item())
            return loss.detach()
        return step
    fe, fc = make(te), stepgraph.compile(make(tc))
    for k in "aaaabbbb":
        mode[0] = k
        _both(fe, fc)
    _same(te._metrics, tc._metrics)
