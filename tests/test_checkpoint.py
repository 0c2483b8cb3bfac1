"""Checkpoints: state_dict / load_state_dict / torch.save across a stepgraph run lose nothing.

* ``state_dict()`` of model and optimizer taken mid-run (after replays) is bitwise equal to an
  eager twin's, and each replay really advances it.
* Rewinding to a saved checkpoint (``load_state_dict`` of model + optimizer mid-run) continues
  exactly as eager does, bitwise, with the recapture reason naming the replaced optimizer state;
  and re-running the same batches from the checkpoint reproduces the first run.
* A checkpoint written with ``torch.save`` is resumed in a NEW process that continues with
  stepgraph; its final parameters equal an uninterrupted eager run of the same total steps.
"""
import copy
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import stepgraph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model, batches and step, as source: the subprocess test executes the very same text.
COMMON = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    def make_opt(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def batch(k, n=8):
        g = torch.Generator().manual_seed(7000 + k)
        return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)

    def train_step(model, opt):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
''')
exec(COMMON)  # defines make_model, make_opt, batch, train_step here


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


class Pair:
    def __init__(self):
        self.model = make_model()  # noqa: F821 (defined by exec above)
        self.twin = copy.deepcopy(self.model)
        self.opt, self.topt = make_opt(self.model), make_opt(self.twin)  # noqa: F821
        self.step = stepgraph.compile(train_step(self.model, self.opt))  # noqa: F821
        self.eager = train_step(self.twin, self.topt)  # noqa: F821

    def counts(self):
        s = self.step.stats
        return s.eager_calls, s.captures, s.replays

    def __call__(self, k):
        x, y = batch(k)  # noqa: F821
        got = self.step(x, y)
        want = self.eager(x.clone(), y.clone())
        assert torch.equal(got, want), f"batch {k}: loss {got} != eager {want}"
        assert_same_checkpoint(self.checkpoint(), self.twin_checkpoint(), f"after batch {k}")
        return got

    def checkpoint(self):
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def twin_checkpoint(self):
        return {"model": self.twin.state_dict(), "opt": self.topt.state_dict()}


def frozen(ckpt):
    """A deep copy: state_dict() holds references to the live tensors, which later steps update."""
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same_checkpoint(a, b, where=""):
    ma, mb = a["model"], b["model"]
    assert ma.keys() == mb.keys()
    for k in ma:
        assert ma[k].dtype == mb[k].dtype and torch.equal(ma[k], mb[k]), f"{where}: model {k} differs"
    oa, ob = a["opt"], b["opt"]
    assert oa["param_groups"] == ob["param_groups"], f"{where}: param_groups differ"
    assert oa["state"].keys() == ob["state"].keys(), f"{where}: optimizer state entries differ"
    for i in oa["state"]:
        sa, sb = oa["state"][i], ob["state"][i]
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), f"{where}: optimizer state[{i}][{k!r}] differs"
            else:
                assert sa[k] == sb[k], f"{where}: optimizer state[{i}][{k!r}] differs"


def test_state_dict_mid_run_reflects_latest_replay():
    p = Pair()
    for k in range(4):
        p(k)
    assert p.counts() == (1, 1, 2)
    before = frozen(p.checkpoint())
    assert int(before["opt"]["state"][0]["step"]) == 4
    p(4)  # one more replay
    assert p.counts() == (1, 1, 3)
    after = p.checkpoint()
    # the replay advanced every parameter and every optimizer state tensor (not a stale copy)
    for k in before["model"]:
        assert not torch.equal(before["model"][k], after["model"][k]), f"replay did not update {k}"
    for i, st in before["opt"]["state"].items():
        for name, v in st.items():
            assert not torch.equal(v, after["opt"]["state"][i][name]), f"replay did not update state {name}"
    assert int(after["opt"]["state"][0]["step"]) == 5
    # ... and a frozen copy of it equals the eager twin's
    assert_same_checkpoint(frozen(after), frozen(p.twin_checkpoint()), "frozen after replay")


def test_rewind_to_checkpoint_continues_bitwise():
    p = Pair()
    for k in range(4):
        p(k)
    saved = frozen(p.checkpoint())
    twin_saved = frozen(p.twin_checkpoint())
    first = []
    for k in range(4, 7):
        p(k)
        first.append(frozen(p.checkpoint()))
    assert p.counts() == (1, 1, 5)
    # rewind both to the checkpoint, then redo the same batches
    p.model.load_state_dict(saved["model"])
    p.opt.load_state_dict(saved["opt"])
    p.twin.load_state_dict(twin_saved["model"])
    p.topt.load_state_dict(twin_saved["opt"])
    assert_same_checkpoint(p.checkpoint(), saved, "right after load_state_dict")
    for i, k in enumerate(range(4, 7)):
        p(k)
        assert_same_checkpoint(p.checkpoint(), first[i], f"rerun of batch {k} after rewind")
    assert p.counts() == (1, 2, 7), p.step.stats
    assert len(p.step.stats.recaptures) == 1, p.step.stats.recaptures
    reason = p.step.stats.recaptures[0]
    assert "replaced" in reason and "opt" in reason, reason
    for k in range(7, 10):  # and onwards, past the first run
        p(k)
    assert p.counts() == (1, 2, 10)


def test_model_only_load_state_dict_needs_no_recapture():
    """``model.load_state_dict`` copies into the same Parameter tensors: the graph stays valid."""
    p = Pair()
    for k in range(3):
        p(k)
    saved = frozen({"model": p.model.state_dict()})["model"]
    for k in range(3, 5):
        p(k)
    p.model.load_state_dict(saved)
    p.twin.load_state_dict(saved)
    for k in range(5, 8):
        p(k)
    assert p.counts() == (1, 1, 6) and p.step.stats.recaptures == [], p.step.stats


def test_checkpoint_resumed_in_a_new_process(tmp_path):
    K, N = 4, 5  # steps before the checkpoint, steps in the new process
    model = make_model()  # noqa: F821
    opt = make_opt(model)  # noqa: F821
    step = stepgraph.compile(train_step(model, opt))  # noqa: F821
    for k in range(K):
        step(*batch(k))  # noqa: F821
    assert step.stats.replays == K - 2
    ckpt = tmp_path / "ckpt.pt"
    out = tmp_path / "params.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)

    script = COMMON + textwrap.dedent(f'''
        import json
        import stepgraph
        torch.set_num_threads({torch.get_num_threads()})  # the parent's setting: same kernels
        model = make_model()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # prove the weights come from the checkpoint
        opt = make_opt(model)
        state = torch.load({str(ckpt)!r}, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = stepgraph.compile(train_step(model, opt))
        for k in range({K}, {K + N}):
            step(*batch(k))
        torch.save({{"model": model.state_dict(), "opt": opt.state_dict()}}, {str(out)!r})
        s = step.stats
        print(json.dumps(dict(eager_calls=s.eager_calls, captures=s.captures, replays=s.replays)))
    ''')
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats == dict(eager_calls=1, captures=1, replays=N - 2), stats

    # an uninterrupted eager run of the same K + N steps
    ref = make_model()  # noqa: F821
    ref_opt = make_opt(ref)  # noqa: F821
    eager = train_step(ref, ref_opt)  # noqa: F821
    for k in range(K + N):
        eager(*batch(k))  # noqa: F821
    resumed = torch.load(out, weights_only=True)
    assert_same_checkpoint(resumed, {"model": ref.state_dict(), "opt": ref_opt.state_dict()},
                           "resumed in a new process vs uninterrupted eager")
