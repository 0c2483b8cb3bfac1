"""Python numbers that library code changes inside the step: refused, naming the attribute.

Accelerate's ``with accelerator.accumulate(model):`` inside the step advances
``accelerator.step`` and sets ``gradient_state.sync_gradients`` in accelerate's own code, and its
``AcceleratedOptimizer.step`` decides on them. A replay runs no Python code, so the counter stayed
at the capture's value and one graph replayed forever: with 3 accumulation steps the optimizer
never stepped again (accelerate's gradient_accumulation.py example, silently wrong). The step's
own code is checked by pyvalues/outputs (``refuse_python_side_effects``); this covers objects of
library classes the step's code reads (a global ``accelerator``, ``self.trainer``) and the
library objects they hold, two levels deep: their numbers and booleans (counters and flags that
decide; a string such as a tqdm bar's description is display) before the call and after it. What stepgraph itself replays is left out: LR schedulers
(their ``step()`` is redone), optimizers, modules (their state is slots), and objects whose
methods the step calls as statements (pycalls.py redoes those calls after each replay).
"""
from __future__ import annotations

import types

import torch
from torch import nn

from ..errors import CaptureError, library_file

_PLAIN = (bool, int, float, str, type(None))
_DECIDING = (bool, int, float)   # counters and flags; a string (tqdm's desc) is display
_DEPTH = 2


def _library_object(v) -> bool:
    t = type(v)
    if isinstance(v, (_PLAIN, torch.Tensor, nn.Module, torch.optim.Optimizer, type, types.ModuleType,
                      types.FunctionType, types.MethodType, types.BuiltinFunctionType, list, tuple,
                      dict, set, frozenset)) or not hasattr(v, "__dict__"):
        return False
    if isinstance(v, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return False
    mod = getattr(t, "__module__", "") or ""
    if mod in ("builtins", "__main__", "types", "argparse", "collections", "functools"):
        return False   # (a SimpleNamespace, an argparse Namespace: the user's data, pyvalues' part)
    import sys
    m = sys.modules.get(mod)
    f = getattr(m, "__file__", None)
    return f is not None and library_file(f) and not mod.startswith(("stepgraph", "torch"))


def library_scalars(py, args, redone=()) -> list:
    """Before the call: ``(describe, owner, name, value, where the step reads the object)`` of each plain attribute of the library
    objects the step's code reads (``py.sources``), but not of ``redone`` sources' objects."""
    skip = {id(s.read_or(args)) for s in redone}
    # (attributes the step's own code names -- ``self.trainer.global_step += 1`` -- are pyvalues'
    # and trackplan's: guarded or replayed there)
    named = set()
    for s in py.sources:
        if s.path and s.path[-1][0] == "attr":
            owner = type(s)(s.kind, s.root, s.name, s.path[:-1]).read_or(args)
            named.add((id(owner), s.path[-1][1]))
    out, seen = [], set()

    def visit(v, label, depth, where):
        if id(v) in seen or id(v) in skip or not _library_object(v):
            return
        seen.add(id(v))
        try:
            items = list(vars(v).items())
        except TypeError:
            return
        for k, x in items:
            if isinstance(x, _DECIDING) and (id(v), k) not in named:
                out.append((f"{label}.{k}", v, k, x, where))
            elif depth < _DEPTH:
                visit(x, f"{label}.{k}", depth + 1, where)
    for s in py.sources:
        if s.from_step:
            v = s.read_or(args)
            if v is not None:
                visit(v, s.describe(), 1, s.where)
    return out


def refuse_library_changes(before: list, redone=(), replayed=()) -> None:
    """After the call: raise for the first attribute of ``library_scalars`` that changed, but not
    of an object whose calls a replay redoes (``redone``: pycalls.CallEffect sources, found while
    tracing -- a logger's ``update(**tensors)``) or that a replay writes itself (``replayed``: the
    sources of number and source effects -- ``meter.update(loss.item(), n)``'s sum and count)."""
    # (a record's number effect is written through its dict: ``meter``'s, for ``meter.count``)
    names = [s.describe() for s in list(redone) + list(replayed) if hasattr(s, "describe")]
    prefixes, exact = tuple(f"{n}." for n in names), set(names)
    for label, owner, name, value, where in before:
        if (prefixes and label.startswith(prefixes)) or label in exact:
            continue
        now = getattr(owner, name, value)
        if now != value and not (isinstance(now, float) and now != now and value != value):
            lib = type(owner).__module__.split(".")[0]
            fix = ("call the code that changes it outside the step, in the loop around the call")
            if lib == "accelerate":
                fix = ("put `with accelerator.accumulate(model):` around the call, outside the step, and "
                       "capture with stepgraph.integrations.hf.accelerate_step(accelerator)")
            raise CaptureError(
                f"the step changes {label} ({value!r} -> {now!r}) inside {lib}'s code; a replay runs no "
                "Python code, so it would keep this capture's value (and every decision made on it)\n"
                "  this call ran eagerly to its end: your model and optimizer hold the result of this step",
                op=f"{type(owner).__name__}.{name}", where=where or f"{lib}'s code, called from the step", fix=fix)
