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


def test_fallback_variants_run_only_when_the_documented_compile_failed(tmp_path, monkeypatch):
    """Lightning's ``*-net`` variants (torch.compile of the network inside the module) stand in for
    the documented ``torch.compile(model)`` only where that failed; a variant whose losses leave
    eager's is flagged."""
    from stepgraph.tools import bench_integrations as bi
    ran = []

    def run(variant, ctx, timer):
        ran.append(variant)
        if variant == "reduce-overhead":
            raise RuntimeError("documented way broke")
        for _ in range(ctx.total):
            timer.begin()
            timer.end()
        wrong = 1.5 if variant == "compile-net" else 1.0
        return [(s, 4.0 - s / 100 * wrong) for s in range(1, ctx.total + 1)], ""
    monkeypatch.setattr(bi, "_suites", lambda: {"fake": (run, lambda ctx: "fake", bi.PL_VARIANTS)})
    bi.main(["--device", "cpu", "--suites", "fake", "--steps", "2", "--warm-cache", "--compile-backend", "eager",
             "--out", str(tmp_path / "t.md")])
    assert ran == ["eager", "compile", "reduce-overhead", "reduce-overhead-net", "stepgraph"]
    md = (tmp_path / "t.md").read_text()
    assert "| fake | compile-net | skipped: compile worked" in md
    assert "| fake | reduce-overhead | FAILED: RuntimeError: documented way broke |" in md
    bi.main(["--device", "cpu", "--suites", "fake", "--steps", "2", "--warm-cache", "--variants", "eager,compile-net",
             "--loss-tol", "0.001", "--out", str(tmp_path / "t.md")])
    row = [r for r in (tmp_path / "t.md").read_text().splitlines() if r.startswith("| fake | compile-net |")][0]
    assert " !" in row and "differ from eager" in row
