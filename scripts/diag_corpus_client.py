"""Which tensors of a corpus client differ from eager, per backend (for a WRONG row):
    PYTHONPATH=. python3 scripts/diag_corpus_client.py dcgan cuda [replay,cudagraph,auto]
Prints eager's own run-to-run spread (a second eager run), each backend's worst tensors, its
stepgraph warnings, the per-step logs side by side, and explain() of each step."""
import sys

from clients import harness as h

name, device = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu"
backends = sys.argv[3].split(",") if len(sys.argv) > 3 else (("replay", "auto") if device == "cuda" else ("replay",))
_, eager, _, _ = h._run(name, False, 8, device, None, 0)
want = h.state_tensors(eager.tracked)
_, again, _, _ = h._run(name, False, 8, device, None, 0)
spread = sorted(((h.rel_err(v, want[k]), k) for k, v in h.state_tensors(again.tracked).items() if k in want), reverse=True)
print("eager vs eager:", [(k, f"{e:.3g}") for e, k in spread[:4] if e > 0] or "bitwise")
for backend in backends:
    _, sg, err, warns = h._run(name, True, 8, device, None, 0, backend=backend)
    got = h.state_tensors(sg.tracked)
    bad = sorted(((h.rel_err(got.get(k), want[k]), k) for k in want), reverse=True)
    print(f"== {backend}: error:", err, "stats:", [s.stats for s in sg.steps])
    for w in warns:
        print("  warning:", w[:400])
    for e, k in bad[:8]:
        if e > 0:
            print(f"  {k}: {e:.3g}")
    for i, (a, b) in enumerate(zip(sg.logs, eager.logs)):
        print("  log", i, str(a)[:200], "| eager:", str(b)[:200])
    for s in sg.steps:
        try:
            print(s.explain()[:4000])
        except Exception as e:  # noqa: BLE001 - a diagnostic
            print("  explain() failed:", e)
