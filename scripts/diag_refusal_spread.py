"""Is a GPU client's 'error left state unlike eager' the refused trace's doing or eager's own
run-to-run spread? Eager three times, stepgraph twice, each pair compared (clients/harness.py)."""
import sys

from clients import harness as H

for name in sys.argv[1:] or ["cyclegan", "detr"]:
    _, sgr, err, _ = H._run(name, True, 8, "cuda", None, 0)
    calls = sgr.calls
    eager = [H.state_tensors(H._run(name, False, 8, "cuda", None, 0, stop_after=calls)[1].tracked) for _ in range(3)]
    sg = H.state_tensors(sgr.tracked)
    _, sgr2, _, _ = H._run(name, True, 8, "cuda", None, 0)
    sg2 = H.state_tensors(sgr2.tracked)
    print(name, "calls", calls, "error:", str(err).splitlines()[0][:120] if err else None)
    for label, a, b in [("sg  vs e0", sg, eager[0]), ("sg  vs e1", sg, eager[1]), ("e1  vs e0", eager[1], eager[0]),
                        ("e2  vs e0", eager[2], eager[0]), ("sg2 vs sg", sg2, sg)]:
        print("  ", label, "%.3e %s" % H.compare(a, b))
