"""``torch.compile``d code inside a captured step is traced through as eager code.

``make_fx`` cannot enter Dynamo's compiled code: Dynamo's wrapper raises FX's "symbolically
trace a dynamo-optimized function" error as soon as it sees an FX trace in progress, before
any stance applies (``torch.compiler.set_stance("force_eager")`` does not avoid it). Dynamo's
own switch for this case, ``error_on_nested_fx_trace = False``, makes that wrapper call the
original function with Dynamo off instead, so its ops land in stepgraph's graph. That covers
compiled modules (``OptimizedModule``), ``@torch.compile`` functions and compiled methods
(``torch.compile(opt.step)``) wherever the step reaches them -- a closure, an argument, a
library -- where unwrapping ``_orig_mod`` would reach only the modules stepgraph can see.
"""
from __future__ import annotations

import contextlib
import inspect
import sys

import torch


def inline_compiled():
    """While tracing: compiled code runs as the plain Python it wraps."""
    cfg = sys.modules.get("torch._dynamo.config")  # nothing can be compiled before Dynamo loads
    return cfg.patch(error_on_nested_fx_trace=False) if cfg is not None else contextlib.nullcontext()


def compiled_parts(fn, reg, args=(), kwargs=None) -> list[str]:
    """Names of the torch.compile'd modules (among the step's state) and functions (in the
    step's closure, its globals and its arguments) that the trace runs as eager code."""
    ev = sys.modules.get("torch._dynamo.eval_frame")
    if ev is None:
        return []
    found = []
    for root, mod in reg.modules:
        for sub, m in mod.named_modules():
            if isinstance(m, ev.OptimizedModule):
                found.append(f"{root}.{sub}" if sub else root)
    plain = inspect.unwrap(fn)
    try:
        cv = inspect.getclosurevars(plain) if inspect.isfunction(plain) else None
    except (TypeError, ValueError):
        cv = None
    named = list(cv.nonlocals.items()) + list(cv.globals.items()) if cv is not None else []
    named += [(f"argument {i}", a) for i, a in enumerate(args)] + list((kwargs or {}).items())
    for name, v in named:
        # Dynamo's wrapper of a compiled function or method keeps the original here.
        if not isinstance(v, torch.nn.Module) and callable(v) and hasattr(v, "_torchdynamo_orig_callable"):
            found.append(name)
    return found


def note_compiled_parts(step, args, kwargs) -> None:
    """Say once per step (explain(), the log, and a warning unless the whole step is fused by
    Inductor anyway) that compiled code in it runs as eager kernels inside the graph."""
    import logging
    import warnings
    parts = compiled_parts(step.fn, step._reg, args, kwargs)
    if not parts:
        return
    note = (f"torch.compile'd {', '.join(parts)} traced as eager code: the captured graph runs their "
            "eager kernels, not Dynamo's compiled ones (backend='inductor' fuses the whole step)")
    if note in step._prepared:
        return
    step._prepared.append(note)
    logging.getLogger("stepgraph").info("stepgraph: %s: %s", step.__name__, note)
    if step.backend != "inductor":
        warnings.warn(f"stepgraph: {step.__name__}: {note}", stacklevel=5)
