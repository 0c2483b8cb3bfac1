"""Values a helper function reads through its parameter: ``compute_loss(cfg, out, y)`` called
from the step with a configuration object (a global, a closure's, a namespace of settings).
The scan cannot tell what the parameter holds, so ``cfg.aux_weight`` was read by no guard: the
loop changed it between calls and replays kept the captured value, silently (helper-90). The
warm-up call records what the step binds to its helpers' parameters (capture/callbinds.py)."""
import argparse

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import stepgraph

pytestmark = pytest.mark.usefixtures("one_thread")


class Cfg:
    def __init__(self):
        self.aux_weight, self.use_aux, self.class_weights, self.arr = 1.0, False, [1.0, 1.0, 1.0], np.ones(3)


def compute_loss(c, out, y, kind):
    loss = F.mse_loss(out, y)
    if kind == "float":
        return loss + c.aux_weight * out.pow(2).mean()
    if kind == "flag":
        return loss + 5.0 * out.pow(2).mean() if c.use_aux else loss
    if kind == "list":
        return (torch.tensor(c.class_weights) * (out - y).pow(2)).mean()
    if kind == "namespace":
        return loss * c.scale
    return (torch.as_tensor(c.arr, dtype=torch.float32) * (out - y).pow(2)).mean()


def change(c):
    c.aux_weight, c.use_aux, c.class_weights, c.arr = 5.0, True, [5.0, 5.0, 5.0], np.full(3, 5.0)
    c.scale = 0.5


@pytest.mark.parametrize("kind", ["float", "flag", "list", "array", "namespace"])
def test_a_setting_a_helper_reads_through_its_parameter_changed_between_calls(kind):
    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = argparse.Namespace(scale=1.0) if kind == "namespace" else Cfg()

        def step(x, y):
            loss = compute_loss(cfg, model(x), y, kind)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()
        fn = stepgraph.compile(step) if compiled else step
        out = []
        for i in range(6):
            if i == 3:
                change(cfg)
            g = torch.Generator().manual_seed(i)
            out.append(fn(torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)))
        return fn, out
    sg, got = run(True)
    _, want = run(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert sg.stats.replays >= 2, sg.stats


def test_a_users_profiler_is_left_alone():
    """The warm-up's record needs ``sys.setprofile``: under the user's cProfile it records nothing
    and the profiler keeps running."""
    import cProfile
    import sys
    model = torch.nn.Linear(3, 3)
    cfg = Cfg()
    fn = stepgraph.compile(lambda x: compute_loss(cfg, model(x), x, "float"))
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn(torch.randn(2, 3))
        still = sys.getprofile()
    finally:
        prof.disable()
    assert still is not None and fn.stats.eager_calls == 1


class _Pool:   # (CycleGAN's ImagePool, filling phase)
    def __init__(self, size):
        self.pool_size, self.num_imgs, self.images = size, 0, []

    def query(self, image):
        if self.num_imgs < self.pool_size:
            self.num_imgs = self.num_imgs + 1
            self.images = self.images + [image]
        return image


def test_a_method_reached_through_getattr_is_scanned_with_its_object():
    """``getattr(pool, method)(fake)`` (the method's name from a config): no chain in the step's
    code names ``query``, so its writes to ``self`` were never seen: the pool stopped filling
    after the capture, silently (helper-94 F2). The warm-up records the bound method; its writes
    are then refused as ``pool.query(fake)``'s are, the state left as eager's."""
    torch.manual_seed(0)
    G, D = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    oG, oD = torch.optim.SGD(G.parameters(), lr=0.1), torch.optim.SGD(D.parameters(), lr=0.1)
    pool, method = _Pool(50), "query"

    def step(x):
        fake = G(x)
        lossG = -D(fake).mean()
        oG.zero_grad()
        lossG.backward()
        oG.step()
        f = getattr(pool, method)(fake.detach())
        lossD = D(f).mean() - D(x).mean()
        oD.zero_grad()
        lossD.backward()
        oD.step()
        return lossD.detach()
    sg = stepgraph.compile(step)
    done = 0
    for _ in range(4):
        try:
            sg(torch.randn(2, 4))
        except stepgraph.CaptureError as e:
            assert "self.images" in str(e) or "pool" in str(e), e
        done += 1
        assert pool.num_imgs == len(pool.images) == done   # (as eager: every call adds one)
