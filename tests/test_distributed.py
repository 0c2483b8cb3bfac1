"""torch.distributed inside a step: until collectives are captured (issue 7), a DDP step is
refused with a CaptureError at the capture call, never replayed with unsynchronised ranks."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import stepgraph


@pytest.fixture
def gloo_world_of_one(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_step_is_refused_and_state_matches_eager(gloo_world_of_one):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    m, m2 = nn.parallel.DistributedDataParallel(copy.deepcopy(base)), nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt, opt2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def mk(mm, o):
        def step(x, y):
            loss = F.cross_entropy(mm(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(m, opt)), mk(m2, opt2)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    sg(x, y)
    eager(x, y)
    with pytest.raises(stepgraph.CaptureError, match="collectives") as e:
        sg(x, y)
    assert "graph_module" in e.value.fix
    eager(x, y)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q), "the refused capture call must leave state as eager does"
