"""The real-scale bench cases (issue 21) at --quick sizes: nanoGPT's train.py step captures and
replays bitwise on the CPU, and the bench prints tokens/s and MFU columns for them."""
import pytest
import torch

import stepgraph
from stepgraph.tools import models

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_nanogpt_step_replays_bitwise(dropout):
    cfg = dict(layers=1, d=32, heads=2, vocab=64, seq=16, batch=2, micro=2, dropout=dropout)
    a, b = models.build("nanogpt", **cfg), models.build("nanogpt", **cfg)
    oa, ob = a.make_opt(a.model), b.make_opt(b.model)
    assert [g["weight_decay"] for g in oa.param_groups] == [0.1, 0.0]
    sg, eager = stepgraph.compile(a.make_step(a.model, oa), backend="replay"), b.make_step(b.model, ob)
    for i in range(5):
        torch.manual_seed(i)  # (dropout: the same masks on both sides)
        got = sg(*a.make_batch(i))
        torch.manual_seed(i)
        assert torch.equal(got, eager(*b.make_batch(i)))
    assert sg.stats.replays == 3
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert a.tokens_per_step == 2 * 2 * 16 and a.flops_per_step > 6 * 16 * 2 * 2


def test_bench_quick_prints_tokens_and_mfu(tmp_path, capsys):
    from stepgraph.tools import bench
    rc = bench.main(["--quick", "--cases", "gpt2_124m,char6l", "--variants", "eager,stepgraph",
                     "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| tokens/s | MFU |" in out and "layers=2, d=64" in out and "dropout=0.2" in out
