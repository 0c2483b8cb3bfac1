"""Numbers of the call formatted into the text a redone call takes (formats.py): ``print(f"step
{i} loss {loss.item():.4f}")``, ``log.info(f"epoch {epoch} ...")``, a bar's description. The
text is rebuilt at each replay with that replay's numbers. Before, a print with the step's number
in its text ran at capture only (the log stopped after two lines), and a logger's f-string
guarded the number by value: a graph per iteration, then eager past max_captures."""
import contextlib
import copy
import io
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph

LOG = logging.getLogger("stepgraph-test-formatted")
STEP = 0


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, r):
        self.lines.append(r.getMessage())


def _run(make, compiled: bool, calls: int = 7, **kw):
    """(stdout lines, log lines, parameters, the step) of ``calls`` calls, eager or compiled."""
    global STEP
    STEP = 0
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    step = make(m, o)
    if compiled:
        step = stepgraph.compile(step, **kw)
    rec = _Records()
    LOG.handlers[:] = [rec]
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
    out = io.StringIO()
    g = torch.Generator().manual_seed(1)
    with contextlib.redirect_stdout(out):
        for i in range(calls):
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
            step(x, y, i, i // 3)
    return out.getvalue().splitlines(), rec.lines, [p.detach().clone() for p in m.parameters()], step


def _warned_run(make):
    """Eager's and stepgraph's (stdout, parameters), the step, and the warnings of its run."""
    want_out, _, want_p, _ = _run(make, False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got_out, _, got_p, step = _run(make, True)
    return want_out, want_p, got_out, got_p, step, w


def _loss(m, x, y, o):
    loss = F.cross_entropy(m(x), y)
    o.zero_grad()
    loss.backward()
    o.step()
    return loss


def _print_fstring(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        print(f"epoch {epoch} step {i + 1}/{7} loss {loss.item():.4f}")
        return loss.detach()
    return step


def _logger_fstring(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        LOG.info(f"it {i} loss {loss.item():.4f}")
        return loss.detach()
    return step


def _str_format(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        print("Epoch: {} [{}]\tLoss: {:.6f}".format(epoch, i * 8, loss.item()))
        return loss.detach()
    return step


def _every_k(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        if i % 2 == 0:
            print(f"step {i}: {loss.item():.5f}")
        return loss.detach()
    return step


def _global_counter(m, o):
    def step(x, y, i, epoch):
        global STEP
        loss = _loss(m, x, y, o)
        STEP += 1
        LOG.info(f"global step {STEP} loss {loss.item():.3f}")
        return loss.detach()
    return step


def _multiline(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        print(
            f"step {i}",
            f"loss {loss.item():.4f}",
        )
        return loss.detach()
    return step


NITER = 5


def _percent_dcgan(m, o):
    def step(x, y, i, epoch):   # pytorch/examples' DCGAN main.py prints its losses so
        out = m(x)
        D_x = out.softmax(-1)[:, 0].mean().item()
        errD = F.cross_entropy(out, y)
        o.zero_grad()
        errD.backward()
        o.step()
        print('[%d/%d][%d/%d] Loss_D: %.4f D(x): %.4f' % (epoch, NITER, i, len(x), errD.item(), D_x))
        return errD.detach()
    return step


def _percent_logger(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        LOG.info("[%d, %5d] loss: %.3f" % (epoch + 1, i + 1, loss.item() / 2))
        return loss.detach()
    return step


def _percent_several(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        acc = (m(x).argmax(1) == y).float().mean().item()
        print("a %d" % i, "b %.2f" % loss.item(), "it %s loss %s" % (i, loss.item()), "%5.1f%%" % (acc * 100))
        return loss.detach()
    return step


@pytest.mark.parametrize("make", [_print_fstring, _logger_fstring, _str_format, _every_k, _global_counter,
                                  _multiline, _percent_dcgan, _percent_logger, _percent_several])
def test_a_number_of_the_call_in_a_printed_text_is_this_calls(make):
    want_out, want_log, want_p, _ = _run(make, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing runs at capture only
        got_out, got_log, got_p, step = _run(make, True)
    assert got_out == want_out and got_log == want_log, (got_out, got_log)
    assert len(want_out) + len(want_log) >= 4
    assert all(torch.equal(a, b) for a, b in zip(got_p, want_p))
    assert step.stats.replays >= 4 and step.stats.captures <= 2, step.stats


def _ambiguous(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        print(f"run1 step {i}")   # captured at i == 1: "run1 step 1" splits two ways
        return loss.detach()
    return step


def _percent_ambiguous(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        print("%d%d" % (epoch, i))       # captured as "01": "0|1" or "|01" or "01|"
        print("run %d1%d" % (i, epoch))  # captured as "run 110": "1|0" or "|10"
        print("%s-%s" % ("a-b", i))      # (``%s`` is str(): the value's place is found, formats.py)
        return loss.detach()
    return step


def test_a_percent_text_that_splits_two_ways_is_not_rebuilt():
    want_out, want_p, got_out, got_p, step, w = _warned_run(_percent_ambiguous)
    assert [x for x in got_out if "-" in x] == [x for x in want_out if "-" in x], got_out
    assert [x for x in got_out if "-" not in x] == [x for x in want_out if "-" not in x][:4], got_out
    assert any("print()" in str(x.message) for x in w), [str(x.message) for x in w]
    assert all(torch.equal(a, b) for a, b in zip(got_p, want_p))


def test_a_text_that_splits_two_ways_is_not_rebuilt_but_warned():
    """``f"run1 step {i}"`` captured at i == 1: the step's place could be the "1" of "run1". Not
    redone (a wrong text would be worse than none): printed at warm-up and capture, warned."""
    want_out, want_p, got_out, got_p, step, w = _warned_run(_ambiguous)
    assert got_out == want_out[:2], got_out
    assert any("print()" in str(x.message) for x in w), [str(x.message) for x in w]
    assert all(torch.equal(a, b) for a, b in zip(got_p, want_p))
    assert step.stats.replays == 5, step.stats


@pytest.mark.parametrize("disable", [False, True])
def test_a_bar_description_with_the_epoch_follows_each_call(disable):
    """``bar.set_description(f"Epoch {epoch} iter {i}")``: a library call given a number of the
    call in its text. It guarded ``i`` by value (a graph per iteration); now redone, rebuilt.
    ``disable=True`` (accelerate's bar on every rank but the main one) holds only numbers: it
    was taken for a record whose new ``postfix`` a replay could not redo, and refused."""
    tqdm = pytest.importorskip("tqdm").tqdm
    seen = []
    for compiled in (False, True):
        bar = tqdm(total=10, file=io.StringIO(), disable=disable)
        torch.manual_seed(0)
        m = nn.Linear(4, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x, y, i, epoch):
            loss = _loss(m, x, y, o)
            bar.set_description(f"Epoch {epoch} iter {i}")
            bar.set_postfix(loss=f"{loss.item():.4f}")
            return loss.detach()
        f = stepgraph.compile(step) if compiled else step
        descs = []
        g = torch.Generator().manual_seed(1)
        for i in range(7):
            f(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g), i, i // 3)
            descs.append((getattr(bar, "desc", None), getattr(bar, "postfix", None)))
        seen.append(descs)
    assert seen[0] == seen[1], seen
    assert f.stats.captures == 1 and f.stats.replays == 5, f.stats


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["cudagraph", "inductor"])
def test_a_printed_step_number_and_loss_on_cuda(backend, capsys):
    """On CUDA the print runs on the host after the graph, with the replay's number and read."""
    def run(compiled):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).cuda()
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def step(x, y, i):
            loss = _loss(m, x, y, o)
            print(f"step {i + 1}: loss {loss.item():.4f}")
            LOG.info(f"it {i}")
            return loss.detach()
        f = stepgraph.compile(step, backend=backend) if compiled else step
        rec = _Records()
        LOG.handlers[:] = [rec]
        LOG.setLevel(logging.INFO)
        LOG.propagate = False
        g = torch.Generator().manual_seed(1)
        for i in range(6):
            f(torch.randn(8, 4, generator=g).cuda(), torch.randint(0, 2, (8,), generator=g).cuda(), i)
        return capsys.readouterr().out.splitlines(), rec.lines, f
    want_out, want_log, _ = run(False)
    got_out, got_log, f = run(True)
    assert got_log == want_log and len(got_out) == len(want_out) == 6, (got_out, want_out)
    for a, b in zip(got_out, want_out):   # (the same step numbers; losses to 4 places)
        assert a.split(":")[0] == b.split(":")[0] and abs(float(a.split()[-1]) - float(b.split()[-1])) < 2e-4
    assert f.stats.captures == 1 and f.stats.replays >= 3, f.stats


def _say(text):   # a helper of the user's that prints what the step formatted
    print("LOG: " + text)


def _built_earlier(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        s = f"loss {loss.item():.3f}"
        print(s)
        _say(f"loss {loss.item():.4f} (x{2})")
        return loss.detach()
    return step


def test_a_text_built_before_its_call_is_rebuilt_not_stale():
    """``s = f"loss {loss.item():.3f}"; print(s)`` and a helper's ``print("LOG: " + text)``: the
    text holds a read value formatted on another line. Replays printed the capture's loss at
    every call (and the warning said they printed nothing); it is rebuilt from those reads."""
    want_out, _, want_p, _ = _run(_built_earlier, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got_out, _, got_p, step = _run(_built_earlier, True)
    assert got_out == want_out and len(got_out) == 14, (got_out, want_out)
    assert step.stats.replays == 5, step.stats


def _percent_in_helper(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        _say("%.3f" % loss.item())   # (formatted by C, unseen: its digits are the read's)
        return loss.detach()
    return step


def test_a_read_values_digits_in_a_text_not_rebuilt_are_never_printed_stale():
    want_out, want_p, got_out, got_p, step, w = _warned_run(_percent_in_helper)
    assert got_out == want_out[:2], got_out   # (warm-up and capture; no stale line after them)
    assert any("replays print nothing" in str(x.message) for x in w), [str(x.message) for x in w]


PREFIX = "run-2024-01"


def _not_its_text(m, o):
    def step(x, y, i, epoch):   # (helper-70's probes: each printed a wrong text, silently)
        loss = _loss(m, x, y, o)
        print("resnet18", f"step {i}")               # the step's "1" was put in "resnet18"
        print(PREFIX, f"it {i}")                     # ... in a name's text
        print("v1.0:", f"{loss.item():.1f}")         # a read's "1.0"-like text in a literal
        LOG.info("step %s loss %.1f", str(i), loss.item())   # ... in the logger's format
        print(f"[{str(i * 5):>4}]", "{:^8}|".format(f"{i * 5}"))   # padded again: the width
        print(f"R[{f'{loss.item() * 10 ** i:.1f}':>12}]")         # follows the value
        return loss.detach()
    return step


def test_a_value_is_rebuilt_only_in_the_text_it_was_formatted_into():
    want_out, want_log, want_p, _ = _run(_not_its_text, False)
    got_out, got_log, got_p, step = _run(_not_its_text, True)
    # (the padded number is used by value, a graph per call: every call's Python runs, correct)
    assert got_out == want_out and got_log == want_log, (got_out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(got_p, want_p))


def _padded_read(m, o):
    def step(x, y, i, epoch):
        loss = _loss(m, x, y, o)
        print(f"R[{f'{loss.item() * 10 ** i:.1f}':>12}]")   # a read's text padded again
        return loss.detach()
    return step


def test_a_read_values_text_padded_again_is_not_rebuilt_but_warned():
    want_out, _, got_out, _, step, w = _warned_run(_padded_read)
    assert got_out == want_out[:2], got_out
    assert any("replays print nothing" in str(x.message) for x in w), [str(x.message) for x in w]


def test_an_index_tensor_formatted_into_a_module_name_is_guarded():
    """SwitchTransformers' experts (``self[f"expert_{expert_idx[0]}"]``): an integer tensor
    formatted into a key picks the module. It was taken for a print, unguarded: a replay that
    routed to other experts ran and updated the capture's (helper-72's sweep, transformers 5.24).
    Now the text's use guards the value; the same index printed stays unguarded (below)."""
    torch.manual_seed(0)
    experts = nn.ModuleDict({f"expert_{i}": nn.Linear(4, 4) for i in range(4)})
    twin = copy.deepcopy(experts)

    def make(ex):
        opt = torch.optim.SGD(ex.parameters(), lr=0.1)

        def step(x, sel):
            out = torch.zeros_like(x)
            for e in torch.bincount(sel, minlength=4).gt(0).nonzero():
                out = out + ex[f"expert_{e[0]}"](x) * (sel == e[0]).float()[:, None]
            loss = out.square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    f, eager = stepgraph.compile(make(experts)), make(twin)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, sel in enumerate([[0, 1, 0, 1], [0, 1, 1, 0], [2, 3, 3, 2], [2, 3, 2, 3], [0, 1, 1, 1]]):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(k))
            assert torch.equal(f(x, torch.tensor(sel)), eager(x, torch.tensor(sel))), k
    assert all(torch.equal(a, b) for a, b in zip(experts.parameters(), twin.parameters()))
    assert f.stats.captures == 2 and f.stats.replays == 2


def test_an_integer_tensor_printed_in_an_f_string_is_no_guard(capsys):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @stepgraph.compile
    def step(x, y):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"correct {(logits.argmax(1) == y).sum()}")
        return loss

    with pytest.warns(UserWarning, match="replays print nothing"):
        for k in range(5):
            g = torch.Generator().manual_seed(k)
            step(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
    assert step.stats.captures == 1 and step.stats.replays == 3
    assert capsys.readouterr().out.count("correct ") == 2   # (warm-up and capture, as before)
