"""FSDP2 (torch.distributed.fsdp.fully_shard) steps: issue 19.

A step calling a fully_shard'ed model is captured whole (stepgraph/capture/fsdp.py, docs/fsdp2.md):
FSDP2's all-gathers and reduce-scatters become functional collectives in the graph, its storage
frees graph ops. Each case compares with an eager FSDP2 twin fed the same per-rank batches,
bitwise. The multi-process cases run tests/fsdp2_worker.py under torchrun with 2 gloo ranks on
the CPU, or 2 NCCL ranks on 2 GPUs when STEPGRAPH_TEST_CUDA=1 (scripts/device_suite.sh, MULTI=1).
On CUDA stepgraph switches AdamW to its capturable form when it captures; the eager twin is
switched the same way at the same call (fsdp2.match_optimizer_form), so it stays bitwise there too.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.usefixtures("one_thread")
WORKER = os.path.join(os.path.dirname(__file__), "fsdp2_worker.py")
needs_dist = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
# As test_distributed's launch: NCCL, one GPU per rank, when asked for and there are 2 GPUs.
GPUS = bool(os.environ.get("STEPGRAPH_TEST_CUDA") and torch.cuda.is_available() and torch.cuda.device_count() >= 2)


def launch(scenario, tmp_path, nproc=2, timeout=300):
    e = dict(os.environ, STEPGRAPH_DIST_TIMEOUT="4", PG_TIMEOUT="60", OMP_NUM_THREADS="1",
             FSDP2_DEVICE="cuda" if GPUS else "cpu")
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
def test_fsdp2_steps_match_eager_fsdp2_bitwise(tmp_path):
    """Per-block + root fully_shard, reshard_after_forward True and False, bf16 parameters with fp32
    reduction, accumulation inside the step, a GPT with tied embedding and head, clip_grad_norm_
    over DTensor grads, foreach AdamW: captured whole at call 2 and replayed 5 times on fresh
    per-rank batches; parameters, optimizer state and state_dict() equal eager FSDP2's bitwise
    after every call."""
    for r, res in enumerate(launch("fsdp2", tmp_path)):
        for case in ("raf=True", "raf=False", "bf16_params", "accumulate_in_step", "gpt", "resizes_kept"):
            got = res[case]
            assert got["max_diff"] == 0.0 and got["loss_diff"] == 0.0, (r, case, got)
            assert got["captures"] == 1 and got["replays"] == 5 and not got["errors"], (r, case, got)
            # CUDA: one CUDA graph, except with the resizes kept (they keep it on the replay
            # backend, as before passes/unsharded.py); the twin took the capturable AdamW at call 2.
            # CPU: the replay backend, both optimizers as the user made them.
            want = "cudagraph" if GPUS and case != "resizes_kept" else "replay"
            assert got["backends"] == [want] and got["twin_switched"] == int(GPUS), (r, case, got)
            ops = got["graph_ops"]  # the communication is in the graph
            assert ops["reduce_scatter_tensor"] == 3 and ops["all_reduce"] == 1, (r, case, ops)
            unsh = got["unsharded"]
            if case == "resizes_kept":  # STEPGRAPH_FSDP2_TEMPORARIES=0: freed and allocated in the graph
                assert unsh is None and ops["resize_storage_bytes_"] >= 4 * ops["all_gather_into_tensor"] - 12
                continue
            # every unsharded storage is a graph temporary, one per all-gather interval: no resizes
            # left (passes/unsharded.py), so a CUDA graph could record the step
            assert ops["resize_storage_bytes_"] == 0 and unsh["left"] == 0, (r, case, ops, unsh)
            assert unsh["storages"] > 0 and unsh["temporaries"] >= unsh["storages"], (r, case, unsh)
        # reshard_after_forward=True all-gathers again in backward (3 blocks: 6), False keeps them
        assert res["raf=True"]["graph_ops"]["all_gather_into_tensor"] == 6
        assert res["raf=False"]["graph_ops"]["all_gather_into_tensor"] == 3
        # ... and so holds two temporaries per unsharded storage, False one
        u_t, u_f = res["raf=True"]["unsharded"], res["raf=False"]["unsharded"]
        assert u_t["temporaries"] == 2 * u_t["storages"] and u_f["temporaries"] == u_f["storages"], (u_t, u_f)
        # a setting changed between calls (set_reshard_after_forward) recaptures, with the reason
        ch = res["settings_change"]
        assert ch["max_diff"] == 0.0 and ch["captures"] == 2 and ch["replays"] == 5, (r, ch)
        assert ch["backends"] == ["cudagraph" if GPUS else "replay"] * 2, (r, ch)
        assert ch["recaptures"] == ["FSDP2 settings changed (set_reshard_after_forward, "
                                    "set_requires_gradient_sync, ...)"], ch
        # gradients held between calls are refused before tracing; every call ran as eager
        for case in ("zero_grad_first", "zero_grad_first_eager"):
            got = res[case]
            assert got["max_diff"] == 0.0 and got["captures"] == 0 and got["eager_calls"] == 7, (r, case, got)
            assert got["twin_switched"] == 0, (r, case, got)  # never captured: the user's form on both
        # backend="inductor": the whole step fused, collectives included, one graph
        ind = res["inductor"]
        assert ind["backends"] == ["inductor"] and ind["captures"] == 1 and ind["replays"] == 5, (r, ind)
        assert not ind["errors"] and ind["max_diff"] < 1e-4 and ind["loss_diff"] < 1e-5, (r, ind)
        assert ind["graph_ops"]["reduce_scatter_tensor"] == 3 and ind["graph_ops"]["resize_storage_bytes_"] == 0
        if not GPUS:   # one rank's fused code wrong: every rank keeps its unfused graph (traced on
            # the capturable AdamW path, as Inductor's trace is: close to eager, not bitwise)
            bad = res["inductor_rank1_diverges"]
            assert bad["max_diff"] < 1e-5 and bad["captures"] == 1 and bad["replays"] == 5, (r, bad)
            assert len(bad["warnings"]) == 1, (r, bad["warnings"])
            assert ("another rank's check" in bad["warnings"][0]) == (r == 0), (r, bad["warnings"])
        errs = res["zero_grad_first"]["errors"]
        assert len(errs) == 6 and "FSDP2" in errs[0] and "gradients held between calls" in errs[0], errs[:1]
        assert "ran eagerly to its end" in errs[0] and "on_capture_error='eager'" in errs[0]




@needs_dist
def test_fsdp2_benchmark_command_runs_on_cpu(tmp_path):
    """`torchrun --standalone --nproc_per_node 2 -m stepgraph.bench_fsdp2 --device cpu` (docs/fsdp2.md;
    the same command without --device runs NCCL on 2 GPUs in scripts/device_suite.sh)."""
    e = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "stepgraph.bench_fsdp2", "--device", "cpu", "--steps", "3", "--warmup", "1",
                        "--out", str(tmp_path)], env=e, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads((tmp_path / "bench_fsdp2.json").read_text())
    assert out["world"] == 2 and out["done"] and [r["case"] for r in out["rows"]] == ["raf=True", "raf=False", "bf16 params, fp32 reduce"]
    for r in out["rows"]:
        assert "error" not in r, r
        # bitwise on both ranks after every call; call 1 eager, call 2 captured, every other call a replay
        assert r["max_diff"] == 0.0 and r["loss_diff"] == 0.0 and r["bitwise"], r
        assert r["captures"] == 1 and r["replays"] == 7 - 2 + 1 + 3 and not r["recaptures"], r
        assert r["backends"] == ["replay"] and len(r["per_rank"]) == 2, r
        assert r["graph_ops"]["reduce_scatter_tensor"] == 3 and r["graph_ops"]["all_reduce"] == 1, r
        assert r["stepgraph_ms"] > 0 and r["eager_ms"] > 0 and len(r["first3_s"]["stepgraph"]) == 3, r
    assert "| raf=True |" in p.stdout and (tmp_path / "bench_fsdp2.md").read_text().startswith("FSDP2")


def _twins(raf=True):
    import torch

    from fsdp2_worker import sharded_mlp
    a, b = sharded_mlp(raf), sharded_mlp(raf)
    return a, torch.optim.AdamW(a.parameters(), lr=1e-2), b, torch.optim.AdamW(b.parameters(), lr=1e-2)


def _argument_step(model, opt, x, y):
    """A step that takes the FSDP2 model and its optimizer as arguments."""
    import torch.nn.functional as F
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_world_of_one_fsdp2_model_passed_as_an_argument_is_captured(world_of_one):
    """Found among the call's arguments as well as in the closure; storages freed in the graph."""
    import torch

    import stepgraph
    from fsdp2_worker import max_diff
    a, oa, b, ob = _twins()

    step = _argument_step
    sg = stepgraph.compile(step)
    for i in range(5):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        assert torch.equal(sg(a, oa, x, y), step(b, ob, x, y))
        assert max_diff(a, oa, b, ob) == 0.0
    assert sg.stats.captures == 1 and sg.stats.replays == 3
    assert "resize_storage_bytes_" not in sg.graph.code  # graph temporaries instead (passes/unsharded.py)
    assert "FSDP2 unsharded parameters as graph temporaries: 6 storages" in sg.explain()


def test_step_leaving_fsdp2_settings_changed_is_refused_after_running_as_eager(world_of_one):
    """A replay would not run the step's Python: a setting it leaves changed is refused once the
    call has run to its end (its state is eager's)."""
    import torch
    import torch.nn.functional as F

    import stepgraph
    from fsdp2_worker import max_diff
    a, oa, b, ob = _twins()

    def mk(model, opt):
        def step(x, y):
            model.set_reshard_after_backward(not model[0]._get_fsdp_state()._fsdp_param_group.reshard_after_backward)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(mk(a, oa)), mk(b, ob)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    sg(x, y), eager(x, y)
    with pytest.raises(stepgraph.CaptureError, match="changes FSDP2 settings") as e:
        sg(x, y)
    eager(x, y)
    assert "ran to its end as eager FSDP2 would" in str(e.value)
    assert max_diff(a, oa, b, ob) == 0.0


def _failing(model, opt, where):
    """A step that fails inside torch's Python (not the user's own raise) when the batch has 6
    rows: after the optimizer step (FSDP2 idle) or between forward and backward."""
    import torch.nn.functional as F

    def step(x, y):
        out = model(x)
        if where == "mid" and x.shape[0] == 6:
            F.interpolate(x[None], size=1, scale_factor=2.0)  # ValueError in torch/nn/functional.py
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if where == "end" and x.shape[0] == 6:
            F.interpolate(x[None], size=1, scale_factor=2.0)
        return loss.detach()
    return step


def test_trace_failing_with_fsdp2_idle_is_undone_and_the_call_runs_as_eager(world_of_one):
    import torch

    import stepgraph
    from fsdp2_worker import max_diff
    a, oa, b, ob = _twins(False)
    sg, eager = stepgraph.compile(_failing(a, oa, "end")), _failing(b, ob, "end")
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    sg(x, y), eager(x, y)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    for f in (sg, eager):  # eager's own exception reaches the caller, after the undo and the rerun
        with pytest.raises(ValueError, match="only one of size or scale_factor"):
            f(x, y)
    assert max_diff(a, oa, b, ob) == 0.0


def test_trace_failing_mid_fsdp2_step_propagates_with_a_note_instead_of_a_rerun(world_of_one):
    """Stopped between forward and backward with reshard_after_forward=False, FSDP2 holds its
    parameters unsharded: no rerun on top of that; the error says the state may be partial."""
    import torch

    import stepgraph
    a, oa, _, _ = _twins(False)
    sg = stepgraph.compile(_failing(a, oa, "mid"))
    sg(torch.randn(8, 8), torch.randint(0, 4, (8,)))
    with pytest.raises(ValueError) as e:
        sg(torch.randn(6, 8), torch.randint(0, 4, (6,)))
    assert any("could not undo the partial capture (FSDP2's hooks stopped mid-step" in n
               for n in getattr(e.value, "__notes__", [])), getattr(e.value, "__notes__", None)


def test_rollback_restores_storages_resized_since_they_were_saved():
    """FSDP2 frees storages (size 0) and allocates them again inside a step; an undo must give
    each its size and bytes from before the trace (it wrote past a freed storage: a segfault)."""
    import torch

    from stepgraph.capture.rollback import Rollback
    from stepgraph.capture.state import StateRegistry
    full, empty = torch.arange(4.0), torch.arange(4.0)
    torch.ops.inductor.resize_storage_bytes_(empty, 0)
    rb = Rollback.take(StateRegistry(), [])
    rb.save(full)
    rb.save(empty)
    torch.ops.inductor.resize_storage_bytes_(full, 0)
    torch.ops.inductor.resize_storage_bytes_(empty, 16)
    assert rb.undo()
    assert torch.equal(full, torch.arange(4.0)) and empty.untyped_storage().nbytes() == 0


def test_load_state_dict_mid_run_keeps_parity(world_of_one):
    """Model and optimizer state loaded between replays (a checkpoint restore): the model's
    shards are copied in place (replays go on), the optimizer's state is new (recapture)."""
    import copy

    import torch

    import stepgraph
    from fsdp2_worker import max_diff, train_step
    a, oa, b, ob = _twins()
    sg, eager = stepgraph.compile(train_step(a, oa)), train_step(b, ob)
    saved = {k: v.detach().clone() for k, v in b.state_dict().items()}
    for i in range(7):
        if i == 4:
            osd = copy.deepcopy(ob.state_dict())
            for m, o in ((a, oa), (b, ob)):
                m.load_state_dict(saved)
                o.load_state_dict(copy.deepcopy(osd))
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        assert torch.equal(sg(x, y), eager(x, y)), i
        assert max_diff(a, oa, b, ob) == 0.0, i
    assert sg.stats.captures == 2 and sg.stats.replays == 4, sg.stats


def test_distributed_checkpoint_save_and_load_mid_run_keeps_parity(world_of_one, tmp_path):
    """torch.distributed.checkpoint (DCP) with get/set_state_dict, as torchtitan checkpoints an
    FSDP2 run: saved after call 3, then restored after call 5 into both the captured model and
    its eager twin; the calls after the restore match eager bitwise (the model's shards are
    loaded in place, so its graph replays on; the optimizer's state is new: one recapture)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import stepgraph
    from fsdp2_worker import max_diff, train_step
    a, oa, b, ob = _twins()
    sg, eager = stepgraph.compile(train_step(a, oa)), train_step(b, ob)
    g = torch.Generator().manual_seed(3)
    for i in range(9):
        if i == 3:
            for tag, m, o in (("a", a, oa), ("b", b, ob)):
                msd, osd = get_state_dict(m, o)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / f"ckpt_{tag}"))
        if i == 5:
            for tag, m, o in (("a", a, oa), ("b", b, ob)):
                msd, osd = get_state_dict(m, o)
                state = {"model": msd, "optim": osd}
                dcp.load(state, checkpoint_id=str(tmp_path / f"ckpt_{tag}"))
                set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        assert torch.equal(sg(x, y), eager(x, y)), i
        assert max_diff(a, oa, b, ob) == 0.0, i
    assert sg.stats.captures == 2 and sg.stats.replays == 6, sg.stats
    assert sg.stats.recaptures == ["opt.state was replaced (load_state_dict?)"], sg.stats.recaptures


def test_step_leaving_dtensor_grads_is_refused_after_running_as_eager(world_of_one):
    """The DTensor .grad a step creates would not be rebound by a replay: refused once the call
    has run (state eager's); later calls, which start with those grads, are refused before tracing."""
    import torch
    import torch.nn.functional as F

    import stepgraph
    from fsdp2_worker import max_diff
    a, oa, b, ob = _twins()

    def mk(model, opt):
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss.detach()
        return step
    sg, eager = stepgraph.compile(mk(a, oa)), mk(b, ob)
    for i in range(3):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        for o in (oa, ob):
            o.zero_grad()  # outside the step: grads None at every call's start
        if i == 0:
            sg(x, y)
        else:
            with pytest.raises(stepgraph.CaptureError, match="leaves FSDP2 gradients set"):
                sg(x, y)
        eager(x, y)
        assert max_diff(a, oa, b, ob) == 0.0


def test_world_of_one_eager_unshard_before_a_call_is_another_state(world_of_one):
    """The graph assumes FSDP2 at rest (parameters sharded, unsharded storages empty: the graph
    builds its own unsharded temporaries, passes/unsharded.py). An eager ``model.unshard()``
    before a call is another state: it recaptures instead of replaying, and stays equal to eager."""
    import torch

    import stepgraph
    from fsdp2_worker import max_diff
    a, oa, b, ob = _twins()

    step = _argument_step
    sg = stepgraph.compile(step)
    for i in range(5):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        if i == 3:  # every FSDP module's parameters (the root holds none of its own here)
            for m in [x for model in (a, b) for x in model.modules() if hasattr(x, "unshard")]:
                m.unshard()
        try:
            got = sg(a, oa, x, y)
        except stepgraph.CaptureError:  # a clear refusal runs the call eagerly: also fine
            got = None
        want = step(b, ob, x, y)
        assert got is None or torch.equal(got, want), i
        assert max_diff(a, oa, b, ob) == 0.0, i
    assert sg.stats.replays < 3 or sg.stats.captures > 1, (sg.stats, "the unsharded call was not a replay")
