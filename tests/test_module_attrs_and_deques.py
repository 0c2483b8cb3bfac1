"""Python state a replay used to get silently wrong (found by a probe):

* a module holding no tensors (``nn.CrossEntropyLoss()``, a user ``KDLoss`` with a
  ``temperature``) reached from the step's closure, globals or an object it reads, whose
  attributes the loop changes between calls: it was not found as state, so its forward's reads
  were never guarded and replays kept the captured settings;
* a ``collections.deque`` the step appends to: keyed by identity and skipped by the change
  checks, so replays stopped changing it (and a ``maxlen`` deque's mean was baked).

Each idiom runs against an eager twin; the change happens between calls."""
import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class KDLoss(nn.Module):
    def __init__(self, temperature=2.0, alpha=0.5):
        super().__init__()
        self.temperature = temperature
        self.alpha = alpha

    def forward(self, s, y):
        t = self.temperature
        return self.alpha * F.cross_entropy(s / t, y) * t * t + (1 - self.alpha) * F.cross_entropy(s, y)


def _batches(n, classes=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, classes, (6,), generator=g)) for _ in range(n)]


def _same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _run(make, change, calls=6):
    """Run ``make()``'s step eagerly and compiled; ``change(k, world)`` before call k on both."""
    (mE, cE, fE), (mC, cC, fC) = make(), make()
    sg = stepgraph.compile(fC)
    for k, (x, y) in enumerate(_batches(calls)):
        change(k, cE)
        change(k, cC)
        torch.manual_seed(100 + k)   # (both twins draw the same dropout masks)
        a = fE(x, y)
        torch.manual_seed(100 + k)
        b = sg(x, y)
        assert torch.equal(a, b), (k, sg.stats.last_branch, a, b)
        assert _same_params(mE, mC), k
    return sg


def _world(loss_at):
    """A step whose loss module is reached by ``loss_at``: 'closure', 'object' (an attribute of a
    trainer object the step reads), 'argument_object'."""
    def make(crit_factory):
        def build():
            torch.manual_seed(0)
            model = nn.Linear(8, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            crit = crit_factory()
            if loss_at == "closure":
                def step(x, y):
                    loss = crit(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    return loss.detach()
            else:
                class Trainer:
                    pass
                trainer = Trainer()
                trainer.criterion = crit

                def step(x, y):
                    loss = trainer.criterion(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    return loss.detach()
            return model, crit, step
        return build
    return make


@pytest.mark.parametrize("loss_at", ["closure", "object"])
def test_cross_entropy_label_smoothing_changed_between_calls(loss_at):
    def change(k, crit):
        if k == 3:
            crit.label_smoothing = 0.3
    sg = _run(_world(loss_at)(nn.CrossEntropyLoss), change)
    assert sg.stats.captures == 2, sg.stats
    assert "label_smoothing" in sg.stats.recaptures[0], sg.stats.recaptures


@pytest.mark.parametrize("loss_at", ["closure", "object"])
def test_a_user_loss_modules_temperature_and_alpha_on_a_schedule(loss_at):
    def change(k, kd):
        kd.temperature = 2.0 + 0.5 * (k // 2)
        if k == 4:
            kd.alpha = 0.9
    sg = _run(_world(loss_at)(KDLoss), change)
    assert sg.stats.replays >= 1, sg.stats


CRIT = nn.CrossEntropyLoss()


def _global_crit_twins():
    """A model pair trained through the global ``CRIT``: (model, twin, compiled step, eager step)."""
    torch.manual_seed(0)
    m = nn.Linear(8, 4)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def make(model, opt):
        def step(x, y):
            loss = CRIT(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m, o)), make(m2, o2)
    return m, m2, sg, eager


def test_a_global_loss_modules_setting_changed_between_calls():
    global CRIT
    m, m2, sg, eager = _global_crit_twins()
    try:
        for k, (x, y) in enumerate(_batches(6)):
            CRIT.label_smoothing = 0.2 if k >= 3 else 0.0
            assert torch.equal(sg(x, y), eager(x, y)), k
            assert _same_params(m, m2), k
    finally:
        CRIT = nn.CrossEntropyLoss()
    assert sg.stats.captures == 2 and "label_smoothing" in sg.stats.recaptures[0], sg.stats


def test_a_global_loss_module_rebound_each_call_with_its_setting():
    """``crit = nn.CrossEntropyLoss(label_smoothing=s)`` made anew in the loop: the new object's
    settings, not only its identity, decide the graph."""
    global CRIT
    m, m2, sg, eager = _global_crit_twins()
    try:
        for k, (x, y) in enumerate(_batches(8)):
            CRIT = nn.CrossEntropyLoss()
            if k >= 5:
                CRIT.label_smoothing = 0.2
            assert torch.equal(sg(x, y), eager(x, y)), k
            assert _same_params(m, m2), k
    finally:
        CRIT = nn.CrossEntropyLoss()
    assert sg.stats.replays >= 4, sg.stats


def test_a_closure_dropout_module_toggled_and_its_p_changed():
    """``drop = nn.Dropout(0.5)`` beside the model: its train/eval and ``p`` decide the graph."""
    def make():
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        drop = nn.Dropout(0.5)

        def step(x, y):
            loss = F.cross_entropy(drop(model(x)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return model, drop, step

    def change(k, drop):
        drop.train(k not in (2, 3))
        if k == 4:
            drop.p = 0.2
    sg = _run(make, change, calls=7)
    assert sg.stats.captures >= 3, sg.stats


def test_a_loss_module_passed_as_argument_is_keyed_the_same_way():
    torch.manual_seed(0)
    m = nn.Linear(8, 4)
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    kd, kd2 = KDLoss(), KDLoss()

    def step(model, opt, crit, x, y):
        loss = crit(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    sg = stepgraph.compile(step)
    for k, (x, y) in enumerate(_batches(6)):
        if k == 3:
            kd.temperature = kd2.temperature = 4.0
        assert torch.equal(sg(m, o, kd, x, y), step(m2, o2, kd2, x, y)), k
        assert _same_params(m, m2), k
    assert sg.stats.captures == 2 and "temperature" in sg.stats.recaptures[0], sg.stats


def test_a_submodules_plain_attribute_changed_between_calls():
    """``model.head.temperature = 2.0``: the model is state, its submodules' forwards are read."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.temperature = 1.0

        def forward(self, x):
            return self.fc(x) / self.temperature

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), Head())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return model, model, step

    def change(k, model):
        if k == 3:
            model[1].temperature = 2.0
    sg = _run(make, change)
    assert sg.stats.captures == 2 and "temperature" in sg.stats.recaptures[0], sg.stats


# ---- deques ----------------------------------------------------------------------------------
_DEQUE_STEPS = {
    "tensor": "dq.append(loss.detach())",
    "item": "dq.append(loss.item())",
    "extend": "dq.extend([loss.detach(), loss.detach() * 2])",
    "mean": "dq.append(loss.detach())\n    return torch.stack(list(dq)).mean()",
    "int": "st['i'] += 1\n    dq.append(st['i'])",
}


def _deque_world(idiom, maxlen):
    """A model, a deque and a step (its own code, so that ``dq`` is read only as written)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ns = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "F": F, "torch": torch,
          "dq": collections.deque(maxlen=maxlen), "st": {"i": 0}}
    src = ("def step(x, y):\n    loss = F.cross_entropy(model(x), y)\n    opt.zero_grad()\n"
           "    loss.backward()\n    opt.step()\n    " + _DEQUE_STEPS[idiom] + "\n    return loss.detach()\n")
    exec(compile(src, f"<deque step {idiom}>", "exec"), ns)
    return model, ns["dq"], ns["step"]


def _same_deque(a, b):
    return type(a) is type(b) and a.maxlen == b.maxlen and len(a) == len(b) and all(
        type(x) is type(y) and (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y) for x, y in zip(a, b))


@pytest.mark.parametrize("maxlen", [None, 3])
@pytest.mark.parametrize("idiom", ["tensor", "item", "extend"])
def test_a_deque_the_step_appends_to_is_appended_to_at_each_replay(idiom, maxlen):
    import warnings
    (mE, dE, fE), (mC, dC, fC) = _deque_world(idiom, maxlen), _deque_world(idiom, maxlen)
    sg = stepgraph.compile(fC)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (no "replays will not add to it", no "stores values read")
        for k, (x, y) in enumerate(_batches(7)):
            assert torch.equal(fE(x, y), sg(x, y)), k
            assert _same_params(mE, mC), k
            assert _same_deque(dE, dC), (k, sg.stats.last_branch, list(dE), list(dC))
    assert sg.stats.captures == 1 and sg.stats.replays == 5, sg.stats


@pytest.mark.parametrize("maxlen", [None, 3])
@pytest.mark.parametrize("idiom, match", [("mean", "puts tensors it computes into the deque"),
                                          ("int", "the step changes the deque")])
def test_a_deque_changed_otherwise_is_refused_as_eager_left_it(idiom, match, maxlen):
    """Read as well as appended to (a sliding mean), or given a Python number: as a list, refused
    at the capturing call, which ran eagerly to its end."""
    (mE, dE, fE), (mC, dC, fC) = _deque_world(idiom, maxlen), _deque_world(idiom, maxlen)
    sg = stepgraph.compile(fC)
    batches = _batches(4)
    assert torch.equal(fE(*batches[0]), sg(*batches[0]))
    x, y = batches[1]
    fE(x, y)
    with pytest.raises(stepgraph.CaptureError, match=match):
        sg(x, y)
    assert _same_params(mE, mC)
    assert _same_deque(dE, dC), (list(dE), list(dC))


_LIBRARY = '''
import torch
import torch.nn.functional as F


class RankingLoss(torch.nn.Module):   # (sentence-transformers' MultipleNegativesRankingLoss)
    def __init__(self, model, scale=20.0):
        super().__init__()
        self.model, self.scale = model, scale

    def forward(self, x, y):
        return self.compute_loss_from_embeddings(self.model(x), y)

    def compute_loss_from_embeddings(self, emb, y):
        return F.cross_entropy(emb * self.temperature_scale, y)

    @property
    def temperature_scale(self):
        return self.scale


class PairLoss(torch.nn.Module):   # (pytorch-metric-learning's GenericPairLoss / NTXentLoss)
    def __init__(self, temperature=0.07):
        super().__init__()
        self.temperature = temperature
        self.loss_method = self.mat_based_loss

    def forward(self, emb, y):
        return self.loss_method(emb @ emb.T, y)

    def mat_based_loss(self, mat, y):
        return self._compute_loss(mat, y)

    def _compute_loss(self, mat, y):
        return F.cross_entropy(mat / self.temperature, y)


class ModelEma(torch.nn.Module):   # (timm's ModelEmaV3: update() reads self.decay through get_decay)
    def __init__(self, model, decay=0.9):
        super().__init__()
        import copy
        self.module, self.decay = copy.deepcopy(model), decay

    @torch.no_grad()
    def update(self, model):
        d = self.get_decay()
        for e, p in zip(self.module.parameters(), model.parameters()):
            e.lerp_(p, 1.0 - d)

    def get_decay(self):
        return self.decay

    def forward(self, x):
        return self.module(x)


def noise_hook(module, args, output):   # (transformers' NEFTune hook)
    if module.training:
        return output + torch.zeros_like(output).uniform_(-1.0, 1.0) * module.noise_alpha
    return output
'''


@pytest.fixture
def library(as_library):
    return as_library("scalarlib", _LIBRARY)


@pytest.mark.parametrize("where", ["helper method", "forward hook"])
def test_a_library_value_read_outside_forward_changed_between_calls(library, where):
    """A float a library reads in a helper its forward calls (sentence-transformers' ``scale``,
    read in ``compute_loss_from_embeddings``), or in a forward hook on the module it is given
    (NEFTune's ``module.neftune_noise_alpha``): changed between calls, replays kept the captured
    value, silently (helper-89)."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        model[0].noise_alpha = 0.5
        model[0].register_forward_hook(library.noise_hook)
        loss_fn = library.RankingLoss(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            loss = loss_fn(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return model, loss_fn, step

    def change(k, loss_fn):
        if k == 3 and where == "helper method":
            loss_fn.scale = 5.0
        if k == 3 and where == "forward hook":
            loss_fn.model[0].noise_alpha = 2.0
    sg = _run(make, change)
    assert sg.stats.captures == 2, sg.stats
    assert ("scale" if where == "helper method" else "noise_alpha") in sg.stats.recaptures[0], sg.stats


def test_a_counter_the_forward_keeps_in_each_of_two_modules_of_a_class():
    """``self.calls += 1`` in a forward two layers share: the second layer's attribute was keyed
    as no change of the step's own (pyvalues keys it as the first's, ``from_step`` dropped), a
    capture per call, then eager past max_captures (helper-90)."""
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return torch.tanh(self.q(x))

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(Layer(), Layer(), nn.Linear(8, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        return model, model, step
    seen = []
    sg = _run(make, lambda k, model: seen.append((model[0].calls, model[1].calls)))
    assert seen[-2:] == [(5, 5), (5, 5)], seen   # (the eager twin's, then the compiled twin's)
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats


def _sgd_step(loss, opt):
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("given", ["closure", "default argument"])
def test_a_library_loss_reached_through_a_bound_method_it_holds(library, given):
    """pytorch-metric-learning's losses call ``self.loss_method``, a bound method stored on the
    instance, whose ``_compute_loss`` reads ``self.temperature``: never scanned (only methods found
    on the class were), an annealed temperature was baked, silently; and a loss given as the
    step's default argument (``def step(x, y, lf=lf)``) was not found as state at all (helper-93)."""
    def make():
        torch.manual_seed(0)
        model = nn.Linear(8, 8)
        lf = library.PairLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if given == "closure":
            def step(x, y):
                return _sgd_step(lf(model(x), y), opt)
        else:
            def step(x, y, lf=lf, model=model, opt=opt):
                return _sgd_step(lf(model(x), y), opt)
        return model, lf, step

    def change(k, lf):
        lf.temperature = 0.07 + 0.05 * k
    sg = _run(make, change)
    assert sg.stats.replays >= 3, sg.stats


DECAY = 0.9


@pytest.mark.parametrize("ema_kind", ["library EMA's update()", "AveragedModel(avg_fn=user lambda)"])
def test_an_ema_decay_the_loop_ramps(library, ema_kind):
    """The step calls ``ema.update(model)``: timm's ModelEmaV3 reads ``self.decay`` in methods that
    are not forward (never scanned), or torch's AveragedModel calls a user ``avg_fn`` reading a
    global decay (a function a module holds, never scanned): a ramped decay was baked, the EMA
    weights drifted from eager's, silently (helper-93 F1b, F1c)."""
    from torch.optim.swa_utils import AveragedModel

    def make():
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if ema_kind.startswith("library"):
            ema = library.ModelEma(model)
            update = ema.update
        else:
            ema = AveragedModel(model, avg_fn=lambda avg, p, n: DECAY * avg + (1 - DECAY) * p)
            update = ema.update_parameters

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            update(model)
            return loss.detach()
        return ema, ema, step

    def change(k, ema):
        global DECAY
        ema.decay = DECAY = 0.9 - 0.1 * k
    (eE, _, fE), (eC, _, fC) = make(), make()
    sg = stepgraph.compile(fC)
    for k, (x, y) in enumerate(_batches(6)):
        change(k, eE)
        change(k, eC)
        assert torch.equal(fE(x, y), sg(x, y))
        assert _same_params(eE, eC), k
    assert sg.stats.replays >= 3, sg.stats
