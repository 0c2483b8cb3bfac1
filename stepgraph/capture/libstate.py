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

from ..errors import CaptureError, library_file, user_frame
from .effects import Problem

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


def library_effects(before: list, tracer, number_effects: list) -> list:
    """Inside the trace, after the step: a library object's number the step set to a value the
    graph computes (timm's ``lr_scheduler.step_update(num_updates, metric=losses_m.avg)`` stores
    ``self.metric``, a value read from the loss) or to tracked arithmetic: written again after
    each replay, as eager's Python would -- a pyeffects.SourceEffect (returned) or a
    trackplan.NumberEffect (appended to ``number_effects``); its attribute holds the plain value
    now. It was refused by refuse_library_changes."""
    from .hostscalar import _plain, current
    from .numchecks import Root
    from .pyeffects import SourceEffect
    from .pyvalues import Source
    from .trackplan import NumberEffect
    from .tracked import _PROXIES
    out = []
    for label, owner, name, value, _ in before:
        now = vars(owner).get(name, value) if isinstance(getattr(owner, "__dict__", None), dict) else value
        if now is value:
            continue
        src = Source("object", owner, label.rsplit(".", 1)[0], (("attr", name),))
        if isinstance(now, float) and current(now, tracer):
            out.append(SourceEffect(src, "read", node=now.node))
            vars(owner)[name] = _plain(now)
        elif type(now) in _PROXIES and getattr(now, "_e", None) is not None:
            number_effects.append(NumberEffect(Root("source", src, label), None, now._e))
            vars(owner)[name] = now._v
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


def state_counter(slot, old, new, reg) -> Problem | None:
    """A Python number in an optimizer's per-parameter state that the step changed and that no
    replay writes: a counter the trace did not track (trackplan's ``Root("slot")`` tracks the
    ones there when the capture begins: ``state['step'] += 1`` in microsoft/LoRA's AdamW). A
    replay would write back this call's value and bake it into the update, so every replay
    would repeat this step's count: refused. (The warm-up call ran the same code, so a number
    the step sets to a constant is equal here and passes.)"""
    def plain(v):
        return type(v) in (int, float)
    if slot.kind != "optstate" or new is old:
        return None
    opt = next((o for _, o in reg.optimizers if any(st is slot.owner for st in o.state.values())), None)
    where = _writer_line(type(opt), slot.key) if opt is not None else user_frame()
    cls = type(opt).__name__ if opt is not None else "the optimizer"
    if isinstance(new, (list, tuple, dict)) and any(isinstance(t, torch.Tensor) for t in
                                                    (new.values() if isinstance(new, dict) else new)):
        # (a history the optimizer rebuilds, ``state['h'] = [state['h'][1], grad.clone()]``: the
        # graph read the old list's tensors as its constants and each replay wrote back this
        # call's list -- silently wrong)
        return Problem(
            f"{cls} rebinds {slot.source} to a new {type(new).__name__} of tensors at each step: a replay runs "
            "no Python, so it would read this call's tensors and write back this call's "
            f"{type(new).__name__} at every step", where,
            f"keep them in one tensor updated in place (state[{slot.key!r}] = torch.zeros(n, *p.shape) when the "
            f"state is made; state[{slot.key!r}][i].copy_(...) or .roll(...) then copy_), which the graph repeats",
            plain=True)
    if not (plain(old) and plain(new)) or old == new:
        return None
    if opt is not None and type(opt).__module__.startswith("torch.optim."):
        # torch's own (SparseAdam's int ``state['step']``): the user cannot change its code, but
        # can step it after the graph, which still replays forward and backward (sparse grads too).
        from .effects import STEP_SITES
        return Problem(
            f"torch.optim.{cls} keeps its step count as a Python number in its per-parameter state "
            f"({slot.source}: {old!r} -> {new!r}) and updates it in Python: a replay runs no Python, "
            f"so it would compute every update with this call's count", STEP_SITES.get(opt, where),
            f"call this optimizer's step() outside the compiled step, after it returns (the forward "
            f"and backward, sparse gradients included, still replay), or use an optimizer that keeps "
            f"the count in a tensor (torch.optim.Adam/AdamW/SGD)", plain=True)
    return Problem(
        f"{cls} keeps a Python number in its per-parameter state and the step changes it "
        f"({slot.source}: {old!r} -> {new!r}): a replay runs no Python, so it would write back "
        f"{new!r} at every step and compute the update with it", where,
        f"keep the counter in a tensor (state[{slot.key!r}] = torch.tensor(0.) when the state is made; "
        f"state[{slot.key!r}] += 1 then updates it in place inside the graph), or use a torch.optim "
        f"optimizer (torch.optim.AdamW for an Adam with decoupled weight decay)", plain=True)


def _writer_line(cls, key) -> str:
    """``file:line (code)`` of the line of ``cls.step`` that assigns ``state[key]`` (its
    ``def`` line when none is found): where the user's optimizer changes the number."""
    import inspect
    import re
    fn = inspect.unwrap(getattr(cls, "step", None))   # (the profiling hook, no_grad: wrappers)
    try:
        lines, first = inspect.getsourcelines(fn)
        path = inspect.getsourcefile(fn)
    except (TypeError, OSError):
        return f"{cls.__module__}.{cls.__qualname__}.step"
    pat = re.compile(r"\[\s*(['\"])" + re.escape(str(key)) + r"\1\s*\]\s*(\+|-|\*)?=(?!=)")
    hits = [i for i, line in enumerate(lines) if pat.search(line)]
    i = next((i for i in hits if "+=" in lines[i]), hits[-1] if hits else 0)
    return f"{path}:{first + i} ({lines[i].strip()})"
