"""DistributedDataParallel steps captured and replayed (issue 7).

Multi-process cases run tests/ddp_worker.py under torchrun with 2 gloo ranks on the CPU (the
same worker runs with NCCL on GPUs through scripts/device_suite.sh); each compares a stepgraph
DDP model with an eager DDP twin fed the same per-rank batches, bitwise.
"""
import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import stepgraph
from parity import ce_step

WORKER = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
needs_dist = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


GPUS = os.environ.get("STEPGRAPH_TEST_CUDA") and torch.cuda.is_available() and torch.cuda.device_count() >= 2


def launch(scenario, tmp_path, nproc=2, timeout=240, cuda=GPUS, **env):
    """Run one scenario on ``nproc`` ranks (NCCL on GPUs when there are 2 and
    STEPGRAPH_TEST_CUDA=1, else gloo); return each rank's JSON result and the wall time."""
    e = dict(os.environ, STEPGRAPH_DIST_TIMEOUT="4", PG_TIMEOUT="30", OMP_NUM_THREADS="1",
             DDP_DEVICE="cuda" if cuda else "cpu", **env)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", WORKER, scenario, str(tmp_path)],
                       env=e, capture_output=True, text=True, timeout=timeout)
    seconds = time.time() - t0
    results = []
    for r in range(nproc):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        results.append(json.loads(f.read_text()))
    return results, seconds


@needs_dist
def test_ddp_steps_match_eager_ddp_bitwise(tmp_path):
    ranks, _ = launch("parity", tmp_path)
    for r, res in enumerate(ranks):
        for case in ("mlp_bn_adamw", "gpt_sgd_buckets", "bucket_view_static_graph", "accumulate_no_sync"):
            got = res[case]
            assert got["max_diff"] == 0.0 and got["loss_diff"] == 0.0, (r, case, got)
            assert got["captures"] == 1 and got["replays"] == 4 and not got["recaptures"], (r, case, got)
            assert got["explain_has_collective"], "the gradient all-reduce must be in the graph"
        ind = res["inductor"]  # the whole step fused by Inductor, all-reduce included
        assert ind["max_diff"] < 1e-5 and ind["loss_rel"] < 1e-5 and ind["captures"] == 1, (r, ind)
        acc = res["accumulate_across_calls"]
        # no_sync() calls and syncing calls are two graphs (plus one for .grad None after zero_grad)
        assert acc["max_diff"] == 0.0 and acc["captures"] == 3, acc
        assert any("no_sync" in reason for reason in acc["recaptures"]), acc
        out = res["backward_outside"]
        assert "no backward" in out["error"] and out["max_diff"] == 0.0, out


@needs_dist
def test_collectives_the_step_calls_itself_are_captured_and_match_eager(tmp_path):
    """dist.broadcast / all_gather_into_tensor / all_gather / all_reduce written in the step (no
    DDP: a hand-written gradient sync, DINO's center, gathered negatives): one graph, bitwise
    eager on every rank; async_op=True (a Work in the user's hands) is refused at its line."""
    ranks, _ = launch("direct_collectives", tmp_path)
    for r, res in enumerate(ranks):
        got = res["collectives"]
        assert got["max_diff"] == 0.0 and got["loss_diff"] == 0.0, (r, got)
        assert got["captures"] == 1 and got["replays"] == 4 and got["graph_has_collective"], (r, got)
        err = res["async"]["error"]
        assert err and "async_op=True" in err and "ddp_worker.py" in err, (r, err)


@needs_dist
def test_ranks_of_a_step_with_its_own_collectives_agree_before_the_first_capture(tmp_path):
    ranks, _ = launch("direct_disagree", tmp_path)
    for res in ranks:
        assert res["error"] and res["error"].startswith("CaptureError: ranks disagree"), res
        assert res["seconds"] < 10


@needs_dist
def test_ranks_disagreeing_on_shapes_fail_on_every_rank(tmp_path):
    ranks, _ = launch("disagree_shapes", tmp_path)
    for res in ranks:
        assert res["error"].startswith("CaptureError: ranks disagree"), res
        assert "rank 0: capture at call 2 with inputs (float32[8, 8]" in res["error"]
        assert "rank 1: capture at call 2 with inputs (float32[6, 8]" in res["error"]
        assert res["seconds"] < 10


@needs_dist
def test_one_rank_recapturing_while_others_replay_fails_on_every_rank_within_timeout(tmp_path):
    # gloo (CPU): the replaying rank's collective fails as soon as its peer's process ends (gloo
    # has no abort that interrupts an op in flight; otherwise at the group's timeout).
    ranks, seconds = launch("one_rank_recaptures", tmp_path, cuda=False, LINGER="0")
    r0, r1 = ranks
    assert r1["error"].startswith("CaptureError: rank 1 is about to capture"), r1
    assert "rank(s) [0] did not reach" in r1["error"] and "within 4 s" in r1["error"]
    assert r0["error"].startswith("StepGraphError: a collective of the replayed graph failed"), r0
    assert r0["seconds"] < 30 and r1["seconds"] < 30, (r0, r1)


@pytest.mark.skipif(not GPUS, reason="needs 2 GPUs and STEPGRAPH_TEST_CUDA=1")
def test_nccl_replaying_rank_is_aborted_while_the_recapturing_rank_lives_on(tmp_path):
    """NCCL: rank 1 gives up and stays alive (12 s); rank 0, stuck in its replay's all-reduce,
    must still fail well before the process group's timeout (30 s): its stepgraph monitor sees
    rank 1's give-up in the store and aborts the NCCL communicator."""
    ranks, _ = launch("one_rank_recaptures", tmp_path, cuda=True, LINGER="12")
    r0, r1 = ranks
    assert r1["error"].startswith("CaptureError: rank 1 is about to capture"), r1
    assert r0["error"] is not None and r0["seconds"] < 12, r0
    print("rank 0 error:", r0["error"][:300], f"after {r0['seconds']:.1f} s")


# ---- single process (a world of one): fast checks of the error paths ----------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_world_of_one_ddp_matches_eager_and_shows_the_collective(world_of_one):
    base = _mlp()
    m, m2 = (nn.parallel.DistributedDataParallel(copy.deepcopy(base)) for _ in range(2))
    opt, opt2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    sg, eager = stepgraph.compile(ce_step(m, opt)), ce_step(m2, opt2)
    for i in range(5):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        assert torch.equal(sg(x, y), eager(x, y))
    assert sg.stats.replays == 3
    assert "_c10d_functional.all_reduce" in sg.graph.code
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_find_unused_parameters_is_refused_leaving_eager_state(world_of_one):
    """Refused with a CaptureError; like every refused capture, the call itself ran eagerly first
    (failures.py), so the model holds what an eager DDP step leaves."""
    m = nn.parallel.DistributedDataParallel(_mlp(), find_unused_parameters=True)
    m2 = nn.parallel.DistributedDataParallel(_mlp(), find_unused_parameters=True)
    opt, opt2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    sg, eager = stepgraph.compile(ce_step(m, opt)), ce_step(m2, opt2)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    sg(x, y), eager(x, y)
    with pytest.raises(stepgraph.CaptureError, match="find_unused_parameters=True") as e:
        sg(x, y)
    eager(x, y)
    assert "find_unused_parameters=False" in e.value.fix
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters())), "this call ran as eager"


def test_direct_collectives_are_traced_and_an_async_one_is_refused(world_of_one):
    """``dist.all_reduce(p.grad)`` in the step becomes a functional all-reduce (collectives.py):
    captured, replayed, equal to eager. With async_op=True the Work handle is the user's: refused
    at the user's line, the call run as eager."""
    m, m2 = _mlp(), _mlp()
    m2.load_state_dict(m.state_dict())
    opt, opt2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def mk(model, o, async_op=False):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            for p in model.parameters():
                work = dist.all_reduce(p.grad, async_op=async_op)
                if async_op:
                    work.wait()
            o.step()
            o.zero_grad()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(m, opt)), mk(m2, opt2)
    for k in range(4):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        assert torch.equal(sg(x, y), eager(x, y)), k
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters())), k
    assert (sg.stats.captures, sg.stats.replays) == (1, 2)
    assert "all_reduce" in sg.graph.code
    sg = stepgraph.compile(mk(m, opt, async_op=True))
    sg(x, y)
    with pytest.raises(stepgraph.CaptureError, match="async_op=True") as e:
        sg(x, y)
    assert "torch.distributed module" in e.value.fix and "test_distributed.py" in str(e.value)


def test_functional_collectives_in_a_user_step_are_captured(world_of_one):
    from torch.distributed import _functional_collectives as fcol
    m, m2 = _mlp(), _mlp()
    opt, opt2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def mk(model, o):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            for p in model.parameters():
                p.grad.copy_(fcol.all_reduce(p.grad, "sum", dist.group.WORLD))
            o.step()
            o.zero_grad()
            return fcol.all_reduce(loss.detach(), "avg", dist.group.WORLD)
        return step
    sg, eager = stepgraph.compile(mk(m, opt)), mk(m2, opt2)
    for _ in range(4):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        assert torch.equal(sg(x, y), eager(x, y))
    assert sg.stats.replays == 2
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


def test_no_sync_around_the_call_is_a_guard_with_a_reason(world_of_one):
    m = nn.parallel.DistributedDataParallel(_mlp())

    def backward_only(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss
    sg = stepgraph.compile(backward_only)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    sg(x, y)
    sg(x, y)
    with m.no_sync():
        sg(x, y)
    assert "no_sync()" in sg.stats.recaptures[-1]


@needs_dist
def test_readme_ddp_benchmark_command_runs_on_cpu(tmp_path):
    """`torchrun --standalone --nproc_per_node 2 -m stepgraph.bench_ddp --device cpu` (README)."""
    e = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "stepgraph.bench_ddp", "--device", "cpu", "--cases", "mlp64", "--steps", "5",
                        "--warmup", "1", "--out", str(tmp_path)], env=e, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_ddp.json").read_text())["rows"]
    sg = [r for r in rows if r["variant"] == "stepgraph"][0]
    assert sg["captures"] == 1 and sg["replays"] == 3 + 1 + 5 - 2 and not sg["recaptures"], sg  # 1 eager, 1 capture
    assert "| mlp64 | stepgraph |" in p.stdout


def test_two_ddp_models_in_one_step(world_of_one):
    """A step training two DDP models (e.g. generator and discriminator) syncs both."""
    torch.manual_seed(0)
    a, b = _mlp(), nn.Sequential(nn.Linear(4, 4))
    a2, b2 = copy.deepcopy(a), copy.deepcopy(b)
    ma, mb = nn.parallel.DistributedDataParallel(a), nn.parallel.DistributedDataParallel(b)
    ma2, mb2 = nn.parallel.DistributedDataParallel(a2), nn.parallel.DistributedDataParallel(b2)
    opt = torch.optim.SGD(list(ma.parameters()) + list(mb.parameters()), lr=0.1)
    opt2 = torch.optim.SGD(list(ma2.parameters()) + list(mb2.parameters()), lr=0.1)

    def mk(m1, m2, o):
        def step(x, y):
            loss = F.cross_entropy(m2(m1(x)), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return step
    sg, eager = stepgraph.compile(mk(ma, mb, opt)), mk(ma2, mb2, opt2)
    for _ in range(4):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        assert torch.equal(sg(x, y), eager(x, y))
    assert sg.stats.replays == 2
    assert sg.graph.code.count("_c10d_functional.all_reduce") == 2  # one bucket per model
    for p, q in zip(list(ma.parameters()) + list(mb.parameters()), list(ma2.parameters()) + list(mb2.parameters())):
        assert torch.equal(p, q)


@needs_dist
def test_a_host_read_differing_on_one_rank_after_the_allreduce_is_refused_on_every_rank(tmp_path):
    """Issue 17 (segments under DDP): a value read after the backward (DDP's all-reduce done)
    differs on rank 0 only, at call 5. Capturing it again would all-reduce a second time on
    rank 0 alone; the ranks' agreement refuses it instead, on every rank within the timeout (no
    hang), and rank 0's error names the read and a fix for a value that differs across ranks."""
    ranks, seconds = launch("host_read_after_allreduce", tmp_path)
    assert seconds < 120, seconds
    err0, err1 = ranks[0]["error"], ranks[1]["error"]
    assert err0.startswith("CaptureError: rank 0 is about to capture") and "host read at" in err0, err0
    assert "ddp_worker.py" in err0 and "all_reduce of the value, or of a skip flag" in err0, err0
    assert err1 and ("collective" in err1 or "rank agreement" in err1 or "CaptureError" in err1), err1


@needs_dist
def test_a_host_read_after_the_allreduce_that_every_rank_sees_change_recaptures_in_step(tmp_path):
    """The same skip-step read, its value changing on every rank at the same call: the ranks
    recapture together (their segments agree) and every rank ends bitwise equal to eager DDP."""
    ranks, _ = launch("host_read_after_allreduce", tmp_path, SAME_GATE="1")
    for r, res in enumerate(ranks):
        assert res["error"] is None, (r, res)
        assert res["max_diff"] == 0.0 and res["loss_diff"] == 0.0, (r, res)
        assert res["captures"] == 2 and res["replays"] >= 5, (r, res)
