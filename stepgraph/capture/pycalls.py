"""Calls the step makes on a library's objects for their side effect: replayed.

``pbar.update(1)``, ``pbar.set_postfix(loss=loss.item())``, ``writer.add_scalar('loss', loss,
i)``, ``logger.info('%s', x)``: a statement calling a method of an object from a library (not
torch, not the step's state) whose result the code drops. A replay runs no Python, so these ran
only at capture: a tqdm bar froze after two steps and a logger logged once, silently. Now:

* found in the bytecode (pyvalues.find_sources: a ``("call", m)`` chain, a popped result); an
  object the step uses only so is keyed by its **type**, not its identity: it is read again at
  each replay, so a new tqdm bar per epoch is no new graph (TeaPearce's DDPM recaptured per
  epoch); one whose methods also answer something (``log.isEnabledFor(...)``) stays keyed by
  identity;
* while traced, each such call is recorded (the method wrapped on the instance); a call whose
  arguments are constants, tensors the step computed, values read on the host (``loss.item()``),
  numbers of the call's (an ``epoch`` argument) and strings formatted from read values on the
  call's line (``f"loss: {loss.item():.4f}"``, rebuilt from the reads) is a :class:`CallEffect`,
  **redone after each replay** with that replay's values (tensors: outputs cloned like the
  user's; reads: graph outputs);
* a call given anything else (an object, a string made some other way from a read value) runs
  only at capture: warned;
* a call that computes on tensors or steps a scheduler is the graph's business, not a side
  effect to redo: refused clearly. (An object holding a model, an optimizer, a scheduler or a
  tensor is never wrapped, nor is a record of numbers -- a meter -- whose attributes trackplan.py
  tracks one by one.)
"""
from __future__ import annotations

import builtins
import contextlib
import os
import types
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn

from . import nextlr
from ..errors import library_class
from .effects import Problem, _is_traced
from .formats import NumberHole, earlier_text, hole, line_of, render, template
from .percent import texts as percent_texts
from .callframes import call_lines as _call_lines, formats_numbers as _formats_numbers, \
    from_user_code as _from_user_code, percent_formatted as _percent_formatted
from .hostscalar import current
from .numchecks import roots_of
from .tracked import _PROXIES

_FRAMEWORKS = ("torch", "stepgraph", "numpy", "random", "builtins", "collections", "functools", "threading",
               "multiprocessing", "concurrent", "queue", "asyncio")
# Checkpoint writes of the frameworks, redone after each replay with that replay's values (an
# early-stopping ``torch.save(model.state_dict(), path)`` in the step ran only at capture: the
# checkpoint on disk was the capture's, silently).
_SAVES = {("torch", "save"), ("numpy", "save"), ("numpy", "savez")}
_STATEFUL = (torch.Tensor, nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
             torch.amp.GradScaler)
_CONSTANTS = (bool, int, float, str, bytes, type(None))


def _holds_state(obj) -> bool:
    """Does the object hold, one level deep, something the graph computes on or steps (a model,
    an optimizer, a scheduler, a tensor)? Then it is no mere logger: keyed by identity."""
    try:
        values = list(vars(obj).values())
    except TypeError:
        return False
    for v in values:
        if isinstance(v, _STATEFUL):
            return True
        # (in a container: not a tensor -- ``tqdm(batches)`` keeps its iterable -- but a model; a
        # library's list of float tensors too: diffusers' EMAModel.shadow_params, refused as a logger)
        items = list(v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ())[:64]
        if any(isinstance(x, _STATEFUL[1:]) for x in items) or items and type(v) is list and all(
                isinstance(x, torch.Tensor) and x.is_floating_point() for x in items) and library_class(obj):
            return True
    return False


def replayable_callee(obj, method: str) -> bool:
    """Is ``obj.method(...)`` as a statement a library side effect a replay can redo?"""
    if isinstance(obj, _STATEFUL + _CONSTANTS + (list, dict, set, tuple, types.ModuleType, type)):
        return False
    t = type(obj)
    mod = getattr(t, "__module__", "") or ""
    # (TensorBoard's SummaryWriter is torch's but a logger: ``writer.add_scalar("loss",
    # loss.item(), step)`` in the step float()-ed the read value -- a recapture at every call)
    if (mod.split(".")[0] in _FRAMEWORKS and not mod.startswith("torch.utils.tensorboard")) \
            or not hasattr(obj, "__dict__"):
        return False
    f = getattr(t, method, None)
    if f is None:
        return False
    # A method of the user's own class is redone too (torchvision's ``metric_logger.update(
    # loss=loss.item(), lr=...)``: meters of deques in a defaultdict, which no Source reaches):
    # pyvalues.find_sources does not read its code as the step's own then.
    from .trackplan import record_key
    # (a record -- a meter of numbers -- is tracked attribute by attribute: trackplan.py)
    return not _holds_state(obj) and record_key(obj) is None


def library_calls(src, name: str, args, found: dict) -> None:
    """``logging.info(...)``, ``wandb.log(...)``: a statement calling a function of a library
    module (not torch's, numpy's, random's: ``src`` reads the module) is a call a replay redoes."""
    mod = src.read_or(args)
    if not isinstance(mod, types.ModuleType) or not callable(getattr(mod, name, None)) \
            or (mod.__name__.split(".")[0] in _FRAMEWORKS and (mod.__name__, name) not in _SAVES):
        return
    key = ("module", id(mod))
    s = found.setdefault(key, src)
    s.calls_only, s.methods = True, tuple(dict.fromkeys(s.methods + (name,)))


@dataclass(eq=False)
class CallEffect:
    """``source.method(*args, **kwargs)`` redone after each replay."""
    source: object   # pyvalues.Source: the object, read at each replay
    method: str
    spec: object     # pytree spec of (args, kwargs)
    leaves: list     # ("const", v) | ("out", SourceEffect): a graph output (tensor or read) |
    #                  ("group", (param group, key)): read when redone | ("number", expr): a number
    #                  of the call's | ("fmt", [str | SourceEffect | NumberHole]): a string (formats.py)
    where: str

    def run(self, outs, number) -> None:
        """Redo the call with this replay's graph ``outs``; ``number(expr)``: a number of the call's."""
        vals = [outs[e.index] if kind == "out" else e if kind == "const" else number(e) if kind == "number" else
                e[0][e[1]] if kind == "group" else render(e, outs, number) for kind, e in self.leaves]
        a, kw = pytree.tree_unflatten(vals, self.spec)
        getattr(self.source.read(()), self.method)(*a, **kw)


@dataclass
class _Record:
    source: object
    method: str
    args: tuple
    kwargs: dict
    where: str
    heavy: bool   # it added to the graph or stepped a scheduler
    numbers: bool = False   # a tracked number was formatted into its text (redone only if rebuilt)
    printed: tuple = ()   # (start, end) in ReadLog.printed: read values the library formatted
    made: tuple = ()      # (start, end) in ReadLog.reads: values it read itself (``v.item()``)
    lines: frozenset = frozenset()   # ``file:line`` of the lines the call spans (callframes.call_lines)
    percent: dict = field(default_factory=dict)   # leaf index -> its '...' % values text rebuilt (percent.py)
    marks: list = field(default_factory=list)     # the UseLog.pending entries of those conversions
    formats: int = 0   # ReadLog.formats made before the call (a text built earlier: formats.earlier)
    literal: frozenset = frozenset()   # leaf indices its source passes as string literals (percent.py)
    plain: frozenset = frozenset()     # ... or as names, attributes: none formatted on its line
    target: tuple = (None, None)       # (frame, offset) of the call: a number's text is rebuilt only here
    writes: bool = False   # heavy by a tensor op writing in place (``timm.utils.dispatch_clip_grad``)


@dataclass
class CallLog:
    records: list = field(default_factory=list)


def call_sources(guards, args) -> list:
    """Library objects the step's own code calls as statements (pyvalues: ``methods``)."""
    return [s for s in guards.py.sources if s.methods and s.from_step and s.kind != "arg"]


def _kind(v, tracer) -> str | None:
    """What a redone call gets for the argument ``v``: "number" (a number of the call's, computed
    again), "tensor" (a graph output), "read" (a value read on the host), "const"; None when no
    replay can hand it back (a string is "const" here: collect_calls rebuilds formatted ones)."""
    if type(v) in _PROXIES:   # (asked of the type: a proxy records what is asked of it)
        return None if any(x.kind == "read" for x in roots_of(v._e)) else "number"
    if isinstance(v, torch.Tensor):
        return "tensor" if _is_traced(v) else None
    if isinstance(v, float) and current(v, tracer):
        return "read"
    return "const" if type(v) in _CONSTANTS or isinstance(v, os.PathLike) else None


def _plain_leaf(v):
    from .hostscalar import HostFloat, _plain
    return v._v if type(v) in _PROXIES else _plain(v) if isinstance(v, HostFloat) else v


def _tensor_ops_after(last, graph) -> str | None:
    """Did the graph get a tensor op after node ``last``: "write" (one writes in place), "op",
    or None? (Arithmetic on read values, a library meter's ``self.sum += val * n``, adds Python
    nodes only: a side effect a replay redoes.)"""
    n, found = last.next, None
    while n is not graph._root:
        if n.op == "call_function" and isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
                and n.target is not _READ:   # (``v.item()`` inside: redone on the replay's output)
            if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
                return "write"
            found = "op"
        n = n.next
    return found


_READ = torch.ops.aten._local_scalar_dense.default


def _plain_attributes(obj) -> None:
    """Values read on the host that a redone call stored in its object (a meter's ``val``,
    ``sum``): plain floats, as eager leaves them (and no graph node kept alive)."""
    from .hostscalar import HostFloat, _plain
    d = getattr(obj, "__dict__", None)
    for k, v in list((d or {}).items()):
        if isinstance(v, HostFloat):
            d[k] = _plain(v)


@contextlib.contextmanager
def recording(sources, log: CallLog, tracer, sched_steps: list, reads=None):
    """Wrap each method these objects are called with, on the instance, for the trace."""
    from ..errors import user_frame
    installed = []

    def wrap(s, obj, name, had):
        orig = getattr(obj, name)

        def call(*a, **kw):
            if obj is builtins and not _from_user_code():
                return orig(*a, **kw)   # (a library's own print: not the step's, not redone)
            # (a method of the class is looked up now: sinks.py patches Logger.info after this
            # wrapper was made, and must see the call to know its text is only printed)
            fn = orig if had else getattr(type(obj), name).__get__(obj, type(obj))
            last, k0 = tracer.graph._root.prev, len(sched_steps)
            p0 = len(reads.printed) if reads is not None else 0
            q0 = len(reads.reads) if reads is not None else 0
            leaves, spec = pytree.tree_flatten((a, kw))
            if all(_kind(v, tracer) is not None for v in leaves):
                # A call redone at each replay gets plain values, as eager's: what it keeps (a
                # list of logged dicts) holds no tracing float.
                pa, pkw = pytree.tree_unflatten([_plain_leaf(v) for v in leaves], spec)
            else:
                pa, pkw = a, kw
            numbers, lines, f0 = _formats_numbers(), _call_lines(), len(reads.formats) if reads is not None else 0
            percent = percent_texts(leaves, reads, tracer, (a, kw), lines)
            out = fn(*pa, **pkw)
            ops = _tensor_ops_after(last, tracer.graph)
            heavy = len(sched_steps) != k0 or ops is not None
            p1 = len(reads.printed) if reads is not None else 0
            q1 = len(reads.reads) if reads is not None else 0
            log.records.append(_Record(s, name, a, kw, user_frame(), heavy, numbers, (p0, p1), (q0, q1), lines,
                                       formats=f0, writes=ops == "write", **percent))
            return out
        call.__wrapped__ = orig
        return call

    done = set()
    try:
        for s in sources:
            obj = s.read_or(())
            if obj is None:
                continue
            for name in s.methods:
                if (id(obj), name) in done:
                    continue   # (one object reached by two paths: wrapped once)
                done.add((id(obj), name))
                had, old = name in vars(obj), vars(obj).get(name)   # (a module's function: had)
                try:
                    setattr(obj, name, wrap(s, obj, name, had))
                except (AttributeError, TypeError):
                    continue   # (an object that refuses it: its calls run at capture only, as before)
                installed.append((obj, name, had, old))
        yield log
    finally:
        for obj, name, had, old in reversed(installed):
            if had:
                setattr(obj, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)


def collect_calls(log: CallLog, graph_outs: list, tracer, reg, reads, problems: list):
    """After the step ran (inside the trace): the calls a replay redoes, and notes on those it
    cannot (their site, for the warning). What a redone call formats inside (tqdm's
    ``set_postfix(loss=x)`` does str(x)) is no print that runs only at capture: dropped from
    ``reads.printed``; a string formatted on the call's line before it is (``set_description(
    f"{loss.item()}")``): that call is not redone, its string would be stale."""
    from .pyeffects import SourceEffect
    effects, skipped = [], []
    printed = reads.printed if reads is not None else []
    inside = {i for r in log.records for i in range(*r.printed)}
    formats = [f for f in (reads.formats if reads is not None else ()) if f.index not in inside]
    printed_lines = {line_of(p) for i, p in enumerate(printed) if i not in inside}
    redone, made, taken = set(), set(), set()
    # A param-group entry passed as is (``lr=optimizer.param_groups[0]["lr"]``) is read again
    # when the call is redone: a scheduler stepped in the step (redone first) changes it.
    entries = {id(v): (g, k) for _, opt in reg.optimizers for g in opt.param_groups
               for k, v in g.items() if isinstance(v, float)}
    for r in log.records:
        if r.heavy and r.source.read_or(()) is builtins:
            skipped.append(r)   # (a print that computed on tensors: printed at capture only, warned)
            continue
        if r.heavy and r.writes and isinstance(r.source.read_or(()), types.ModuleType):
            continue   # (a library function updating tensors in place -- timm's clip_grad: the graph's own work)
        if r.heavy:
            problems.append(Problem(
                f"the step calls {r.source.describe()}.{r.method}(), a library method that computes "
                "on tensors or steps a scheduler of an object stepgraph does not track", r.where,
                f"call {r.source.describe()}.{r.method}() outside the step, or keep the object in "
                "an attribute of a module (its tensors are then the step's state)", plain=True))
            continue
        leaves, spec = pytree.tree_flatten((r.args, r.kwargs))
        lines = r.lines or {line_of(r.where)}
        mine = [f for f in formats if f.line in lines   # (formatted on its lines; a number's, for this call)
                and (f.pending is None or (f.pending[0] is r.target[0] and f.pending[1] == r.target[1]))]
        out, pending, numbered, took = [], [], False, []
        earlier = [f for f in (reads.formats[:r.formats] if reads is not None else ())
                   if f.index is not None and f.index not in inside and f.line not in lines and id(f) not in taken]
        for k, v in enumerate(leaves):
            if k in r.percent:   # (what it formatted with str(), ``'%s' % x``, is in it)
                _, mine = template(v, mine) if mine else (v, mine)
                out.append(("fmt", r.percent[k]))
                numbered |= any(isinstance(x, NumberHole) for x in r.percent[k])
                continue
            if type(v) is str and mine and k not in r.plain:
                v, mine = template(v, mine)
                if isinstance(v, list):
                    out.append(("fmt", [x if isinstance(x, str) else hole(x) for x in v]))
                    numbered |= any(isinstance(x, NumberHole) for x in out[-1][1])
                    continue
            if type(v) is str and reads is not None and reads.reads and k not in r.literal \
                    and (hit := earlier_text(v, earlier, reads)):
                if hit[0] is None:
                    out = None   # (a read's text made before the call, not rebuilt: it would be stale)
                    break
                out.append(("fmt", [x if isinstance(x, str) else hole(x) for x in hit[0]]))
                took += hit[1]
                continue
            if type(v) is str and reads is not None and reads.reads and _percent_formatted(v, r.where):
                out = None   # ('%6f' % loss.item(): C reads the float, past every hook -- stale)
                break
            if (slot := nextlr.slot(v)) is not None:   # (the lr a scheduler stepped here set: read when redone)
                out.append(("group", slot))
                continue
            kind = _kind(v, tracer)
            if kind is None:
                out = None
                break
            if kind == "number":   # (``epoch``: computed again from the call, tracked.py)
                out.append(("number", v._e))
            elif kind == "tensor":   # (a graph output only if the call is kept: pending)
                pending.append(v)
                out.append(("out", SourceEffect(None, "tensor", len(graph_outs) + len(pending) - 1)))
            elif kind == "read":
                out.append(("out", SourceEffect(None, "read", node=v.node)))
            elif isinstance(v, float) and id(v) in entries:
                out.append(("group", entries[id(v)]))
            else:
                out.append(("const", v))
        used = {f.index for f in formats if f.line in lines and f.index is not None} - {f.index for f in mine}
        # (a number formatted into its text some way not rebuilt: it would print the capture's)
        if out is None or mine or lines & printed_lines and not used or r.numbers and not numbered:
            skipped.append(r)   # (a formatted read: outputs.read_side_effects warns)
            continue
        # (its tensors become graph outputs now: appended for a call then dropped, they shifted
        # every output after them -- a checkpoint call given a Path bound a weight as its own grad)
        graph_outs.extend(pending)
        for kind, e in out:   # (a number in a text rebuilt at each replay: no value the graph depends on)
            for x in e if kind == "fmt" else ():
                if isinstance(x, NumberHole) and x.pending is not None:
                    x.pending[5] = True
        for p in r.marks:   # (``'%d' % i``: converted for a text rebuilt at each replay)
            p[5] = True
        effects.append(CallEffect(r.source, r.method, spec, out, r.where))
        _plain_attributes(r.source.read_or(()))
        made.update(range(*r.made))
        redone.update(range(*r.printed))
        redone.update(used)
        redone.update(f.index for f in took)
        taken.update(id(f) for f in took)
    for r in log.records:   # (their arguments hold this call's read values: not "stored" ones)
        r.args, r.kwargs = (), {}
    printed[:] = [p for i, p in enumerate(printed) if i not in redone]
    if made:   # (what a redone call read and kept is read again by the call: no stored read)
        reads.reads[:] = [f for i, f in enumerate(reads.reads) if i not in made]
    notes = [f"calls {r.source.describe()}.{r.method}() at {r.where} with values a replay cannot "
             "recompute (an object, or a string formatted from a read value): that call runs only "
             "at capture" for r in skipped if r.where.split(" (")[0] not in printed_lines]
    return effects, list(dict.fromkeys(notes))


def reads_of(effects) -> list:
    return [e for c in effects for kind, e in c.leaves if kind == "out" and e.kind == "read"] + \
        [x for c in effects for kind, e in c.leaves if kind == "fmt" for x in e if not isinstance(x, str) and x.kind == "read"]


def tensors_of(effects) -> int:
    return sum(1 for c in effects for kind, e in c.leaves if kind == "out" and e.kind == "tensor")



def warn_notes(notes, step_name: str) -> list:
    import logging
    import warnings
    for n in notes:
        msg = f"stepgraph: {step_name}: {n}"
        warnings.warn(msg, stacklevel=5)
        logging.getLogger("stepgraph").warning(msg)
    return list(notes)
