"""FSDP2 (torch.distributed.fsdp.fully_shard) steps: issue 19.

Not captured yet (docs/fsdp2.md says what blocks it): a step holding a fully_shard'ed model is
refused before anything is traced, with a CaptureError naming FSDP2; the call runs as eager FSDP2
would, so the model, its DTensor shards and the optimizer state equal an eager twin's bitwise.
The multi-process cases run tests/fsdp2_worker.py under torchrun with 2 gloo ranks on the CPU.
"""
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.usefixtures("one_thread")
WORKER = os.path.join(os.path.dirname(__file__), "fsdp2_worker.py")
needs_dist = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def launch(scenario, tmp_path, nproc=2, timeout=300):
    e = dict(os.environ, STEPGRAPH_DIST_TIMEOUT="4", PG_TIMEOUT="60", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", WORKER, scenario, str(tmp_path)],
                       env=e, capture_output=True, text=True, timeout=timeout)
    results = []
    for r in range(nproc):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        results.append(json.loads(f.read_text()))
    return results


@needs_dist
def test_fsdp2_step_is_refused_before_tracing_and_state_stays_eager(tmp_path):
    """Per-block + root fully_shard, reshard_after_forward True and False, clip_grad_norm_ over
    DTensor grads, foreach AdamW: every call's state equals eager FSDP2's, bitwise (state_dict too)."""
    for r, res in enumerate(launch("fsdp2", tmp_path)):
        for case, got in res.items():
            assert got["max_diff"] == 0.0 and got["loss_diff"] == 0.0, (r, case, got)
            assert got["captures"] == 0 and got["replays"] == 0, (r, case, got)
            if case.endswith("raise"):
                # calls 2..6 each try to capture, are refused, and ran eagerly to their end
                assert len(got["errors"]) == 5, (r, case, got)
                err = got["errors"][0]
                assert "FSDP2" in err and "fully_shard" in err and "ran eagerly to its end" in err, err
                assert "on_capture_error='eager'" in err, err
            else:  # on_capture_error="eager": one warning, eager from then on
                assert got["errors"] == [] and got["eager_calls"] == 6, (r, case, got)


@pytest.fixture
def world_of_one(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp2_model_passed_as_an_argument_is_refused_too(world_of_one):
    """Found among the call's arguments as well as in the closure; the error names the module."""
    import torch
    import torch.nn.functional as F

    import stepgraph
    from fsdp2_worker import max_diff, sharded_mlp
    a, b = sharded_mlp(False), sharded_mlp(False)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)

    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    sg = stepgraph.compile(step)
    for i in range(3):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        if i == 0:
            sg(a, oa, x, y)   # warm-up: eager
        else:
            with pytest.raises(stepgraph.CaptureError, match=r"FSDP2 \(torch.distributed.fsdp.fully_shard\)") as e:
                sg(a, oa, x, y)
            assert e.value.op.startswith("FSDP2 ") and "on_capture_error='eager'" in e.value.fix
        step(b, ob, x, y)
        assert max_diff(a, oa, b, ob) == 0.0
    assert sg.stats.captures == 0
