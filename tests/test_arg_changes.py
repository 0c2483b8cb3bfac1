"""Python containers and objects a step changes through its arguments (capture/argchanges.py).

``def step(x, stats): ... stats["n"] += 1``, ``history.append(loss.item())`` with ``history``
passed in, ``meter.update(loss.item())`` on a meter passed in: the trace ran the step on the
dict or list pytree rebuilt (a copy), and a replay runs no Python, so the user's container
silently stopped changing (the capturing call's change was lost too) -- a step counter kept in
a dict argument froze the lr schedule computed from it. Now the change is set on the user's
container at the capturing call (as eager leaves it) and the capture is refused, with a fix."""
import types

import pytest
import torch

import stepgraph


class Meter:
    def __init__(self):
        self.sum, self.n = 0.0, 0

    def update(self, v):
        self.sum += v
        self.n += 1


CASES = {
    "list_append": (list, lambda a, loss: a.append(loss.item()), lambda a: [round(x, 6) for x in a]),
    "dict_counter": (dict, lambda a, loss: a.__setitem__("step", a.get("step", 0) + 1), lambda a: a.get("step")),
    "namespace_counter": (lambda: types.SimpleNamespace(n=0), lambda a, loss: setattr(a, "n", a.n + 1), lambda a: a.n),
    "meter_update": (Meter, lambda a, loss: a.update(loss.item()), lambda a: (round(a.sum, 6), a.n)),
}


def _run(case, compiled, calls, catch=False):
    make, body, show = CASES[case]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, acc):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        body(acc, loss)
        return loss.detach()
    fn = stepgraph.compile(step) if compiled else step
    acc, g = make(), torch.Generator().manual_seed(1)
    for _ in range(calls):
        try:
            fn(torch.randn(4, 3, generator=g), acc)
        except stepgraph.CaptureError:
            if not catch:
                raise
    return show(acc)


@pytest.mark.parametrize("case", list(CASES))
def test_a_change_through_an_argument_is_refused_as_eager_left_it(case):
    want = _run(case, False, 2)
    with pytest.raises(stepgraph.CaptureError) as e:
        _run(case, True, 2)
    assert "passed to it" in str(e.value) and "a replay runs no Python code" in str(e.value)
    assert "closure variable" in e.value.fix
    assert __file__ in e.value.where
    # the refused (capturing) call ran eagerly: the user's container holds what eager's does
    got = _run(case, True, 2, catch=True)
    assert got == want, (got, want)


def test_a_model_and_a_batch_dict_passed_in_are_no_change():
    """What a step only reads through its arguments (a model, a batch dict it indexes, an
    optimizer) replays as before."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @stepgraph.compile
    def step(batch, model, opt):
        loss = model(batch["x"]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    for _ in range(5):
        step({"x": torch.randn(4, 3)}, model, opt)
    assert step.stats.replays == 3, step.stats


def test_a_scheduler_passed_in_and_stepped_in_the_step_is_no_refused_change():
    """The Annotated Transformer's run_batch(..., optimizer, scheduler, ...) calls
    ``scheduler.step()``: an LR scheduler stepped in the step is run again after each replay, so
    its ``last_epoch`` changing is no change to refuse (it was, on the H200 corpus run)."""
    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))

        def step(x, opt, sched):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            return loss.detach()
        fn = stepgraph.compile(step) if compiled else step
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            fn(torch.randn(4, 3, generator=g), opt, sched)
        return model.weight.detach().clone(), sched.last_epoch, fn
    want, we, _ = run(False)
    got, ge, fn = run(True)
    assert torch.equal(got, want) and ge == we == 6
    assert fn.stats.replays >= 3, fn.stats


def test_a_batch_dict_the_step_edits_is_warned_not_refused(recwarn):
    """``ids = batch.pop("id")`` / ``batch["labels"] = ...`` on the loader's fresh dict before the
    forward: harmless unless the loop reads the dict afterwards, so said once, not refused."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @stepgraph.compile
    def step(batch):
        batch.pop("id")
        batch["y"] = batch["x"].sum(1, keepdim=True)
        loss = (model(batch["x"]) - batch["y"]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    for i in range(5):
        step({"x": torch.randn(4, 3), "id": torch.tensor(i)})
    assert step.stats.replays == 3, step.stats
    assert [w for w in recwarn if "a dict of tensors passed to it" in str(w.message)]


def test_a_batch_encoding_the_step_edits_is_warned_as_a_dict_is(recwarn):
    """The same on a Hugging Face ``BatchEncoding`` (a UserDict): the trace ran on a copy whose
    ``.data`` is a new dict, and the watch looked into plain dicts only -- the caller's batch
    silently kept its keys (helper-78)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = torch.nn.Embedding(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @stepgraph.compile
    def step(batch):
        labels = batch.pop("labels")
        loss = torch.nn.functional.cross_entropy(model(batch["input_ids"]).flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    for _ in range(4):
        ids = torch.randint(0, 8, (2, 5))
        step(transformers.BatchEncoding({"input_ids": ids, "labels": ids}))
    assert step.stats.replays == 2, step.stats
    assert [w for w in recwarn if "of tensors passed to it" in str(w.message)]
