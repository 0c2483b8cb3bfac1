"""Patterns found by the real-program corpus (clients/), each reduced to a minimal step and
compared with eager PyTorch: capture on one batch, replay on fresh ones, bitwise on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def same(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n} differs from eager"
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n


class TransposedLinear(nn.Linear):
    """pytorch/examples mnist_forward_forward's Layer: ``torch.mm(x, self.weight.T)``; ``.T`` reads
    as a new tensor object at every access. It owns its optimizer, as that Layer does."""

    def __init__(self, a, b):
        super().__init__(a, b)
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)

    def forward(self, x):
        return torch.relu(torch.mm(x, self.weight.T) + self.bias.unsqueeze(0))


def test_a_view_attribute_of_a_parameter_in_forward_is_not_a_python_value():
    """``self.weight.T`` in a forward (and ``.data``, ``.mT``) was keyed as a Python value by
    identity: a new tensor each read, so the capture was refused as "the step changes the
    Python value self.weight.T" (or recaptured at random when CPython reused the address). It
    is the parameter itself, which the graph reads: captured, bitwise eager."""
    torch.manual_seed(0)
    m = nn.Sequential(TransposedLinear(8, 16), nn.Linear(16, 4))
    m2 = copy.deepcopy(m)
    opt, opt2 = torch.optim.Adam(m.parameters(), lr=1e-2), torch.optim.Adam(m2.parameters(), lr=1e-2)

    def make(model, o):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
            return loss
        return step
    sg, eager = stepgraph.compile(make(m, opt)), make(m2, opt2)
    g = torch.Generator().manual_seed(1)
    for k in range(6):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        assert torch.equal(sg(x, y), eager(x, y)), k
        same(m, m2)
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats


def test_a_step_called_with_each_layer_as_self_trains_each_layer_like_eager():
    """Forward-Forward: one step function, called with each layer (owning its optimizer) as
    its first argument; every layer gets its own graph and trains as eager."""
    torch.manual_seed(0)
    layers = [TransposedLinear(8, 8), TransposedLinear(8, 8)]
    twins = copy.deepcopy(layers)

    def step(self, x_pos, x_neg):
        g_pos = self.forward(x_pos).pow(2).mean(1)
        g_neg = self.forward(x_neg).pow(2).mean(1)
        loss = torch.log1p(torch.exp(torch.cat([-g_pos + 2.0, g_neg - 2.0]))).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss
    sg = stepgraph.compile(step)
    g = torch.Generator().manual_seed(2)
    x_pos, x_neg = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    for a, b in zip(layers, twins):
        for k in range(4):
            assert torch.equal(sg(a, x_pos, x_neg), step(b, x_pos, x_neg)), k
            same(a, b)
        x_pos, x_neg = a(x_pos).detach(), a(x_neg).detach()
    assert sg.stats.replays >= 4, sg.stats


def test_a_new_layer_passed_as_self_warms_up_then_captures_once(recwarn):
    """A model (owning its optimizer) new to the step warms up eagerly as the first did: its grads
    and Adam state come to exist outside the trace, so its graph is captured once (was: captured
    at its first call with no grads, traced through Adam's state init with a false "stores values
    read from tensors" warning, and captured again at the next call)."""
    torch.manual_seed(0)
    layers = [TransposedLinear(8, 8), TransposedLinear(8, 8)]
    twins = copy.deepcopy(layers)

    def step(self, x):
        loss = self.forward(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss
    sg = stepgraph.compile(step)
    g = torch.Generator().manual_seed(3)
    for a, b in zip(layers, twins):
        for k in range(4):
            x = torch.randn(6, 8, generator=g)
            assert torch.equal(sg(a, x), step(b, x)), k
            same(a, b)
    assert sg.stats.captures == 2 and sg.stats.replays == 4, sg.stats
    assert sg.stats.recaptures == [sg.stats.recaptures[0]] and "self" in sg.stats.recaptures[0], sg.stats
    assert not [w for w in recwarn if "stores values read" in str(w.message)]


class Agent(nn.Module):
    """An RL-style agent: the model owns its optimizer as an attribute (``self.optimizer``)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.optimizer = torch.optim.Adam(self.parameters(), lr=0.03)

    def update(self, x, y):
        loss = F.cross_entropy(self.net(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss


@pytest.mark.parametrize("how", ["argument", "global", "method"])
def test_an_optimizer_a_model_owns_is_state_and_its_lr_is_followed(how):
    """An optimizer held as an attribute of a model (forward-forward's ``Layer.opt``, an agent's
    ``self.optimizer``) was not discovered: its state was baked as unnamed constants and a changed
    ``lr`` (a scheduler, a manual decay) kept the captured value: silently wrong from the next
    replay. It is state like any optimizer the step reaches: lr read live, bitwise eager."""
    torch.manual_seed(0)
    agent = Agent()
    twin = copy.deepcopy(agent)
    twin.optimizer = torch.optim.Adam(twin.parameters(), lr=0.03)
    if how == "argument":
        sg = stepgraph.compile(lambda a, x, y: a.update(x, y))
        call = lambda x, y: sg(agent, x, y)  # noqa: E731
    elif how == "global":
        globals()["_AGENT"] = agent
        sg = stepgraph.compile(_global_agent_step)
        call = sg
    else:
        sg = stepgraph.compile(agent.update)
        call = sg
    g = torch.Generator().manual_seed(4)
    for k in range(6):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        assert torch.equal(call(x, y), twin.update(x, y)), k
        same(agent, twin)
        for o in (agent.optimizer, twin.optimizer):
            o.param_groups[0]["lr"] *= 0.5   # a manual decay between steps
    assert sg.stats.replays >= 4, sg.stats
    assert any("optimizer" in n for n, _ in sg.registry.optimizers), sg.registry.optimizers


def _global_agent_step(x, y):
    loss = F.cross_entropy(_AGENT.net(x), y)
    _AGENT.optimizer.zero_grad()
    loss.backward()
    _AGENT.optimizer.step()
    return loss


def test_per_parameter_optimizers_stepped_in_hooks_follow_a_changed_lr():
    """The optimizer step fused into backward (PyTorch's tutorial: one optimizer per parameter,
    stepped from ``register_post_accumulate_grad_hook``). Those optimizers are found when they
    step at the warm-up, but were appended to a temporary list (``reg.optimizers`` returns a
    fresh list of the held ones), so they were never state: a changed lr stayed baked."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    m2 = copy.deepcopy(m)

    def attach(model):
        opts = {p: torch.optim.Adam([p], lr=0.03) for p in model.parameters()}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return list(opts.values())
    o1, o2 = attach(m), attach(m2)

    def make(model):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        return step
    sg, eager = stepgraph.compile(make(m)), make(m2)
    g = torch.Generator().manual_seed(5)
    for k in range(6):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        assert torch.equal(sg(x, y), eager(x, y)), k
        same(m, m2)
        for o in o1 + o2:
            o.param_groups[0]["lr"] *= 0.5
    assert sg.stats.replays == 4 and len(sg.registry.optimizers) == 4, sg.stats


@pytest.mark.parametrize("sampler", ["numpy", "python", "np.random.Generator", "np.random.RandomState",
                                     "random.Random"])
def test_a_batch_sampled_on_the_host_inside_the_step_is_refused_with_state_as_eager(sampler):
    """sfujim/TD3's ``policy.train(replay_buffer)`` samples its batch inside the step with
    ``np.random.randint`` (the DQN tutorial: ``random.sample(memory, n)``): no aten op, so the
    graph baked the capture call's batch and every replay trained on it: WRONG without an error.
    Refused now, naming the user's line; the refused call ran as eager did. The same with a
    generator object (``rng = np.random.default_rng(seed)``, ``RandomState``, ``random.Random``),
    whose draws were not seen: replays trained on the capture's batch, silently."""
    import random

    import numpy as np
    from stepgraph import CaptureError
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    m2 = copy.deepcopy(m)
    data = np.random.RandomState(0).randn(64, 5)
    memory = [torch.tensor(row, dtype=torch.float32) for row in data]

    def make(model):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gens = {"np.random.Generator": np.random.default_rng(0), "np.random.RandomState": np.random.RandomState(0),
                "random.Random": random.Random(0)}
        rng = gens.get(sampler)

        def train(batch_size):
            if sampler == "numpy":
                ind = np.random.randint(0, len(data), size=batch_size)
                batch = torch.FloatTensor(data[ind])
            elif sampler == "np.random.Generator":
                batch = torch.FloatTensor(data[rng.integers(0, len(data), size=batch_size)])
            elif sampler == "np.random.RandomState":
                batch = torch.FloatTensor(data[rng.randint(0, len(data), size=batch_size)])
            elif sampler == "random.Random":
                batch = torch.stack(rng.sample(memory, batch_size))
            else:
                batch = torch.stack(random.sample(memory, batch_size))
            loss = F.mse_loss(model(batch[:, :4]), batch[:, 4:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        return train
    sg, eager = stepgraph.compile(make(m)), make(m2)
    refused_at = 1
    for k in range(refused_at + 1):
        np.random.seed(k), random.seed(k)
        want = eager(8)
        np.random.seed(k), random.seed(k)
        if k < refused_at:
            assert torch.equal(sg(8), want)
            continue
        with pytest.raises(CaptureError, match="host random") as e:
            sg(8)
        assert "test_corpus_patterns.py" in e.value.where and "outside the step" in e.value.fix
        same(m, m2)


def _cycle_step(model, data, prepare):
    """A step taking its batch with ``next()`` from ``itertools.cycle(data)`` (lucidrains' loops)."""
    import itertools
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = itertools.cycle(data)

    def step():
        batch = prepare(next(it))
        loss = F.mse_loss(model(batch[:, :4]), batch[:, 4:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    return step


def test_a_batch_taken_from_an_iterator_inside_the_step_is_fed_in():
    """``batch = next(train_loader)`` inside the step (lucidrains' ``cycle(DataLoader)`` loops,
    makemore's ``batch_loader.next()`` decorated with the body): the iterator advanced only at
    capture, so every replay trained on the capture call's batch: WRONG without an error; then
    refused. Now the batch is taken before each call and fed in (capture/fetches.py): eager's
    batches, bitwise; ``next(model.parameters())`` stays a look-up."""

    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    m2 = copy.deepcopy(m)
    data = [torch.randn(8, 5) for _ in range(6)]

    def make(model):
        return _cycle_step(model, data, lambda batch: batch.to(next(model.parameters()).device))
    sg, eager = stepgraph.compile(make(m)), make(m2)
    for _ in range(9):
        assert torch.equal(sg(), eager())
    same(m, m2)
    assert sg.stats.replays == 6 and sg.stats.captures == 1, sg.stats


class AverageMeter:
    """pytorch/examples imagenet's AverageMeter."""

    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def test_a_meter_updated_through_a_subscript_is_replayed_like_a_meter_bound_to_a_local():
    """``meters['loss'].update(loss.item(), n)`` (no local variable): the meter was reached twice,
    as the record the step reads and as the ``self`` of ``update``, and the capture refused
    ``count += n`` as a value it did not compute. Now it is the record only, as with a local."""
    torch.manual_seed(0)
    m = nn.Linear(8, 3)
    twin = copy.deepcopy(m)
    o, ot = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)

    def make(model, opt):
        meters = {"loss": AverageMeter(), "acc": AverageMeter()}

        def step(x, y):
            out = model(x)
            loss = F.cross_entropy(out, y)
            meters["loss"].update(loss.item(), x.shape[0])
            meters["acc"].update((out.argmax(1) == y).float().mean() * 100, x.shape[0])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step, meters
    (f, mine), (g, theirs) = make(m, o), make(twin, ot)
    sg = stepgraph.compile(f)
    for i in range(6):
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        assert torch.equal(sg(x, y), g(x, y)), i
        for k in mine:
            a, b = vars(mine[k]), vars(theirs[k])
            assert all(torch.equal(a[n], b[n]) if isinstance(a[n], torch.Tensor) else a[n] == b[n] for n in a), (i, a, b)
    same(m, twin)
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats


def _plateau_step(m, item=False):
    torch.manual_seed(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)

    @stepgraph.compile
    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step(loss.item() if item else loss)
        return loss.detach()
    return step


def test_a_plateau_scheduler_stepped_on_a_loss_behind_dropout_names_the_fix():
    """``ReduceLROnPlateau.step(loss)`` inside the step compares ``float(loss)`` on the host; behind
    dropout it differs at every call. Refused at once with a fix for this code (the batch-building
    fix of a random index would not apply), the call run eagerly."""
    step = _plateau_step(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4)))
    step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    with pytest.raises(stepgraph.CaptureError, match=r"scheduler\.step\(loss\)") as e:
        step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    assert "test_corpus_patterns.py" in e.value.where and "get_batch" not in str(e.value)


def test_next_over_the_steps_own_outputs_is_no_data_loader():
    """DETR's SetCriterion: ``device=next(iter(outputs.values())).device``, a look-up on a dict
    of the step's own outputs, was refused as "the step takes its data with next(...)"."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    m2 = copy.deepcopy(m)

    def make(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x):
            outputs = {"pred_logits": model(x), "pred_boxes": model(x).sigmoid()}
            num_boxes = torch.as_tensor([3.0], device=next(iter(outputs.values())).device)
            loss = outputs["pred_logits"].square().sum() / num_boxes + outputs["pred_boxes"].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m)), make(m2)
    for i in range(5):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        assert torch.equal(sg(x), eager(x))
    assert sg.stats.replays == 3
    same(m, m2)


def test_a_recurrent_state_rebound_in_the_step_replays_equal_to_eager():
    """Transformer-XL: ``loss, mems = ret[0], ret[1:]`` rebinds the memory to tensors the forward
    returns. It was refused ("rebinds state['mems'] to a list of 2 tensors"); the element the step
    reads is now a live input of the graph, read where it is at each call, and the list is
    written back after each replay (pyeffects.collect): equal to eager. Passing it in and
    returning it, the fix the refusal named, works too."""
    def make(compiled):
        torch.manual_seed(0)
        m = nn.Linear(4, 4)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        state = {"mems": [torch.zeros(2, 4), torch.zeros(2, 4)]}

        def step(x):
            h = m(x + state["mems"][0])
            loss = h.square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["mems"] = [h.detach(), h.detach() * 2]
            return loss.detach()
        return (stepgraph.compile(step) if compiled else step), state, m
    (f, s1, m1), (e, s2, m2) = make(True), make(False)
    for k in range(5):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(k))
        assert torch.equal(f(x), e(x)), k
        assert all(torch.equal(a, b) for a, b in zip(s1["mems"], s2["mems"])), k
    same(m1, m2)
    assert f.stats.captures == 1 and f.stats.replays == 3, f.stats

    def step2(x, mems):   # the fix
        h = m1(x + mems[0])
        loss = h.square().mean()
        loss.backward()
        return loss.detach(), [h.detach(), h.detach() * 2]
    g, mems = stepgraph.compile(step2), [torch.zeros(2, 4), torch.zeros(2, 4)]
    for _ in range(4):
        _, mems = g(torch.randn(2, 4), mems)
    assert g.stats.replays == 2


@pytest.mark.parametrize("loader", ["dataloader", "cycle", "generator"])
def test_a_batch_stacked_while_traced_is_still_data_from_a_loader(loader):
    """A DataLoader over a TensorDataset stacks its batch while traced (EDM's loop as helper P
    restated it): letting every traced value through ``next()`` -- the first DETR fix -- replayed
    the capture's batch, silently. Only a container's iterator over the step's own values is a
    look-up; a loader's batch is data, taken before each call and fed in (fetches.py)."""
    import itertools

    def run(use_sg):
        torch.manual_seed(0)
        net = nn.Linear(4, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        data = torch.randn(32, 4)
        if loader == "generator":
            it = (data[i:i + 4] for i in range(0, 32, 4))
        else:
            dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
            it = iter(dl) if loader == "dataloader" else itertools.cycle(dl)

        def step():
            x = next(it)
            x = x[0] if isinstance(x, (list, tuple)) else x
            loss = net(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        f = stepgraph.compile(step) if use_sg else step
        return [f() for _ in range(8)], net, f
    want, m2, _ = run(False)
    got, m, f = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    same(m, m2)
    assert f.stats.replays == 5, f.stats

def test_generator_states_are_read_only_at_the_users_own_next(monkeypatch):
    """While tracing, ``next`` is watched for a batch the step takes from a loader. Library code
    calls it too (every ``contextlib`` context manager, ~10 a traced op): reading the random
    generators' states at each of those was 40% of a 12-layer GPT's trace. Only the user's own
    ``next()`` reads them now: here one per traced call, and the batch is still fed in."""
    import contextlib

    from stepgraph.capture import hostrandom
    reads = []
    real = hostrandom._draw_states
    monkeypatch.setattr(hostrandom, "_draw_states", lambda: reads.append(1) or real())
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    m2 = copy.deepcopy(m)
    data = [torch.randn(8, 5) for _ in range(6)]

    def library_nexts(batch):
        for _ in range(20):   # (library code calling next(): contextlib's __enter__/__exit__)
            with contextlib.nullcontext(), torch.no_grad():
                batch = batch + 0
        return batch
    sg, eager = stepgraph.compile(_cycle_step(m, data, library_nexts)), _cycle_step(m2, data, library_nexts)
    for _ in range(5):
        assert torch.equal(sg(), eager())
    same(m, m2)
    assert sg.stats.captures == 1 and sg.stats.replays >= 2, sg.stats
    assert len(reads) <= 8, len(reads)   # (per trace: the watch's start, and around the one user next())


@pytest.mark.parametrize("item", [False, True])
def test_a_plateau_scheduler_stepped_in_the_step_without_dropout_hints_at_stepping_it_outside(item, caplog):
    """Without dropout the loss is no draw: each value recaptures. The hint sent the user to
    ``t.item()`` first, which ReduceLROnPlateau's own ``float(metrics)`` defeats; it names the
    fix that works, stepping the scheduler outside the step."""
    step = _plateau_step(nn.Linear(8, 4), item)
    with caplog.at_level("WARNING", logger="stepgraph"):
        for _ in range(3):
            step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    assert "call scheduler.step(loss) outside it" in caplog.text, caplog.text
