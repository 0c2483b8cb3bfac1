"""FSDP2 on one GPU (world size 1, NCCL): issue 19's single-GPU target. Skipped without CUDA.

Capture on CUDA is behind STEPGRAPH_FSDP2_CUDA=1 until this has run on a GPU (capture/fsdp.py):
the graph frees and allocates FSDP2's unsharded storages, which a CUDA graph cannot record, so
backend='auto' runs it with the replay backend (warned). The eager twin takes the capturable
optimizer form stepgraph switches to, so the comparison is kernel for kernel.
"""
import time

import pytest
import torch
import torch.distributed as dist

import stepgraph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def nccl_world_of_one(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPGRAPH_FSDP2_CUDA", "1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _run(step, batches):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ids, tg in batches:
        step(ids, tg)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(batches)


def test_fsdp2_gpt_on_one_gpu_matches_eager_and_reports_time_and_memory(nccl_world_of_one):
    from fsdp2_worker import gpt_step, max_diff, sharded_gpt
    from stepgraph.backends.cudagraph import make_capturable
    from stepgraph.capture.state import StateRegistry
    size = dict(layers=6, d=384, heads=6, vocab=512, seq=128, sdpa=False)
    a, b = sharded_gpt(True, device="cuda", **size), sharded_gpt(True, device="cuda", **size)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3, foreach=True)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3, foreach=True)
    sg, eager = stepgraph.compile(gpt_step(a, oa)), gpt_step(b, ob)
    g = torch.Generator().manual_seed(0)

    def batch():
        ids = torch.randint(0, 512, (8, 128), generator=g)
        return ids.cuda(), torch.roll(ids, -1, 1).cuda()
    with pytest.warns(UserWarning, match="resize_storage_bytes_|frees and allocates storages"):
        for i in range(7):
            x, y = batch()
            if i == 1:
                make_capturable(StateRegistry.of_optimizers([("opt", ob)]))
            assert torch.equal(sg(x, y), eager(x, y)), i
            assert max_diff(a, oa, b, ob) == 0.0, i
    assert sg.stats.captures == 1 and sg.stats.replays == 5
    batches = [batch() for _ in range(20)]
    t_sg, t_eager = _run(sg, batches), _run(eager, batches)
    torch.cuda.reset_peak_memory_stats()
    _run(sg, batches[:3])
    peak_sg = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _run(eager, batches[:3])
    peak_eager = torch.cuda.max_memory_allocated()
    print(f"FSDP2 GPT-6L d=384, one GPU: stepgraph {t_sg * 1e3:.2f} ms/step, eager {t_eager * 1e3:.2f} ms "
          f"({t_sg / t_eager:.2f}x); peak memory {peak_sg / 2**20:.0f} MiB vs {peak_eager / 2**20:.0f} MiB "
          f"({peak_sg / peak_eager:.2f}x)")
    assert peak_sg <= 1.2 * peak_eager, (peak_sg, peak_eager)
