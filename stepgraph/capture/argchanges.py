"""Python containers and objects the step changes through its arguments.

``def step(batch, stats): ... stats["step"] += 1`` or ``history.append(loss.item())`` with
``history`` passed in, or ``meter.update(loss.item())`` on a meter passed in: the trace runs the
step on the arguments as pytree rebuilt them (a dict or list argument is a *copy*), and a replay
runs no Python. The capturing call's change went to the copy, and replays made none: the user's
dict, list or meter silently stopped changing (a step counter in a dict left the lr schedule
frozen). State the step's own variables reach (globals, closure cells) is replayed by
trackplan/pyeffects. Through arguments, only an attribute of an object passed positionally that
the step advances by what a replay recomputes (``train_state.step += 1``: :func:`replayed`, the
same NumberEffect / SourceEffect, found by path in each call's arguments). Any other change is
found after the trace, set on the user's own container (so the capturing call leaves what eager
leaves, and an undone capture puts it back), and refused with the fix the user can apply.
"""
from __future__ import annotations

import collections.abc
import types
from dataclasses import dataclass, field

import torch

from ..errors import library_file
from .effects import Problem
from .trackplan import plain_object, slot_of

_GONE = object()


@dataclass
class ArgWatch:
    """What the call's arguments held when the trace began: each dict/list the trace rebuilt
    (with the user's own at the same place), each batch object argtree rebuilt as a copy, and
    each plain object passed in, shallow."""
    containers: list = field(default_factory=list)   # (path, trace's copy, user's, contents then)
    copies: list = field(default_factory=list)       # (trace's copy, user's object, its attributes then)
    objects: list = field(default_factory=list)      # (path, object, its attributes then)


def _contents(c):
    return dict(c) if isinstance(c, dict) else list(c)


def watch(trace_args, user_args) -> ArgWatch:
    """``trace_args``/``user_args``: ``(args tuple, kwargs dict)`` of the trace and of the call."""
    w = ArgWatch()

    def walk(t, u, path):
        if type(t) in (dict, list) and type(u) is type(t):
            if t is not u:
                w.containers.append((path, t, u, _contents(t)))
            keys = list(t) if isinstance(t, dict) else range(len(t))
            for k in keys:
                if (k in u) if isinstance(u, dict) else k < len(u):
                    walk(t[k], u[k], path + (k,))
        elif type(t) is tuple and type(u) is tuple:
            for k, (x, y) in enumerate(zip(t, u)):
                walk(x, y, path + (k,))
        elif type(t) is type(u) and issubclass(type(t), collections.abc.Mapping) and t is not u \
                and type(getattr(t, "__dict__", {}).get("data")) is dict and type(getattr(u, "__dict__", {}).get("data")) is dict:
            walk(t.data, u.data, path)   # (a BatchEncoding / UserDict, opened as a copy: its dict is a batch dict's)
        else:
            if t is not u and type(t) is type(u) and not isinstance(t, collections.abc.Mapping) \
                    and isinstance(getattr(t, "__dict__", None), dict):
                w.copies.append((t, u, dict(vars(t))))   # (an object argtree opened: rebuilt as a copy)
            if plain_object(t) and _users(t):
                w.objects.append((path, t, dict(vars(t))))
    walk((tuple(trace_args[0]), trace_args[1]), (tuple(user_args[0]), user_args[1]), ())
    return w


def write_back(w: ArgWatch, keep=None) -> None:
    """The step ran on copies of the call's batch objects: what it rebound on a copy
    (``train_state.step += 1`` on the Annotated Transformer's TrainState, which holds a tensor
    and so is opened like a batch) is set on the user's object, as eager left it. Runs even when
    the step raised. (Replays write the numbers again through their sources,
    trackplan.NumberEffect; what no replay writes is refused by :func:`check`.) ``keep(obj)``:
    before it changes (the undo of a failed capture)."""
    from .tracked import plain
    for new, base, was in w.copies:
        changed = {k: plain(v) for k, v in vars(new).items() if was.get(k, _GONE) is not v}
        if changed:
            if keep is not None:
                keep(base)
            vars(base).update(changed)


def replayed(w: ArgWatch, trace_args, names, graph_outs: list, number_effects: list, const_stores=frozenset()) -> list:
    """After the step (inside the trace): an attribute of an object passed in positionally that
    the step set to a value a replay recomputes is written again after each replay, on the
    call's own object, found by its path from the arguments (a new TrainState each epoch is
    written, not the captured one). As for the step's own variables (trackplan.swap_out,
    pyeffects.collect): tracked arithmetic (``train_state.step += 1``, ``samples += x.shape[0]``:
    a NumberEffect), a literal of the step's code (``accum_step = 0``), a tensor the graph
    computes or a float it reads (``tokens += batch.ntokens`` from an int: a SourceEffect; a
    tensor already there is added to in place, an input the graph writes). Appends the number
    effects to ``number_effects``; returns the source effects (their tensors joined
    ``graph_outs``). Anything else is left to :func:`check`."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    from .numchecks import Root
    from .hostscalar import _plain
    from .pyeffects import _effect, _graph_kind
    from .pyvalues import Source
    from .tracked import _PROXIES
    from .trackplan import NumberEffect
    tracer = get_proxy_mode().tracer
    done = {slot_of(e.source, trace_args) for e in number_effects if e.source is not None}
    bases = {id(c): b for c, b, _ in w.copies}
    out = []
    for path, obj, then in w.objects:
        if len(path) < 2 or path[0] != 0:
            continue   # (a keyword argument: the replay's writes find objects by position)
        for k, v in list(vars(obj).items()):
            if then.get(k, _GONE) is v or (id(obj), k) in done:
                continue
            i = path[1]
            src = Source("arg", i, names[i] if i < len(names) else f"argument #{i}",
                         tuple(("item", x) for x in path[2:]) + (("attr", k),))
            kind = _graph_kind(v, tracer)
            if type(v) in _PROXIES and getattr(v, "_e", None) is not None:
                number_effects.append(NumberEffect(Root("source", src, src.describe()), None, v._e))
            elif type(v) in (int, float) and (k, v) in const_stores:
                number_effects.append(NumberEffect(Root("source", src, src.describe()), None, v))
            elif kind is not None:
                out.append(_effect(src, v, kind, graph_outs))
                if kind == "read":   # (eager leaves a plain float, on the user's object too)
                    for o in (obj, bases.get(id(obj))):
                        if o is not None:
                            vars(o)[k] = _plain(v)
    return out


def _users(obj) -> bool:
    """An object of the user's own classes (or a SimpleNamespace). A library's (an LR scheduler
    stepped in the step, a progress bar) is stepgraph's to redo (LR schedulers, pycalls.py) or
    libstate.py's to refuse, by name."""
    import sys
    if type(obj) is types.SimpleNamespace:
        return True
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return False   # (stepped in the step: redone after each replay, trace.py's scheduler_steps)
    f = getattr(sys.modules.get(type(obj).__module__), "__file__", None)
    return f is None or not library_file(f)


def _batch(contents) -> bool:
    """Only tensors in it: a batch, not a record of counters or results."""
    values = contents.values() if isinstance(contents, dict) else contents
    return all(isinstance(v, torch.Tensor) for v in values)


def _warn(msg: str, where: str) -> None:
    import logging
    import warnings
    text = f"stepgraph: {msg} (at {where})"
    warnings.warn(text, stacklevel=2)
    logging.getLogger("stepgraph").warning(text)


def _name(path) -> str:
    """``(0, i, ...)``: positional argument i; ``(1, name, ...)``: keyword argument ``name``."""
    if len(path) < 2:
        return "its arguments"
    head = f"argument #{path[1]}" if path[0] == 0 else f"argument {path[1]!r}"
    return head + "".join(f"[{k!r}]" for k in path[2:])


def check(w: ArgWatch, covered_sources, trace_args, problems: list, where: str, keep=None) -> None:
    """After the step (inside the trace): a rebuilt container that changed is set on the user's
    (``keep(container, contents)`` first: the undo's record) and refused; so is an attribute of
    an object passed in that changed, unless a replay writes it (``covered_sources``: the
    Sources of number and source effects)."""
    from .tracked import plain
    covered = {slot_of(s, trace_args) for s in covered_sources}
    for path, t, u, then in w.containers:
        now = _contents(t)
        same = len(now) == len(then) and (all(a is b for a, b in zip(now, then)) if isinstance(now, list)
                                          else all(k in then and then[k] is v for k, v in now.items()))
        if same:
            continue
        if keep is not None:
            keep(u, _contents(u))
        if isinstance(u, list):
            u[:] = [plain(x) for x in now]
        else:
            u.clear()
            u.update({k: plain(v) for k, v in now.items()})
        if _batch(then) and _batch(now):
            # (a batch dict the step edits before its forward -- ``ids = batch.pop("id")``,
            # ``batch["labels"] = ...``: the loader's fresh dict, which the loop does not read
            # again. Refusing that would refuse a common harmless step; said once instead.)
            _warn(f"the step changes {_name(path)}, a {type(u).__name__} of tensors passed to it: "
                  "replays do not change it (the loop's own dict keeps what it held); build a new "
                  "one in the step if the loop reads it afterwards", where)
            return
        problems.append(Problem(
            f"the step changes {_name(path)}, a {type(u).__name__} passed to it (its "
            f"{'length ' + str(len(then)) + ' -> ' + str(len(now)) if len(now) != len(then) else 'items'}): "
            "a replay runs no Python code, so it would not change it again", where,
            "keep that value in a variable the step reads instead of passing it in (a global, a "
            "closure variable or an attribute: replays update those), or return it from the step",
            plain=True))
        return
    for path, obj, then in w.objects:
        now = vars(obj)
        changed = [k for k in list(now) + [k for k in then if k not in now]
                   if then.get(k, _GONE) is not now.get(k, _GONE) and (id(obj), k) not in covered]
        if changed:
            problems.append(Problem(
                f"the step changes {_name(path)}.{changed[0]}, an attribute of a "
                f"{type(obj).__name__} passed to it: a replay runs no Python code, so it would not "
                "change it again", where,
                f"keep the {type(obj).__name__} in a variable the step reads instead of passing it "
                "in (a global, a closure variable or an attribute: replays update those), or return "
                "the value from the step", plain=True))
            return
