"""Benchmark stepgraph's framework integrations against the same framework's eager and
``torch.compile`` runs (issue 18), in one process on one device::

    python -m stepgraph.bench_integrations --out bench_integrations.md          # GPU: 'small' sizes
    python -m stepgraph.bench_integrations --device cpu --compile-backend eager  # CPU: 'tiny' sizes

On a GPU the defaults (100 timed steps after 10, a few ms each) take well under a minute of
training in all; the run's time is torch.compile's cold compiles (inductor caches off, one per
compile variant, a few minutes in all). Progress goes to stderr, with the seconds since the start;
the markdown (and a .json of the rows) is rewritten after every suite.

Suites (``--suites``), each run under every variant (``--variants``):

* ``hf_gpt2``: ``transformers.Trainer`` fine-tuning a ``GPT2LMHeadModel`` (causal LM loss);
* ``hf_bert``: ``transformers.Trainer`` fine-tuning a ``BertForSequenceClassification``;
* ``pl_gpt``: ``lightning.pytorch.Trainer`` fitting a small GPT ``LightningModule`` (automatic
  optimization, AdamW, ``gradient_clip_val=1.0``, a per-step warm-up + cosine ``LambdaLR``,
  ``self.log("train_loss", ...)``).

Variants: ``eager`` (the framework as is); ``compile``: Hugging Face
``TrainingArguments(torch_compile=True)``, Lightning ``trainer.fit(torch.compile(model))`` (its
documented way: Lightning then runs ``forward`` and ``training_step`` compiled);
``reduce-overhead``: the same with ``mode="reduce-overhead"`` (CUDA only: a skipped row on the
CPU); ``stepgraph``: ``StepGraphTrainer`` / ``callbacks=[StepGraphCallback()]``. Lightning also
runs ``compile-net`` / ``reduce-overhead-net``: ``torch.compile`` of the ``nn.Module`` inside the
LightningModule (``module.gpt.compile()``), the way left when Lightning's documented one fails (with
Lightning 2.6 and torch 2.13 dynamo cannot trace ``self.log`` inside the compiled ``training_step``:
``InternalTorchDynamoError: 'method' object has no attribute '__dict__'``); they run only when the
documented variant failed (or when named in ``--variants``), a skipped row otherwise.

What is timed. One *step* is the framework's own optimizer step, between its callback hooks:
Hugging Face ``on_step_begin`` -> ``on_step_end`` (``training_step``: moving the batch to the
device, forward, loss, backward; the loop's NaN/inf filter on the loss, which reads it on the
host every step (``logging_nan_inf_filter``, default on); clipping, ``optimizer.step()``,
``lr_scheduler.step()``, ``zero_grad``); Lightning ``on_train_batch_start`` -> ``on_train_batch_end``
(``training_step`` with ``self.log``, backward, clipping, ``optimizer.step()``, ``zero_grad``, the
scheduler step; the batch is already on the device). On CUDA a pair of CUDA events per step
(no synchronization added), on the CPU ``perf_counter``. ``loop ms`` is the median interval
between consecutive step ends: everything the framework does per step (data loading,
callbacks, logging) included. Medians are over the last ``--steps`` steps; the ``--warmup``
steps before them (stepgraph's warm-up and capture, torch.compile's compile and CUDA-graph
recording) are not in them and are reported as ``step 1 s`` and ``steps 1-3 s``. ``fit s`` is
the whole ``train()``/``fit()``. Peak memory: ``torch.cuda.max_memory_allocated`` over the fit.

The framework's behaviour kept (and what was chosen): each variant builds a fresh model with
seed 0 and the same synthetic batches in the same order (Hugging Face
``train_sampling_strategy="sequential"``, Lightning ``shuffle=False``), ``dataloader_num_workers=0``,
no evaluation and no checkpoints during the fit, loss logging every ``--log-every`` steps
(Hugging Face ``logging_steps``, ``report_to=[]``; Lightning ``log_every_n_steps`` with
``logger=False``), progress bars off, dropout as the configs default (0.1), bf16 autocast where
the device supports it (``--bf16 auto``; Hugging Face ``bf16=True``, Lightning
``precision="bf16-mixed"``), the Hugging Face defaults otherwise (fused AdamW on torch >= 2.8,
linear schedule, ``max_grad_norm=1``). The synthetic data is learnable (a random walk over the
vocabulary; the classifier's label is a function of a token), so the loss falls during the
fit and a variant that trains wrongly shows up in ``loss rel diff``: the largest relative
difference of its logged losses from eager's at the same steps (``!`` past ``--loss-tol``;
dropout draws other masks under torch.compile, so it is not zero there).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

VARIANTS = ("eager", "compile", "reduce-overhead", "stepgraph")
PL_VARIANTS = ("eager", "compile", "reduce-overhead", "compile-net", "reduce-overhead-net", "stepgraph")
COMPILED = ("compile", "reduce-overhead", "compile-net", "reduce-overhead-net")
FALLBACK = {"compile-net": "compile", "reduce-overhead-net": "reduce-overhead"}  # run when that one failed
FIRST = 3  # steps 1-3: warm-up, capture and the first replay (stepgraph); the compiles (torch.compile)

# Model sizes. 'small': a small fine-tune whose step is launch-bound on a GPU (~5M parameters);
# 'tiny': for the CPU smoke test.
SIZES = {
    "small": dict(layers=4, d=256, heads=4, vocab=8192, seq=256, batch=8, cls_seq=128, cls_batch=16),
    "tiny": dict(layers=2, d=32, heads=2, vocab=128, seq=16, batch=2, cls_seq=16, cls_batch=2),
}


@dataclass
class Ctx:
    """What every suite's variant needs to build and run its fit."""

    dev: torch.device
    bf16: bool
    total: int            # steps in the fit (warmup + steps)
    log_every: int
    compile_backend: str
    size: dict
    workdir: str


@dataclass
class Row:
    suite: str
    variant: str
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    loop_ms: float | None = None
    step1_s: float | None = None
    first3_s: float | None = None
    fit_s: float | None = None
    peak_mib: float | None = None
    final_loss: float | None = None
    loss_rel_diff: float | None = None
    steps: int = 0
    losses: list = field(default_factory=list)  # [(step, loss)] as the framework logged them
    note: str = ""
    error: str = ""


class StepTimer:
    """Begin/end marks of each step: CUDA events (recorded, read after the fit) or perf_counter."""

    def __init__(self, dev: torch.device, total: int):
        self.cuda = dev.type == "cuda"
        n = total + 2  # (a framework may run a step more than asked: the marks then stop)
        self.marks = [[torch.cuda.Event(enable_timing=True) for _ in range(n)] for _ in (0, 1)] if self.cuda \
            else [[0.0] * n for _ in (0, 1)]
        self.n = [0, 0]

    def _mark(self, which: int) -> None:
        i = self.n[which]
        if i >= len(self.marks[which]):
            return
        if self.cuda:
            self.marks[which][i].record()
        else:
            self.marks[which][i] = time.perf_counter()
        self.n[which] = i + 1

    def begin(self) -> None:
        self._mark(0)

    def end(self) -> None:
        self._mark(1)

    def results(self) -> tuple[list, list]:
        """(per-step ms, end-to-end ms between consecutive step ends)."""
        k = min(self.n)
        b, e = self.marks[0][:k], self.marks[1][:k]
        if self.cuda:
            torch.cuda.synchronize()
            return [x.elapsed_time(y) for x, y in zip(b, e)], [x.elapsed_time(y) for x, y in zip(e, e[1:])]
        return [(y - x) * 1e3 for x, y in zip(b, e)], [(y - x) * 1e3 for x, y in zip(e, e[1:])]


def _cleanup(dev) -> None:
    torch._dynamo.reset()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def _prewarm_compile(dev, backend: str) -> None:
    """torch.compile's one-time start-up (imports, compile workers), so the first compile
    variant's first steps are not charged for it."""
    try:
        x = torch.randn(8, device=dev, requires_grad=True)
        torch.compile(lambda t: torch.nn.functional.gelu(t * 2).sum(), backend=backend)(x).backward()
    except Exception as e:  # the compile variants fail (and say why) on their own
        print(f"torch.compile pre-warm failed: {type(e).__name__}: {e}", file=sys.stderr)
    _cleanup(dev)


def measure(suite: str, variant: str, run, ctx: Ctx, warmup: int) -> Row:
    """Fit once under ``variant`` with a ``StepTimer``; ``run(variant, ctx, timer)`` returns
    (losses, note) or raises ``Skip``."""
    row = Row(suite, variant)
    try:
        _cleanup(ctx.dev)
        timer = StepTimer(ctx.dev, ctx.total)
        if ctx.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.dev)
        t0 = time.perf_counter()
        row.losses, row.note = run(variant, ctx, timer)
        if ctx.dev.type == "cuda":
            torch.cuda.synchronize(ctx.dev)
            row.peak_mib = torch.cuda.max_memory_allocated(ctx.dev) / 2**20
        row.fit_s = time.perf_counter() - t0
        times, loop = timer.results()
        if len(times) < ctx.total:
            raise RuntimeError(f"{len(times)} steps timed, {ctx.total} expected")
        timed = times[warmup:]
        row.steps = len(timed)
        row.median_ms = statistics.median(timed)
        q = statistics.quantiles(timed, n=10) if len(timed) >= 2 else [timed[0]] * 9
        row.p10_ms, row.p90_ms = q[0], q[-1]
        row.loop_ms = statistics.median(loop[warmup:]) if loop[warmup:] else None
        row.step1_s, row.first3_s = times[0] / 1e3, sum(times[:FIRST]) / 1e3
        row.final_loss = row.losses[-1][1] if row.losses else None
    except Skip as s:
        row.note = f"skipped: {s}"
    except Exception as e:  # one broken variant must not hide the others' numbers
        msg = str(e).strip().splitlines()
        row.error = f"{type(e).__name__}: {msg[0] if msg else ''}"
        row.note = traceback.format_exc(limit=-4)
    finally:
        _cleanup(ctx.dev)
    return row


class Skip(Exception):
    """A variant that does not apply on this device."""


def compare_losses(rows: list, tol: float) -> None:
    eager = next((r for r in rows if r.variant == "eager" and r.losses), None)
    if eager is None:
        return
    ref = dict(eager.losses)
    for r in rows:
        diffs = [abs(v - ref[s]) / max(abs(ref[s]), 1e-12) for s, v in r.losses if s in ref]
        if diffs:
            r.loss_rel_diff = max(diffs)
            if r.loss_rel_diff > tol:
                r.note = (r.note + "; " if r.note else "") + f"losses differ from eager's by more than {tol:g}"


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def table(rows: list, gpu: bool, tol: float) -> str:
    head = ["suite", "variant", "step ms (median)", "p10-p90 ms", "x eager", "x best compile", "loop ms",
            "step 1 s", "steps 1-3 s", "fit s", "peak MiB" if gpu else "peak MiB (CUDA only)", "final loss",
            "loss rel diff vs eager", "note"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ok = {r.variant: r for r in rows if r.median_ms is not None}
    eager = ok.get("eager")
    compiled = [r.median_ms for v, r in ok.items() if v in COMPILED]
    best = min(compiled) if compiled else None
    for r in rows:
        if r.error or r.median_ms is None:
            what = f"FAILED: {r.error}" if r.error else r.note
            out.append("| " + " | ".join([r.suite, r.variant, what] + ["-"] * (len(head) - 3)) + " |")
            continue
        diff = _f(r.loss_rel_diff, ".1e") + (" !" if (r.loss_rel_diff or 0) > tol else "")
        cells = [r.suite, r.variant, f"{r.median_ms:.3f}", f"{r.p10_ms:.2f}-{r.p90_ms:.2f}",
                 _f(eager.median_ms / r.median_ms if eager else None, ".2f"),
                 _f(best / r.median_ms if best else None, ".2f"), _f(r.loop_ms, ".3f"), _f(r.step1_s, ".2f"),
                 _f(r.first3_s, ".2f"), _f(r.fit_s, ".1f"), _f(r.peak_mib, ".0f"), _f(r.final_loss, ".4f"), diff,
                 r.note.replace("|", "/").replace("\n", " ")[:160]]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _suites() -> dict:
    from . import bench_integrations_hf as hf, bench_integrations_pl as pl
    return {"hf_gpt2": (hf.run_gpt2, hf.describe_gpt2, VARIANTS), "hf_bert": (hf.run_bert, hf.describe_bert, VARIANTS),
            "pl_gpt": (pl.run_gpt, pl.describe_gpt, PL_VARIANTS)}


def _versions() -> str:
    out = [f"torch {torch.__version__}"]
    for name in ("transformers", "lightning", "accelerate"):
        try:
            out.append(f"{name} {__import__(name).__version__}")
        except ImportError:
            out.append(f"{name} -")
    return ", ".join(out)


def _write(path: str, md: list, meta: dict) -> None:
    out = os.path.abspath(path)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(md))
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(meta, f, indent=2)
    print(f"wrote {out} and its .json", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stepgraph.bench_integrations", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--suites", default="hf_gpt2,hf_bert,pl_gpt")
    p.add_argument("--variants", default="", help=f"comma list (default: each suite's own): {', '.join(PL_VARIANTS)}")
    p.add_argument("--size", choices=list(SIZES), default=None, help="model sizes (default: small on CUDA, tiny on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 100 CUDA, 10 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10 CUDA, 5 CPU; >= 3)")
    p.add_argument("--log-every", type=int, default=None,
                   help="the frameworks' loss logging interval in steps (default 10 CUDA, 5 CPU)")
    p.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                   help="bf16 autocast (auto: on where the CUDA device supports it, off on the CPU)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compile variants ('eager': the CPU smoke test)")
    p.add_argument("--warm-cache", action="store_true",
                   help="let torch.compile use inductor's caches (default off: every compile variant compiles cold)")
    p.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU default 1)")
    p.add_argument("--loss-tol", type=float, default=0.05, help="largest loss rel diff vs eager not flagged")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT") or ".", "bench_integrations.md"),
                   help="markdown file to write (a .json with the raw rows beside it)")
    args = p.parse_args(argv)

    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    if args.threads is None and not gpu:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    args.size = args.size or ("small" if gpu else "tiny")
    args.steps = max(1, args.steps if args.steps is not None else (100 if gpu else 10))
    args.warmup = max(FIRST, args.warmup if args.warmup is not None else (10 if gpu else 5))
    args.log_every = max(1, args.log_every or (10 if gpu else 5))
    bf16 = args.bf16 == "on" or (args.bf16 == "auto" and gpu and torch.cuda.is_bf16_supported())
    torch.set_float32_matmul_precision(args.matmul_precision)
    if not args.warm_cache:
        import torch._inductor.config as inductor_config
        inductor_config.force_disable_caches = True
    suites, variants = _suites(), [v for v in args.variants.split(",") if v]
    names = [s for s in args.suites.split(",") if s]
    bad = [s for s in names if s not in suites] + [v for v in variants if v not in PL_VARIANTS]
    if bad:
        p.error(f"unknown {bad}; suites: {list(suites)}, variants: {list(PL_VARIANTS)}")
    if not variants or any(v in COMPILED for v in variants):
        _prewarm_compile(dev, args.compile_backend)

    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="bench-integrations-")
    ctx = Ctx(dev, bf16, args.warmup + args.steps, args.log_every, args.compile_backend, SIZES[args.size], workdir)
    device = torch.cuda.get_device_name(dev) if gpu else f"{platform.machine()} CPU ({os.cpu_count()} cpus, " \
        f"{torch.get_num_threads()} threads)"
    command = "python -m stepgraph.bench_integrations " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    title = (f"# stepgraph integrations bench\n\ndevice: {device} | {_versions()} | python {platform.python_version()} | "
             f"bf16 {'on' if bf16 else 'off'} | fp32 matmul {args.matmul_precision} | compile backend "
             f"{args.compile_backend}, inductor caches {'on' if args.warm_cache else 'off'} | {args.steps} timed "
             f"steps after {args.warmup} | size {args.size} | {time.strftime('%Y-%m-%d %H:%M:%S')}\n\n"
             f"command: `{command}`\n\n"
             "step ms: median of the framework's optimizer step (Hugging Face on_step_begin -> on_step_end, "
             "Lightning on_train_batch_start -> on_train_batch_end; " + ("CUDA events" if gpu else "perf_counter")
             + "); x eager / x best compile: that median over this row's; loop ms: median step-end to step-end "
             "(data, callbacks, logging included); step 1 s, steps 1-3 s: the first steps (compile, capture); "
             "fit s: the whole fit; final loss: the last logged loss; loss rel diff: largest relative "
             "difference of the logged losses from eager's at the same steps.\n")
    print(title, flush=True)
    md, results = [title], []
    for name in names:
        run, describe, own = suites[name]
        rows = []
        for v in [v for v in own if not variants or v in variants]:
            primary = next((r for r in rows if r.variant == FALLBACK.get(v)), None)
            if v not in variants and primary is not None and primary.median_ms is not None:
                rows.append(Row(name, v, note=f"skipped: {primary.variant} worked (run it with --variants)"))
                continue
            print(f"[{name}] {v} ... ({time.perf_counter() - start:.0f} s into the run)", file=sys.stderr, flush=True)
            t = time.perf_counter()
            rows.append(measure(name, v, run, ctx, args.warmup))
            r = rows[-1]
            print(f"[{name}] {v}: " + (f"FAILED {r.error}\n{r.note}" if r.error else
                                       f"{_f(r.median_ms, '.3f')} ms/step, {time.perf_counter() - t:.1f} s {r.note}"),
                  file=sys.stderr, flush=True)
        compare_losses(rows, args.loss_tol)
        try:
            what = describe(ctx)
        except Exception as e:  # (a framework not installed: every row already says so)
            what = f"({type(e).__name__}: {e})"
        section = f"## {name}: {what}\n\n{table(rows, gpu, args.loss_tol)}\n"
        print(section, flush=True)
        md.append(section)
        results += [asdict(r) for r in rows]
        # written after every suite: a run cut short keeps the suites it finished
        _write(args.out, md, dict(command=command, device=device, versions=_versions(), bf16=bf16, size=args.size,
                                  results=results))
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
