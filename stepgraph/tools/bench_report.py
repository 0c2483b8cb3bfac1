"""Markdown and metadata for :mod:`stepgraph.bench` results."""
from __future__ import annotations

import os
import platform
import sys
import time

import torch


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def table(name: str, rows: list, gpu: bool) -> str:
    """Markdown table for one case; speedup = eager_ms / ms, 'x floor' = ms / handwritten_ms."""
    by = {r.variant: r for r in rows if not r.error}
    eager = by.get("eager")
    hand = by.get("handwritten")
    head = ["case", "variant", "median ms", "speedup vs eager"]
    head += ["x handwritten floor"] if gpu else []
    scale = any(getattr(r, "tokens_per_s", None) for r in rows)  # real-scale cases (models_scale.py)
    head += ["tokens/s", "MFU"] if scale else []
    head += ["first s", "peak MiB" if gpu else "RSS delta MiB", "final loss", "note"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.error:
            cells = [name, r.variant, f"FAILED: {r.error}"] + ["-"] * (len(head) - 3)
        else:
            cells = [name, r.variant, _f(r.median_ms, ".3f"),
                     _f(eager.median_ms / r.median_ms if eager else None, ".2f")]
            cells += [_f(r.median_ms / hand.median_ms if hand else None, ".2f")] if gpu else []
            cells += [_f(r.tokens_per_s, ",.0f"), "-" if r.mfu is None else f"{r.mfu:.1%}"] if scale else []
            cells += [_f(r.first_s, ".2f") + _timeline(r), _f(r.peak_mib, ".1f"), _f(r.final_loss, ".4f"),
                      r.note.replace("|", "/").replace("\n", " ")[:120]]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _timeline(r) -> str:
    """backend="inductor"'s compile timeline: fused graph ready, first fused step, switching call."""
    if not r.fused_s:
        return ""
    ready = f"ready {r.ready_s:.1f}, " if getattr(r, "ready_s", None) else ""
    switch = f", switch {r.switch_s:.2f}" if getattr(r, "switch_s", None) is not None else ""
    return f" ({ready}fused {r.fused_s:.1f}{switch})"


def header(dev, args) -> dict:
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
        (platform.processor() or platform.machine()) + f" ({os.cpu_count()} cpus, "
        f"{torch.get_num_threads()} threads)",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "threads": torch.get_num_threads(), "warm_cache": args.warm_cache, "dtype": args.dtype,
        "matmul_precision": args.matmul_precision, "steps": args.steps, "warmup": args.warmup,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
    }
