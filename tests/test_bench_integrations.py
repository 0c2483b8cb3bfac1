"""``python -m stepgraph.bench_integrations`` end to end on the CPU at tiny sizes (issue 18's speed
table): every suite has a row for every one of its variants, and stepgraph's rows were captured,
replayed and logged the same losses as eager (bitwise on the CPU). The compile variants use the
``eager`` dynamo backend here (no C++ compile); their rows must be present, not passing: a
framework's own torch.compile path may fail with the installed versions (the table says why)."""
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_integrations_cpu_smoke(tmp_path, capsys):
    from stepgraph.tools import bench_integrations as bi
    out = tmp_path / "table.md"
    bi.main(["--device", "cpu", "--steps", "2", "--warmup", "3", "--log-every", "1", "--compile-backend", "eager",
             "--warm-cache", "--out", str(out)])
    md, printed = out.read_text(), capsys.readouterr().out
    assert md.startswith("# stepgraph integrations bench\n\ndevice: ") and " CPU (" in md
    assert "command: `python -m stepgraph.bench_integrations --device cpu" in md
    for section in md.split("\n\n"):  # the table is printed as it is written
        assert section in printed
    rows = json.loads((tmp_path / "table.json").read_text())["results"]
    want = {s: v for s, v in (("hf_gpt2", bi.VARIANTS), ("hf_bert", bi.VARIANTS), ("pl_gpt", bi.PL_VARIANTS))}
    for suite, variants in want.items():
        for v in variants:
            assert f"| {suite} | {v} |" in md, f"no row for {suite} / {v}"
        got = {r["variant"]: r for r in rows if r["suite"] == suite}
        assert set(got) == set(variants)
        assert "skipped" in got["reduce-overhead"]["note"]  # CUDA graphs: CUDA only
        for v in ("eager", "stepgraph"):
            r = got[v]
            assert not r["error"], r["note"]
            assert r["steps"] == 2 and r["median_ms"] > 0 and r["step1_s"] > 0
            assert len(r["losses"]) == 5 and r["final_loss"] == r["losses"][-1][1]
        assert "replays=3" in got["stepgraph"]["note"] and "NO REPLAYS" not in got["stepgraph"]["note"]
        assert got["stepgraph"]["losses"] == got["eager"]["losses"]  # bitwise on the CPU
        assert got["stepgraph"]["loss_rel_diff"] == 0.0
