"""Which tensors of a corpus client differ from eager, per backend (for a WRONG row):
    PYTHONPATH=. python3 scripts/diag_corpus_client.py dcgan cuda"""
import sys

from clients import harness as h

name, device = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu"
_, eager, _, _ = h._run(name, False, 8, device, None, 0)
want = h.state_tensors(eager.tracked)
for backend in ("replay", "cudagraph") if device == "cuda" else ("replay",):
    _, sg, err, warns = h._run(name, True, 8, device, None, 0, backend=backend)
    got = h.state_tensors(sg.tracked)
    bad = sorted(((h.rel_err(got.get(k), want[k]), k) for k in want), reverse=True)
    print(backend, "error:", err, "stats:", [s.stats for s in sg.steps])
    for e, k in bad[:8]:
        if e > 0:
            print(f"  {k}: {e:.3g}")
    for i, (a, b) in enumerate(zip(sg.logs, eager.logs)):
        print("  log", i, a, b)
