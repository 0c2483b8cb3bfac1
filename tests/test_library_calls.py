"""Statement calls on a library's objects inside the step (a tqdm bar, a logger): redone after
each replay with that replay's values, the object read again at each call (pycalls.py).
Before, they ran only at capture: the bar froze at 2 and the logger logged once, silently; a new
bar per epoch was a new graph per epoch (TeaPearce's DDPM, clients/ddpm.py)."""
import copy
import io
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

tqdm = pytest.importorskip("tqdm").tqdm


def _pair():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    m2 = copy.deepcopy(m)
    return (m, torch.optim.AdamW(m.parameters(), lr=1e-2)), (m2, torch.optim.AdamW(m2.parameters(), lr=1e-2))


def _batch(k):
    g = torch.Generator().manual_seed(50 + k)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _make(m, o, holder):
    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        holder.bar.update(1)
        holder.bar.set_postfix(loss=loss.item(), phase="train")
        holder.log.info("loss %s", loss.detach())
        return loss.detach()
    return step


class _Holder:
    def __init__(self, name):
        self.bar = tqdm(total=100, file=io.StringIO())
        self.log = logging.getLogger(f"stepgraph-test-{name}")
        self.log.setLevel(logging.INFO)
        self.records = []
        h = logging.Handler()
        h.emit = lambda r: self.records.append(r.getMessage())
        self.log.handlers[:] = [h]
        self.log.propagate = False


def test_a_bar_and_a_logger_called_in_the_step_see_every_replay():
    (m1, o1), (m2, o2) = _pair()
    h1, h2 = _Holder("sg"), _Holder("eager")
    sg, eager = stepgraph.compile(_make(m1, o1, h1)), _make(m2, o2, h2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing here runs only at capture
        for k in range(6):
            assert torch.equal(sg(*_batch(k)), eager(*_batch(k)))
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats
    assert h1.bar.n == h2.bar.n == 6
    assert h1.bar.postfix == h2.bar.postfix
    assert h1.records == h2.records and len(h1.records) == 6
    assert "library calls redone after each replay, with its values: holder.bar.update(), " \
        "holder.bar.set_postfix(), holder.log.info()" in sg.explain(), sg.explain()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_a_new_bar_each_epoch_is_no_new_graph():
    (m1, o1), (m2, o2) = _pair()
    h1, h2 = _Holder("sg2"), _Holder("eager2")
    sg, eager = stepgraph.compile(_make(m1, o1, h1)), _make(m2, o2, h2)
    for epoch in range(3):
        h1.bar, h2.bar = tqdm(total=4, file=io.StringIO()), tqdm(total=4, file=io.StringIO())
        for k in range(4):
            assert torch.equal(sg(*_batch(k)), eager(*_batch(k)))
        assert h1.bar.n == h2.bar.n == 4 and h1.bar.postfix == h2.bar.postfix
    assert sg.stats.captures == 1 and not sg.stats.recaptures, sg.stats


def test_a_string_formatted_from_read_values_is_rebuilt_at_each_replay():
    """``pbar.set_description(f"loss: {loss_ema:.4f}")`` (TeaPearce's DDPM): the string is
    rebuilt from each replay's values; a call given an object runs only at capture, warned."""
    (m1, o1), (m2, o2) = _pair()
    bars = [tqdm(total=10, file=io.StringIO()) for _ in range(2)]

    def make(m, o, bar):
        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            bar.set_description(f"loss {loss.item():.3f} (x{2 * loss.item()}) ok")
            bar.set_postfix(model=m)     # an object: not a value a graph hands back
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m1, o1, bars[0])), make(m2, o2, bars[1])
    with pytest.warns(UserWarning) as w:
        for k in range(4):
            sg(*_batch(k))
            eager(*_batch(k))
            assert bars[0].desc == bars[1].desc and bars[0].desc.startswith("loss "), bars[0].desc
    msgs = [str(x.message) for x in w]
    assert any("bar.set_postfix() at" in s and "runs only at capture" in s for s in msgs), msgs
    assert not any("prints/formats" in s or "set_description" in s for s in msgs), msgs
    assert sg.stats.replays == 2, sg.stats


def test_a_call_whose_result_the_step_uses_keeps_the_object_by_identity():
    """``log.isEnabledFor(...)`` decides something: its object stays keyed by identity (a new
    logger is a new graph, with its reason), and only statement calls are redone."""
    (m1, o1), _ = _pair()
    holder = _Holder("ident")

    def step(x, y):
        loss = F.cross_entropy(m1(x), y)
        loss.backward()
        o1.step()
        o1.zero_grad()
        holder.bar.update(1)
        verbose = holder.log.isEnabledFor(logging.DEBUG)
        holder.log.info("step")
        return loss.detach(), verbose
    sg = stepgraph.compile(step)
    for k in range(4):
        sg(*_batch(k))
    assert holder.bar.n == 4 and holder.records == ["step"] * 4
    srcs = {s.describe(): s for s in sg._guards.py.sources}
    assert srcs["holder.bar"].calls_only and srcs["holder.bar"].methods == ("update",)
    assert not srcs["holder.log"].calls_only
    holder.log = logging.getLogger("stepgraph-test-other")
    sg(*_batch(5))
    assert sg.stats.captures == 2 and sg.stats.recaptures[0].startswith("holder.log <object"), sg.stats


def test_a_number_of_the_call_given_to_a_logger_is_this_calls():
    """``log.info("epoch %d step %d", epoch, i)`` with ``epoch``/``i`` arguments: each replay
    logs its own call's numbers (computed again), not the capture's."""
    (m1, o1), (m2, o2) = _pair()
    h1, h2 = _Holder("num-sg"), _Holder("num-eager")

    def make(m, o, h):
        def step(x, y, epoch, i):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            h.log.info("epoch %d step %d", epoch, i + 1)
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m1, o1, h1)), make(m2, o2, h2)
    for k in range(6):
        sg(*_batch(k), k // 3, k)
        eager(*_batch(k), k // 3, k)
    assert h1.records == h2.records, h1.records
    assert sg.stats.captures == 1 and sg.stats.replays == 4, sg.stats


_LIBRARY = '''
import collections

import torch


class AverageMeter:   # timm.utils.AverageMeter, as timm writes it
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


EVENTS = []


def log(data, step=None):   # wandb.log(...), as a module function
    EVENTS.append((dict(data), step))


def dispatch_clip_grad(parameters, value, mode="norm"):   # timm.utils.dispatch_clip_grad, shortened
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value)
    else:   # timm.utils.agc.adaptive_clip_grad
        for p in parameters:
            g = p.grad.detach()
            max_norm = p.detach().norm().clamp_(min=1e-3).mul_(value)
            p.grad.detach().copy_(torch.where(g.norm() < max_norm, g, g * (max_norm / g.norm().clamp(min=1e-6))))


class Scheduler:   # timm.scheduler.Scheduler.step_update, shortened
    def __init__(self, optimizer, base_lr):
        self.optimizer, self.base_lr, self.metric = optimizer, base_lr, None

    def step_update(self, num_updates, metric=None):
        self.metric = metric
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr / (1 + num_updates)


class MetricLogger:   # torchvision references' utils.MetricLogger: it reads the tensors itself
    def __init__(self):
        self.meters = collections.defaultdict(AverageMeter)

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            self.meters[k].update(v)


def supervised_training_step(model, optimizer, loss_fn, gradient_accumulation_steps=1):
    # pytorch-ignite's ignite.engine.supervised_training_step, shortened: its update branches
    # on the engine's iteration
    def update(engine, batch):
        if (engine.state.iteration - 1) % gradient_accumulation_steps == 0:
            optimizer.zero_grad()
        model.train()
        x, y = batch
        loss = loss_fn(model(x), y)
        if gradient_accumulation_steps > 1:
            loss = loss / gradient_accumulation_steps
        loss.backward()
        if engine.state.iteration % gradient_accumulation_steps == 0:
            optimizer.step()
        return loss.item() * gradient_accumulation_steps

    return update


class Engine:   # ignite.engine.Engine's state, as the update reads it
    def __init__(self):
        self.state = type("State", (), {})()
        self.state.iteration = 0


class Smoother:   # a library object that computes on the tensor it is given
    def __init__(self):
        self.history = collections.deque(maxlen=2)

    def push(self, t):
        self.history.append(t * 0.5)


class EMAModel:   # diffusers.training_utils.EMAModel, trimmed: shadow tensors and a Python counter
    def __init__(self, parameters, decay=0.9999):
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay, self.optimization_step = decay, 0

    @torch.no_grad()
    def step(self, parameters):
        self.optimization_step += 1
        one_minus_decay = 1 - min(self.decay, (1 + self.optimization_step) / (10 + self.optimization_step))
        for s_param, param in zip(self.shadow_params, parameters):
            s_param.sub_(one_minus_decay * (s_param - param))
'''


@pytest.fixture
def library(tmp_path, monkeypatch):
    """A module that is library code to stepgraph (under its skipped prefixes), as timm is."""
    import importlib
    import sys
    import stepgraph.errors as errors
    (tmp_path / "fakelib_meters.py").write_text(_LIBRARY)
    prefixes = errors._SKIP_PREFIXES + (str(tmp_path),)
    monkeypatch.setattr(errors, "_SKIP_PREFIXES", prefixes)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("fakelib_meters")
    sys.modules.pop("fakelib_meters", None)


def test_a_step_function_a_library_made_is_scanned_for_what_it_reads(library):
    """``stepgraph.compile(supervised_training_step(model, opt, loss_fn, gradient_accumulation_steps=3))``
    (pytorch-ignite): the update lives in site-packages, and its branches on
    ``engine.state.iteration`` were never guarded: the graph of an iteration without
    ``optimizer.step()`` replayed at every later one, silently."""
    def run(compiled):
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        update = library.supervised_training_step(model, opt, F.cross_entropy, gradient_accumulation_steps=3)
        update = stepgraph.compile(update) if compiled else update
        engine, g, out = library.Engine(), torch.Generator().manual_seed(1), []
        for _ in range(9):
            engine.state.iteration += 1
            out.append(update(engine, (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))))
            out.append(model.weight.detach().clone())
        return out, update
    want, (got, update) = run(False)[0], run(True)
    for k, (a, b) in enumerate(zip(want, got)):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), f"item {k} differs from eager"
    assert update.stats.replays >= 4 and "engine.state.iteration" in update.stats.recaptures[0]


def test_a_library_meter_updated_from_a_read_value_is_updated_at_each_replay(library):
    """timm's train loop: ``losses_m.update(loss.item(), input.size(0))``. The meter's
    arithmetic on the read value is Python, not the graph's: the call is redone, the meter holds
    plain floats equal to eager's."""
    (m1, o1), (m2, o2) = _pair()
    meters = [library.AverageMeter(), library.AverageMeter()]

    def make(m, o, meter):
        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            meter.update(loss.item(), x.size(0))
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m1, o1, meters[0])), make(m2, o2, meters[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(5):
            sg(*_batch(k))
            eager(*_batch(k))
    assert vars(meters[0]) == vars(meters[1]) and meters[0].count == 40, (vars(meters[0]), vars(meters[1]))
    assert all(type(v) in (int, float) for v in vars(meters[0]).values())
    assert sg.stats.replays == 3, sg.stats


def test_a_library_logger_that_reads_the_tensors_it_is_given_is_redone(library):
    """references/detection/engine.py: ``metric_logger.update(loss=losses_reduced, **loss_dict)``
    with tensors; the logger calls ``.item()`` itself. That read is no computation a replay
    lacks: the call is redone with the replay's tensors (it was refused as one that computes)."""
    (m1, o1), (m2, o2) = _pair()
    loggers = [library.MetricLogger(), library.MetricLogger()]

    def make(m, o, ml):
        def step(x, y):
            out = m(x)
            loss_dict = {"ce": F.cross_entropy(out, y), "l2": out.square().mean()}
            losses = sum(loss for loss in loss_dict.values())
            losses.backward()
            o.step()
            o.zero_grad()
            ml.update(loss=losses, **loss_dict)
            return losses.detach()
        return step
    sg, eager = stepgraph.compile(make(m1, o1, loggers[0])), make(m2, o2, loggers[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(5):
            assert torch.equal(sg(*_batch(k)), eager(*_batch(k))), k
    for name in ("loss", "ce", "l2"):
        a, b = vars(loggers[0].meters[name]), vars(loggers[1].meters[name])
        assert a == b and a["count"] == 5, (name, a, b)
    assert sg.stats.replays == 3, sg.stats


def test_a_library_call_that_computes_on_tensors_is_refused_clearly(library):
    (m1, o1), _ = _pair()
    sm = library.Smoother()

    def step(x, y):
        loss = F.cross_entropy(m1(x), y)
        loss.backward()
        o1.step()
        o1.zero_grad()
        sm.push(loss.detach())
        return loss.detach()
    sg = stepgraph.compile(step)
    sg(*_batch(0))
    with pytest.raises(stepgraph.CaptureError, match=r"sm.push\(\), a library method that computes on tensors"):
        sg(*_batch(1))


def _tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4, **{f"w{i}": i for i in range(5, 32)}}
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", unk_token="<unk>",
                                                mask_token="<mask>", bos_token="<s>", eos_token="</s>")


def test_an_mlm_collator_in_the_step_is_refused_with_a_fix_in_the_users_code():
    """transformers' DataCollatorForLanguageModeling called in the step writes in place into the
    batch it built from the examples' lists: refused, with the fix "make it out of place (base =
    base + ...)" for transformers' line, which the user does not own. Now: make the call outside."""
    from transformers import DataCollatorForLanguageModeling
    collator = DataCollatorForLanguageModeling(tokenizer=_tokenizer(), mlm_probability=0.15)
    torch.manual_seed(0)
    emb, head = nn.Embedding(32, 8), nn.Linear(8, 32)
    opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1)

    def step(examples):
        batch = collator(examples)
        loss = F.cross_entropy(head(emb(batch["input_ids"])).flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    sg = stepgraph.compile(step)
    examples = [{"input_ids": [5 + (i * 7 + k) % 27 for k in range(8)]} for i in range(4)]
    sg(examples)
    with pytest.raises(stepgraph.CaptureError, match="writes in place into a tensor built from constants") as e:
        sg(examples)
    assert "outside the step" in e.value.fix and "out of place" not in e.value.fix, e.value.fix


def test_a_library_ema_with_a_python_counter_is_refused_with_a_fix_that_works(library):
    """diffusers' ``ema.step(model.parameters())`` in the step (its examples' ``--use_ema``):
    taken for a logger's call (its tensors sit in a list), refused with two fixes, the second of
    which ("keep it in an attribute of a module") gave the same refusal. Now traced as state: the
    refusal names the counter it increments in Python and the one fix: step it outside."""
    (m1, o1), (m2, o2) = _pair()
    ema1, ema2 = library.EMAModel(m1.parameters()), library.EMAModel(m2.parameters())

    def step(x, y):
        loss = F.cross_entropy(m1(x), y)
        loss.backward()
        o1.step()
        o1.zero_grad()
        ema1.step(m1.parameters())
        return loss.detach()
    sg = stepgraph.compile(step)
    sg(*_batch(0))
    with pytest.raises(stepgraph.CaptureError, match=r"optimization_step") as e:
        sg(*_batch(1))
    assert "attribute of a module" not in str(e.value) and "outside the step" in str(e.value)
    for i in range(2):   # (eager's twin, for the state the refused call left)
        F.cross_entropy(m2(_batch(i)[0]), _batch(i)[1]).backward()
        o2.step()
        o2.zero_grad()
        ema2.step(m2.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ema1.shadow_params + list(m1.parameters()),
                                                 ema2.shadow_params + list(m2.parameters())))
    assert ema1.optimization_step == ema2.optimization_step == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["cudagraph", "inductor"])
def test_library_calls_on_cuda(backend):
    """On CUDA the calls run on the host after the graph (cudagraph: after its last segment;
    inductor: a read handed to a call is host work, segmented)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
    o = torch.optim.SGD(m.parameters(), lr=1e-2)
    h = _Holder(f"cuda-{backend}")

    def step(x, y, epoch):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        h.bar.update(1)
        h.bar.set_description(f"epoch {epoch} loss {loss.item():.5f}")
        h.log.info("loss %s", loss.detach())
        return loss.detach()
    sg = stepgraph.compile(step, backend=backend)
    losses = []
    for k in range(6):
        x, y = _batch(k)
        losses.append(sg(x.cuda(), y.cuda(), k // 3))
        assert h.bar.desc == f"epoch {k // 3} loss {losses[-1].item():.5f}: ", (h.bar.desc, losses[-1])
        assert h.records[-1] == f"loss {losses[-1]!s}", h.records[-1]
    assert h.bar.n == 6 and len(h.records) == 6
    assert sg.stats.replays >= 3, sg.stats


def test_a_library_module_function_called_in_the_step_is_called_at_each_replay(library):
    """``wandb.log({"loss": loss.item(), "lr": ...}, step=i)``: a function of a library module."""
    import fakelib_meters as lib
    (m1, o1), (m2, o2) = _pair()

    def make(m, o):
        def step(x, y, i):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            lib.log({"loss": loss.item(), "lr": o.param_groups[0]["lr"]}, step=i)
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m1, o1)), make(m2, o2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(5):
            sg(*_batch(k), k)
            o1.param_groups[0]["lr"] *= 0.5
    got, lib.EVENTS[:] = list(lib.EVENTS), []
    for k in range(5):
        eager(*_batch(k), k)
        o2.param_groups[0]["lr"] *= 0.5
    assert got == lib.EVENTS and len(got) == 5, (got, lib.EVENTS)
    assert sg.stats.replays == 3, sg.stats


def test_a_checkpoint_saved_in_the_step_is_saved_again_at_each_replay(tmp_path):
    """Early stopping inside the step: ``if loss.item() < best_loss: best_loss = loss.item();
    torch.save(model.state_dict(), path)``. torch.save ran only at capture (torch's functions
    are never redone), so the checkpoint on disk was the capture's, silently."""
    import copy
    torch.manual_seed(0)
    m1 = nn.Linear(4, 2)
    m2 = copy.deepcopy(m1)
    o1, o2 = torch.optim.Adam(m1.parameters(), 1e-2), torch.optim.Adam(m2.parameters(), 1e-2)
    def make(m, o, name):
        best_loss = float("inf")

        def step(x, y):
            nonlocal best_loss
            loss = F.mse_loss(m(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
            if loss.item() < best_loss:
                best_loss = loss.item()
                torch.save(m.state_dict(), tmp_path / f"{name}.pt")
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m1, o1, "sg")), make(m2, o2, "eager")
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        assert torch.equal(sg(x, y), eager(x, y))
    a, b = torch.load(tmp_path / "sg.pt"), torch.load(tmp_path / "eager.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sg.stats.replays >= 5, sg.stats


def test_tensorboard_add_scalar_in_the_step_is_redone_not_recaptured():
    """``writer.add_scalar("loss", loss.item(), step)`` with torch.utils.tensorboard's
    SummaryWriter: a torch object, so never redone; its float() of the read value was a value
    guard, a recapture at every call (5 captures, 0 replays in 6). Here a stand-in of its class
    (module torch.utils.tensorboard.writer), and the real one where tensorboard is installed."""
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, global_step=None):
            self.scalars.append((tag, float(value), global_step))
    Writer.__module__ = "torch.utils.tensorboard.writer"
    (m1, o1), (m2, o2) = _pair()
    writers = [Writer(), Writer()]

    def make(m, o, writer):
        state = {"step": 0}

        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            writer.add_scalar("train/loss", loss.item(), state["step"])
            state["step"] += 1
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m1, o1, writers[0])), make(m2, o2, writers[1])
    for k in range(6):
        assert torch.equal(sg(*_batch(k)), eager(*_batch(k)))
    assert writers[0].scalars == writers[1].scalars
    assert sg.stats.captures == 1 and sg.stats.replays == 4, (sg.stats, sg.stats.recaptures[:2])


@pytest.mark.parametrize("mode", ["norm", "agc"])
def test_a_library_function_that_updates_grads_in_place_is_traced(library, mode):
    """timm's train.py: ``timm.utils.dispatch_clip_grad(model_parameters(model), value=clip_grad,
    mode=clip_mode)`` as a statement. A module function whose result the step drops looked like a
    logger (``wandb.log``) and, computing on tensors, was refused; one that writes tensors in place
    is the graph's own work: traced, not redone."""
    (m1, o1), (m2, o2) = _pair()

    def make(m, o):
        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            library.dispatch_clip_grad(list(m.parameters()), value=0.05, mode=mode)
            o.step()
            o.zero_grad()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m1, o1)), make(m2, o2)
    for k in range(5):
        assert torch.equal(sg(*_batch(k)), eager(*_batch(k))), k
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert sg.stats.captures == 1 and sg.stats.replays == 3, sg.stats


def test_a_library_scheduler_storing_the_loss_average_is_written_after_each_replay(library):
    """timm's train.py: ``lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)``.
    The scheduler keeps ``self.metric``, a value read from the loss: refused ("the step changes
    sched.metric inside timm's code"); now written after each replay with that replay's value
    (libstate.library_effects), the lr set from the tracked count as before."""
    (m1, o1), (m2, o2) = _pair()
    objs = [(library.AverageMeter(), library.Scheduler(o, 0.05), {"n": 0}) for o in (o1, o2)]

    def make(m, o, meter, sched, state):
        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            meter.update(loss.item(), x.size(0))
            state["n"] += 1
            sched.step_update(num_updates=state["n"], metric=meter.avg)
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(make(m1, o1, *objs[0])), make(m2, o2, *objs[1])
    for k in range(5):
        assert torch.equal(sg(*_batch(k)), eager(*_batch(k))), k
        assert objs[0][1].metric == objs[1][1].metric and type(objs[0][1].metric) is float, k
        assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"], k
    assert sg.stats.captures == 1 and sg.stats.replays == 3, sg.stats
