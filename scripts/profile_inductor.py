"""Where backend="inductor" spends its first step, and its replays (issue 4 exploration).

    python3 scripts/profile_inductor.py --cases gpt6l,gpt2l --out $OUT [--cprofile] [--kernels]

Per case: wall time of each of the first 3 calls, split into trace / Inductor compile
(with Inductor's own phase timers) / CUDA-graph recording; optionally a cProfile of the
capturing call, and a kernel-time table of replays vs reduce-overhead. The compile runs
in-process (STEPGRAPH_INDUCTOR_BACKGROUND=0 unless set), so its phases can be timed.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

os.environ.setdefault("STEPGRAPH_INDUCTOR_BACKGROUND", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import stepgraph  # noqa: E402
from stepgraph import pipeline  # noqa: E402
from stepgraph.tools import bench, models, models_scale  # noqa: E402
from stepgraph.backends import cudagraph, inductor  # noqa: E402

PHASES: dict[str, float] = {}


def _timed(mod, name, key):
    f = getattr(mod, name)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            PHASES[key] = PHASES.get(key, 0.0) + time.perf_counter() - t
    setattr(mod, name, g)


_timed(pipeline, "trace_step", "trace")
_timed(inductor, "_compile", "inductor compile_fx")
# The first fused call runs the step directly, then records it (cudagraph.record_after_first_call).
_timed(cudagraph, "record", "CUDA-graph record")


def dynamo_times() -> str:
    try:
        from torch._dynamo.utils import compile_times
        return compile_times(repr="str", aggregate=True)
    except Exception as e:  # noqa: BLE001
        return f"(compile_times unavailable: {e})"


def kernel_table(run, batches, start, n=5) -> str:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(start, start + n):
            run(batches[i])
        torch.cuda.synchronize()
    ka = prof.key_averages()
    from torch.autograd import DeviceType
    # (kernels only: the CPU-side ops of an uncaptured run report their kernels' time again)
    rows = [(e.key, getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)), e.count)
            for e in ka if getattr(e, "device_type", DeviceType.CUDA) == DeviceType.CUDA]
    rows = [r for r in rows if r[1] > 0 and not r[0].startswith(("cudaGraphLaunch", "ProfilerStep"))]
    total = sum(r[1] for r in rows if "Memcpy" not in r[0]) / n
    rows.sort(key=lambda r: -r[1])
    out = [f"kernel time per step {total / 1e3:.3f} ms (sum of device times / {n} steps)"]
    for k, t, c in rows[:30]:
        out.append(f"  {t / n / 1e3:8.3f} ms  x{c // n:<4} {k[:110]}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="gpt6l")
    p.add_argument("--out", default=os.environ.get("OUT", "profile_out"))
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--warm-cache", action="store_true")
    p.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"])
    args = p.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    if not args.warm_cache:
        import torch._inductor.config as ic
        ic.force_disable_caches = True
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bench.prewarm_compile(dev)
    report = {}
    for name in args.cases.split(","):
        bc = bench.CASES[name]
        case = models.build(bc.family, **bc.config, seed=0, device=dev, dtype=torch.float32)
        batches = [case.make_batch(1000 + i) for i in range(40)]
        # (a real-scale case's own recipe: nanoGPT's bf16 autocast, micro-batches, fused AdamW)
        opt, step = models_scale.opt_and_step(case, case.model)
        sg = stepgraph.compile(step, backend="inductor")
        PHASES.clear()
        calls = []
        for i in range(3):
            t = time.perf_counter()
            if i == 1 and args.cprofile:
                pr = cProfile.Profile()
                pr.enable()
                sg(*batches[i])
                pr.disable()
            else:
                sg(*batches[i])
            if dev.type == "cuda":
                torch.cuda.synchronize()
            calls.append(time.perf_counter() - t)
        print(f"\n===== {name}: calls {[round(c, 2) for c in calls]} s, total {sum(calls):.2f} s")
        for k, v in PHASES.items():
            print(f"  {k:32s} {v:7.2f} s")
        print(dynamo_times())
        print(sg.explain()[:2500])
        rec = {"calls": calls, "phases": dict(PHASES)}
        if args.cprofile:
            s = io.StringIO()
            ps = pstats.Stats(pr, stream=s).sort_stats("cumulative")
            ps.print_stats(60)
            txt = s.getvalue()
            print(txt[:12000])
            with open(os.path.join(args.out, f"cprofile_{name}.txt"), "w") as f:
                f.write(txt)
            ps.dump_stats(os.path.join(args.out, f"cprofile_{name}.prof"))
        if args.kernels and dev.type == "cuda":
            for i in range(3, 13):
                sg(*batches[i])
            print("--- stepgraph[inductor] replays:")
            print(kernel_table(lambda b: sg(*b), batches, 13))
            case2 = models.build(bc.family, **bc.config, seed=0, device=dev, dtype=torch.float32)
            rival = bench.v_compile if case2.make_step is not None else bench.v_reduce_overhead
            prep = rival(case2, batches, dev)
            for i in range(0, 13):
                prep.run(batches[i])
            print(f"--- torch.compile ({rival.__name__}):")
            print(kernel_table(prep.run, batches, 13))
        report[name] = rec
        del sg, opt, case
        torch._dynamo.reset()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_inductor.json"), "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
