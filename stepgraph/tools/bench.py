"""Benchmark a whole training step: eager vs torch.compile vs hand-written CUDA graph vs stepgraph.

    python -m stepgraph.bench                       # GPU: mlp512,gpt2l,gpt6l; CPU: mlp64
    python -m stepgraph.bench --cases gpt2l --steps 50 --stepgraph-backends replay
    python -m stepgraph.bench --quick               # smoke test: a few steps per variant
    python -m stepgraph.bench --cases gpt2_124m,char6l --matmul-precision high \
        --variants eager,compile,stepgraph,stepgraph[inductor] --stepgraph-backends inductor
                                                    # real scale (issue 21): nanoGPT's train.py step

Every variant of a case gets its own fresh model (same seed), its own AdamW and the same batch
sequence (step i uses batch i), so the final losses are comparable as a sanity check.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from stepgraph.tools import models
from stepgraph.tools.bench_report import header, table
from stepgraph.tools.models_scale import fused_timeline, opt_and_step, peak_flops

FIRST_CALLS = 3  # call 1 eager, call 2 captures, call 3 is the first replay (stepgraph, compile)


@dataclass
class BenchCase:
    """A named model configuration from :mod:`stepgraph.tools.models`."""

    family: str
    config: dict
    gpu: bool  # part of the default set on GPU (else on CPU)
    default: bool = True  # in a default run at all (else only with --cases)
    quick: dict = field(default_factory=dict)  # config overrides under --quick (a CPU smoke test)


CASES = {
    "mlp512": BenchCase("mlp", dict(width=512, depth=8, batch=64, classes=10), gpu=True),
    # The GPT cases use F.scaled_dot_product_attention, as real models do (fp32: the
    # memory-efficient kernel); the *_manual ones write attention as matmul + mask + softmax.
    "gpt2l": BenchCase("gpt", dict(layers=2, d=128, heads=4, batch=4, seq=64, vocab=1024, sdpa=True), gpu=True),
    "gpt6l": BenchCase("gpt", dict(layers=6, d=384, heads=6, batch=8, seq=256, vocab=4096, sdpa=True), gpu=True),
    "gpt6l_manual": BenchCase("gpt", dict(layers=6, d=384, heads=6, batch=8, seq=256, vocab=4096), gpu=True,
                                 default=False),
    "mlp64": BenchCase("mlp", dict(width=64, depth=8, batch=32, classes=10), gpu=False),
    # Hugging Face zoo (issue 5): run with --cases hf_gpt2,hf_llama (needs transformers).
    "hf_gpt2": BenchCase("hf_gpt2", dict(layers=2, d=128, heads=4, vocab=1024, batch=4, seq=64), gpu=False),
    "hf_llama": BenchCase("hf_llama", dict(layers=2, d=128, heads=4, vocab=1024, batch=4, seq=64), gpu=False),
    # Real scale (issue 21): nanoGPT's model and train.py step (bf16 autocast, micro-batches
    # accumulated inside the step, clip_grad_norm_, AdamW with weight-decay groups, fused on CUDA).
    "gpt2_124m": BenchCase("nanogpt", dict(layers=12, d=768, heads=12, vocab=50304, seq=1024, batch=8, micro=2),
                           gpu=True, default=False,
                           quick=dict(layers=2, d=64, heads=2, vocab=128, seq=32, batch=2)),
    "char6l": BenchCase("nanogpt", dict(layers=6, d=384, heads=6, vocab=65, seq=256, batch=64, micro=1,
                                        dropout=0.2, lr=1e-3), gpu=True, default=False,
                        quick=dict(layers=2, d=48, heads=2, seq=32, batch=4)),
}


@dataclass
class Row:
    """One variant's measurements (times in ms unless named otherwise)."""

    case: str
    variant: str
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    first_s: float | None = None
    fused_s: float | None = None  # backend="inductor": until the first step of the fused graph
    ready_s: float | None = None  # backend="inductor": until the fused graph was loaded (ready)
    switch_s: float | None = None  # backend="inductor": the switching call (first fused step + check)
    tokens_per_s: float | None = None  # cases that say their tokens and FLOPs per step
    mfu: float | None = None  # model FLOPs utilisation: flops_per_step / median step / bf16 peak
    peak_mib: float | None = None
    final_loss: float | None = None
    steps: int = 0
    error: str = ""
    note: str = ""
    stats: dict = field(default_factory=dict)


@dataclass
class Prepared:
    """A ready-to-time step: ``run(batch)`` does one training step and returns the loss."""

    run: Callable[[tuple], torch.Tensor]
    first_calls: int = FIRST_CALLS  # steps until the first one on the compiled/captured path ends
    done: int = 0  # steps make() already ran itself (the handwritten warm-up)
    handle: object = None  # the stepgraph step function, for its stats
    keep: list = field(default_factory=list)  # objects to free after the variant


# --------------------------------------------------------------------------- variants

def v_eager(case, batches, dev):
    opt, step = opt_and_step(case, case.model)
    return Prepared(lambda b: step(*b), keep=[opt])


def v_compile(case, batches, dev):
    opt, step = opt_and_step(case, torch.compile(case.model))
    return Prepared(lambda b: step(*b), keep=[opt])


def v_reduce_overhead(case, batches, dev):
    # Marking each step lets cudagraph trees reuse the previous step's output memory.
    opt, step = opt_and_step(case, torch.compile(case.model, mode="reduce-overhead"),
                             before=torch.compiler.cudagraph_mark_step_begin)
    return Prepared(lambda b: step(*b), keep=[opt])


def v_handwritten(case, batches, dev):
    """The floor: one torch.cuda.graph over forward+loss+backward+opt.step()+zero_grad."""
    if dev.type != "cuda" or case.make_step is not None:
        raise RuntimeError("handwritten CUDA graph needs a CUDA device and the plain step")
    model, loss_fn = case.model, case.loss_fn
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    static = tuple(t.clone() for t in batches[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as the CUDA graph docs require
        for i in range(FIRST_CALLS):
            for dst, src in zip(static, batches[i]):
                dst.copy_(src)
            loss_fn(model, *static).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(s)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = loss_fn(model, *static)
        static_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def run(batch):
        for dst, src in zip(static, batch):
            dst.copy_(src)
        graph.replay()
        return static_loss
    # The warm-up already did steps 0..2, so the run loop starts with the first replay.
    return Prepared(run, first_calls=FIRST_CALLS + 1, done=FIRST_CALLS,
                    keep=[opt, graph, static])


def v_stepgraph(backend):
    def make(case, batches, dev):
        import stepgraph
        opt, step = opt_and_step(case, case.model)
        sg = stepgraph.compile(step, backend=backend)
        return Prepared(lambda b: sg(*b), handle=sg, keep=[opt])
    return make


# --------------------------------------------------------------------------- measurement

def _rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _cleanup(dev):
    torch._dynamo.reset()  # drop compiled code and cudagraph trees of the previous variant
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        # cuBLAS keeps one workspace per stream alive; without this, later variants' peak
        # memory would include the workspaces of the side streams earlier variants used.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def prewarm_compile(dev):
    """Pay torch.compile's one-time process start-up (imports, compile workers) up front, so the
    first compile variant's 'first s' is not charged for it and the variants compare fairly."""
    try:
        x = torch.randn(8, device=dev, requires_grad=True)
        torch.compile(lambda t: torch.nn.functional.gelu(t * 2).sum())(x).backward()
    except Exception as e:  # the compile variants will fail (and say why) on their own
        print(f"torch.compile pre-warm failed: {type(e).__name__}: {e}", file=sys.stderr)
    _cleanup(dev)


def measure(name, variant, make, bench: BenchCase, dev, dtype, warmup, steps) -> Row:
    """Build a fresh model, time its first calls, then time ``steps`` steps after ``warmup``."""
    row = Row(name, variant)
    prep = case = None
    try:
        _cleanup(dev)
        total = FIRST_CALLS + warmup + steps
        case = models.build(bench.family, **bench.config, seed=0, device=dev, dtype=dtype)
        # Pre-made on the device so data generation and H2D copies stay out of the timings.
        batches = [case.make_batch(1000 + i) for i in range(total)]
        torch.manual_seed(0)
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        rss0 = _rss_mib()
        t0 = time.perf_counter()
        prep = make(case, batches, dev)
        for i in range(prep.done, prep.first_calls):
            loss = prep.run(batches[i])
        _sync(dev)
        row.first_s = time.perf_counter() - t0
        start = prep.first_calls
        if prep.handle is not None and prep.handle.backend == "inductor":
            prep.handle.wait_compiled()  # Inductor compiles in the background: time the fused graph
            loss = prep.run(batches[start])
            _sync(dev)
            row.fused_s, start = time.perf_counter() - t0, start + 1
            row.ready_s, row.switch_s = fused_timeline(prep.handle, t0)
        for i in range(start, FIRST_CALLS + warmup):
            loss = prep.run(batches[i])
        _sync(dev)
        times: list[float] = []
        if dev.type == "cuda":
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
            for (a, b), i in zip(ev, range(FIRST_CALLS + warmup, total)):
                a.record()
                loss = prep.run(batches[i])
                b.record()
            torch.cuda.synchronize(dev)
            times = [a.elapsed_time(b) for a, b in ev]
            row.peak_mib = torch.cuda.max_memory_allocated(dev) / 2**20
        else:
            for i in range(FIRST_CALLS + warmup, total):
                t = time.perf_counter()
                loss = prep.run(batches[i])
                times.append((time.perf_counter() - t) * 1e3)
            rss1 = _rss_mib()
            row.peak_mib = None if rss0 is None or rss1 is None else rss1 - rss0
        row.final_loss = float(loss.detach().float())
        row.steps = len(times)
        row.median_ms = statistics.median(times)
        q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
        row.p10_ms, row.p90_ms = q[0], q[-1]
        if case.tokens_per_step:
            row.tokens_per_s = case.tokens_per_step / (row.median_ms / 1e3)
            peak = peak_flops(dev)
            row.mfu = case.flops_per_step / (row.median_ms / 1e3) / peak if peak else None
        if prep.handle is not None:
            st = prep.handle.stats
            row.stats = dict(eager_calls=st.eager_calls, captures=st.captures,
                             replays=st.replays, recaptures=list(st.recaptures))
            if not st.replays:
                row.note = "no replays: ran eagerly"
            elif st.recaptures:
                row.note = f"{len(st.recaptures)} recapture(s): {st.recaptures[0]}"
            else:
                # stepgraph's own per-call cost (guards, address checks), measured without running.
                oh = prep.handle.overhead_us(*batches[-1], repeat=300)
                row.stats["overhead_us"] = {k: round(v, 1) for k, v in oh.items()}
                row.note = "overhead " + ", ".join(f"{k} {v:.1f}us" for k, v in oh.items())
    except Exception as e:  # one broken variant must not hide the others' numbers
        row.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        row.note = traceback.format_exc(limit=-3)
    finally:
        del prep, case
        _cleanup(dev)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stepgraph.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="", help=f"comma list of {', '.join(CASES)} or any "
                   f"models family ({', '.join(models.FAMILIES)}); default per device")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 100 GPU, 200 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first 3")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    p.add_argument("--variants", default="", help="comma list to run a subset (default: all)")
    p.add_argument("--stepgraph-backends", default="",
                   help="extra stepgraph backends to run besides 'auto', e.g. replay,cudagraph")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (CPU default 1: these tiny steps gain nothing from "
                   "threads, and on a busy 2-core box OpenMP waits add ~500 ms; 0 = torch default)")
    p.add_argument("--warm-cache", action="store_true",
                   help="let torch.compile use inductor's caches (default off: otherwise the second "
                   "compile variant of a case reuses the first's kernels and its 'first s' is unfair)")
    p.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"],
                   help="torch.set_float32_matmul_precision for every variant ('high': TF32)")
    p.add_argument("--quick", action="store_true", help="few steps, for CI smoke tests")
    args = p.parse_args(argv)

    dev = torch.device(args.device)
    if args.threads is None and dev.type == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = dev.type == "cuda"
    if args.steps is None:
        args.steps = 5 if args.quick else (100 if gpu else 200)
    if args.warmup is None:
        args.warmup = 2 if args.quick else 10
    # >= 1 warm-up keeps step i on batch i for handwritten too (its first replay is step 3).
    args.steps, args.warmup = max(args.steps, 1), max(args.warmup, 1)
    dtype = getattr(torch, args.dtype)
    torch.set_float32_matmul_precision(args.matmul_precision)
    if not args.warm_cache:
        import tempfile
        import torch._inductor.config as inductor_config
        inductor_config.force_disable_caches = True
        # stepgraph's background compile process needs caches (its artifact is built from
        # them): give it an empty cache dir so its compile is as cold as the others'.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    names = [c for c in args.cases.split(",") if c] or [n for n, c in CASES.items() if c.gpu == gpu and c.default]

    variants: dict[str, Callable] = {"eager": v_eager, "compile": v_compile,
                                     "reduce-overhead": v_reduce_overhead}
    if gpu:
        variants["handwritten"] = v_handwritten
    variants["stepgraph"] = v_stepgraph("auto")
    for b in filter(None, args.stepgraph_backends.split(",")):
        variants[f"stepgraph[{b}]"] = v_stepgraph(b)
    if args.variants:
        want = args.variants.split(",")
        unknown = [w for w in want if w not in variants]
        if unknown:
            p.error(f"unknown variants {unknown}; known: {list(variants)}")
        variants = {k: v for k, v in variants.items() if k in want}

    if any(k in variants for k in ("compile", "reduce-overhead")):
        prewarm_compile(dev)
    meta = header(dev, args)
    title = (f"# stepgraph bench\n\ndevice: {meta['device']} | torch {meta['torch']} | "
             f"python {meta['python']} | dtype {args.dtype} | fp32 matmul {args.matmul_precision} | {args.steps} timed steps after "
             f"{FIRST_CALLS}+{args.warmup} warm-up | {meta['time']}\n\n"
             "median ms: per-step median (" + ("CUDA events" if gpu else "perf_counter, "
             f"{meta['threads']} thread(s)") + "); speedup = eager ms / ms; "
             + ("x floor = ms / handwritten ms; " if gpu else "")
             + "first s: from building the step function to the end of the first compiled/"
             "replayed step (3 calls; handwritten: 3 warm-up steps + capture + first replay; "
             "stepgraph[inductor]: (ready, fused, switch) = s until its fused graph is loaded, until its "
             "first fused step, and the switching call's s; "
             + ("inductor caches off, compile start-up pre-warmed" if not args.warm_cache
                else "inductor caches on") + "); "
             + ("peak MiB: max_memory_allocated incl. model and batches" if gpu
                else "RSS delta MiB: resident-set growth over the variant")
             + "; final loss: last step's loss (same batches everywhere, so it should agree).\n")
    print(title, flush=True)
    md, results = [title], []
    for name in names:
        if name in CASES:
            bench = CASES[name]
            if args.quick and bench.quick:
                bench = BenchCase(bench.family, {**bench.config, **bench.quick}, bench.gpu, bench.default)
        elif name in models.FAMILIES:
            bench = BenchCase(name, {}, gpu=gpu)
        else:
            p.error(f"unknown case {name!r}; known: {', '.join(CASES)} or {', '.join(models.FAMILIES)}")
        rows = []
        for vname, make in variants.items():
            print(f"[{name}] {vname} ...", file=sys.stderr, flush=True)
            rows.append(measure(name, vname, make, bench, dev, dtype, args.warmup, args.steps))
            if rows[-1].error:
                print(rows[-1].note, file=sys.stderr, flush=True)
        cfg = ", ".join(f"{k}={v}" for k, v in bench.config.items()) or "defaults"
        section = f"## {name} ({bench.family}: {cfg})\n\n{table(name, rows, gpu)}\n"
        print(section, flush=True)
        md.append(section)
        results += [asdict(r) for r in rows]

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write("\n".join(md))
    print(f"wrote {args.out}/bench.json and {args.out}/bench.md", file=sys.stderr)
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
