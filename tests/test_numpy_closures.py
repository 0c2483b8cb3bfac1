"""numpy arrays the step reads from its closure or globals (capture/schedules.py, pyvalues.guard_value).
A graph bakes the values it reads, and numpy keeps no version counter: class weights changed in
place between calls were silently the old ones in every replay. A small array is keyed by its
bytes (a change is a new graph, with its reason); a large one read so is refused at the user's
line with a fix that works; one only indexed by the iteration (a schedule) is read live."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepgraph


def twins():
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    t = copy.deepcopy(m)
    return m, torch.optim.SGD(m.parameters(), lr=0.1), t, torch.optim.SGD(t.parameters(), lr=0.1)


@pytest.mark.parametrize("read", ["from_numpy", "tensor", "float_of_item", "as_tensor_slice"])
def test_class_weights_changed_in_place_between_calls(read):
    cw = np.ones(3, dtype=np.float32)
    m, o, t, to = twins()

    def mk(model, opt):
        def step(x, y):
            if read == "from_numpy":
                loss = F.cross_entropy(model(x), y, weight=torch.from_numpy(cw))
            elif read == "tensor":
                loss = F.cross_entropy(model(x), y, weight=torch.tensor(cw))
            elif read == "float_of_item":
                loss = F.cross_entropy(model(x), y) * float(cw[0]) + float(cw[2])
            else:
                loss = F.cross_entropy(model(x), y, weight=torch.as_tensor(cw[:3]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(m, o)), mk(t, to)
    for k in range(6):
        cw[:] = [1 + k % 3, 1, 2 + k * k]
        x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        assert torch.equal(sg(x, y), eager(x, y)), k
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), t.parameters())), k
    assert any("array float32[3]" in r for r in sg.stats.recaptures), sg.stats.recaptures
    # unchanged values: the graph for them replays
    replays = sg.stats.replays
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    assert torch.equal(sg(x, y), eager(x, y)) and sg.stats.replays == replays + 1


def test_a_large_array_read_by_the_step_is_refused_with_a_fix_that_works():
    table = np.ones(4096, dtype=np.float32)
    m, o, t, to = twins()

    def mk(model, opt, w):
        def step(x, y):
            loss = F.cross_entropy(model(x), y, weight=w()[:3])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    def direct(model, opt):   # (read in the step's own code)
        def step(x, y):
            loss = F.cross_entropy(model(x), y, weight=torch.from_numpy(table)[:3])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    sg = stepgraph.compile(direct(m, o))
    eager = direct(t, to)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    sg(x, y), eager(x, y)
    with pytest.raises(stepgraph.CaptureError, match="numpy array table") as e:
        sg(x, y)
    eager(x, y)
    assert "test_numpy_closures.py" in str(e.value) and "torch.from_numpy" in e.value.fix
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), t.parameters()))
    # read by a function the step calls (``w()``): a data call, made before the step at each
    # call (capture/dataorder.py), so a changed table is what the step uses
    sg = stepgraph.compile(mk(m, o, lambda: torch.from_numpy(table)))
    eager = mk(t, to, lambda: torch.from_numpy(table))
    for k in range(4):
        table[:3] = [1 + k, 2, 1 + k * k]
        x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        assert torch.equal(sg(x, y), eager(x, y)), k
    assert sg.stats.replays >= 1
    table[:3] = 1
    # the fix: a tensor made once outside the step, sharing the array's memory
    shared = torch.from_numpy(table)
    sg = stepgraph.compile(mk(m, o, lambda: shared))
    for k in range(5):
        table[:3] = [1 + k, 1, 2 + k * k]
        x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        assert torch.equal(sg(x, y), eager(x, y)), k
    assert sg.stats.captures == 1


def test_a_write_into_a_closure_array_is_refused():
    seen = np.zeros(3, dtype=np.int64)
    m, o, *_ = twins()

    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        seen[0] += 1
        loss.backward()
        o.step()
        o.zero_grad()
        return loss
    sg = stepgraph.compile(step)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    sg(x, y)
    with pytest.raises(stepgraph.CaptureError, match="writes into the numpy array seen"):
        sg(x, y)
    assert seen[0] == 2   # the refused call ran as eager


def test_a_list_of_numpy_observations_refilled_between_calls():
    """minimalRL's PPO keeps its rollout in ``self.data`` (numpy observations) and builds the batch
    in the step with ``torch.tensor(self.data)``. The list was keyed by identity and length: a
    list emptied and refilled outside the step replayed the first batch, silently."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.data = []
            self.fc = nn.Linear(4, 1)

        def step(self, opt):
            x = torch.tensor(np.array(self.data), dtype=torch.float)
            loss = (self.fc(x) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
    torch.manual_seed(0)
    a = M()
    b = copy.deepcopy(a)
    oa, ob = (torch.optim.Adam(m.fc.parameters(), lr=1e-2) for m in (a, b))
    sg = stepgraph.compile(lambda: a.step(oa))
    rng = np.random.default_rng(0)
    for k in range(5):
        obs = [rng.standard_normal(4).astype(np.float32) for _ in range(3)]
        del a.data[:], b.data[:]
        a.data.extend(obs)
        b.data.extend(obs)
        assert torch.equal(sg(), b.step(ob)), k
    assert any("holding numpy arrays" in r for r in sg.stats.recaptures), sg.stats.recaptures


def test_a_numpy_scalar_compared_with_a_live_closure_float():
    """spinningup's PPO update: ``kl = mpi_avg(pi_info['kl'])`` is a numpy float32 and
    ``if kl > 1.5 * target_kl: break`` compares it with a closure float stepgraph reads live:
    a TypeError inside the trace before (float and numpy both declined the comparison)."""
    import numpy as np

    def make(target_kl):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        def update(x):
            for _ in range(3):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                kl = np.float32(loss.item())
                if kl > 1.5 * target_kl:
                    break
                loss.backward()
                opt.step()
            return loss.detach()
        return model, update
    (m1, eager), (m2, upd) = make(0.5), make(0.5)
    sg = stepgraph.compile(upd)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(16, 4, generator=g) * 0.3
        assert torch.equal(sg(x), eager(x))
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


@pytest.mark.parametrize("draw", ["numpy", "python"])
def test_a_refused_capture_puts_back_the_host_random_draws_it_made(draw):
    """nerf-pytorch: ``img_i = np.random.choice(...)`` then a refused read of a large array. The
    call runs eagerly from its start after the refusal, so the trace's draw must be undone: it
    was not, the rerun drew again (another image trained on) and numpy's stream stayed one
    draw ahead for the rest of the program."""
    import random
    images = np.random.default_rng(0).uniform(size=(3, 32, 32, 3)).astype(np.float32)   # > 4096 bytes

    def run(use_sg):
        np.random.seed(0)
        random.seed(0)
        m, o, _, _ = twins()

        def step():
            i = int(np.random.choice(3)) if draw == "numpy" else random.randrange(3)
            x = torch.as_tensor(images[i]).reshape(-1, 3)[:, :3].repeat(1, 2)[:, :4]
            loss = F.mse_loss(m(x), x[:, :3])
            o.zero_grad()
            loss.backward()
            o.step()
        f = stepgraph.compile(step) if use_sg else step
        refused = False
        for _ in range(3):
            try:
                f()
            except stepgraph.CaptureError:
                refused = True
        return m.weight.detach().clone(), np.random.randint(1 << 30), random.random(), refused

    want, got = run(False), run(True)
    assert got[3], "the large array read must be refused"
    assert torch.equal(got[0], want[0]) and got[1:3] == want[1:3]
