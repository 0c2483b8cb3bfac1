"""Which Python numbers a capture tracks (tracked.py) instead of keying the cache by them.

A number is tracked when the trace can stand a proxy in its place and put the value back:
an int/float argument leaf; a number the step's own code loads from a global, a closure cell,
a dict item or a plain instance/class attribute (``state['num_updates']``, ``args.clip``); and
the numeric attributes of a **record** -- a plain object (an ``AverageMeter`` made anew each
epoch) whose attributes are numbers, strings, bools, None and enums only. The cache key keeps
the place ("a number") and, for a record, its class, attribute names and non-numeric values;
the numbers are checked per graph, only where that graph used them. An object holding
tensors keeps its identity guard: the graph may read or write them in place (a meter's
``sum += acc`` on a tensor), so another object needs another graph. Anything else keeps
its guard (by value, or by identity).
"""
from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from .hostscalar import HostFloat, _tracer, current
from .numchecks import Root
from .pyvalues import _MISSING, item
from . import nextlr, schedules
from .schedules import schedule_array
from .tracked import _PROXIES

_VALUES = (str, bytes, bool, type(None), enum.Enum)
_MAX_ATTRS = 64


def number(v) -> bool:
    """A plain int/float (not bool, not an IntEnum or numpy scalar), or one stepgraph made."""
    t = type(v)
    return t is int or t is float or t in _PROXIES or issubclass(t, HostFloat)


def plain_object(v) -> bool:
    t = type(v)   # (a SimpleNamespace: its C attribute methods read and write its __dict__)
    return t is types.SimpleNamespace or (t.__module__ != "builtins" and isinstance(getattr(v, "__dict__", None), dict)
            and t.__getattribute__ is object.__getattribute__ and t.__setattr__ is object.__setattr__
            and getattr(t, "__getattr__", None) is None
            and not isinstance(v, (nn.Module, torch.optim.Optimizer, torch.Tensor, type)))


def record_key(v):
    """The key of a record (None when ``v`` is not one): class, attribute names, the
    non-numeric values, and for a tensor attribute its metadata: a graph reads such a tensor
    as an input and writes a rebound one back, both found by path at each call (pyeffects.py),
    so a meter made anew each epoch (``top1.sum += acc1[0] * n``) is no new graph."""
    if not plain_object(v) or len(vars(v)) > _MAX_ATTRS or _resource(type(v)):
        return None
    out, storages = [], set()
    for k, x in vars(v).items():
        if number(x):
            out.append((k, "number"))   # (its type too is checked where used: tracked._class)
        elif isinstance(x, _VALUES):
            out.append((k, type(x), x))
        elif record_tensor(x):
            ptr = x.untyped_storage().data_ptr()   # (two sharing memory: inputs a graph would copy apart)
            if ptr in storages:
                return None
            storages.add(ptr)
            out.append((k, "tensor", x.dtype, x.device, tuple(x.shape), x.stride()))
        else:
            return None
    return ("record", type(v), tuple(out))


def _resource(t) -> bool:
    """A class with a lifecycle (a progress bar) is no record of values: accelerate's ``tqdm(disable=
    not is_main_process)`` holds six numbers on other ranks; its set_postfix is a call redone."""
    return getattr(t, "__exit__", None) is not None or getattr(t, "__del__", None) is not None


def record_tensor(x) -> bool:
    """A tensor a record may hold: no autograd, not a Parameter, not a view of one (the step's
    own results: ``top1.val = acc1[0]``)."""
    return (type(x) is torch.Tensor and not x.requires_grad
            and (x._base is None or type(x._base) is torch.Tensor and not x._base.requires_grad))


def record_parts(s, v) -> list:
    """One Source per attribute of the record ``v`` that ``s`` reads (pyeffects.py)."""
    from .pyvalues import Source
    out = []
    for k in vars(v):
        sub = Source(s.kind, s.root, s.name, s.path + (("attr", k),), s.where)
        sub.record = s
        out.append(sub)
    return out


def _parent(s, args):
    v = s._root_value(args)
    for kind, k in s.path[:-1]:
        v = getattr(v, k) if kind == "attr" else item(v, k)
    return v


def writable(s, args) -> bool:
    """The trace can put a proxy where the step's code reads ``s`` (and put it back)."""
    if not s.path:
        return s.kind in ("global", "cell")
    try:
        parent = _parent(s, args)
    except Exception:  # noqa: BLE001
        return False
    kind, k = s.path[-1]
    if kind == "item":   # (a list slot too: ``it[0] += 1``, the counter in a closure's one-element list)
        return type(parent) is dict or (type(parent) is list and type(k) is int and -len(parent) <= k < len(parent))
    if isinstance(parent, type):
        return k in parent.__dict__ and type(parent).__setattr__ is type.__setattr__
    # (a module's plain attribute, ``self.model.num_updates``: in its __dict__, no __setattr__)
    # (an optimizer's own, ``self.t += 1`` in its step: state.StateRegistry.number_slots too)
    return (plain_object(parent) or isinstance(parent, (nn.Module, torch.optim.Optimizer))) and k in vars(parent)


def slot_of(s, args):
    """Where ``s`` is bound: (id of its container, name); None when it cannot be reached."""
    if not s.path:
        return (id(s.root), s.name)
    try:
        return (id(_parent(s, args)), s.path[-1][1])
    except Exception:  # noqa: BLE001
        return None


def write(s, value, args) -> None:
    if not s.path:
        s.write(value, args)
        return
    parent = _parent(s, args)
    kind, k = s.path[-1]
    if kind == "item" or not isinstance(parent, type):
        (parent if kind == "item" else vars(parent))[k] = value
    else:
        setattr(parent, k, value)


def kind_of(s, v, args, exclude) -> str | None:
    """"number", "record" or None (keyed as before) for one source and its value now;
    ``exclude``: sources read live, or baked by a graph that did not track them."""
    if not s.from_step or s.identity_only or s in exclude:
        return None
    if number(v) and writable(s, args):
        return "number"
    if record_key(v) is not None:
        return "record"
    if schedule_array(v) and writable(s, args):
        return "array"    # (its identity stays in the key: key_of)
    return None


@dataclass
class TrackPlan:
    """What one capture replaces by proxies."""
    leaves: list = field(default_factory=list)    # Root("leaf", index)
    sources: list = field(default_factory=list)   # Root("source", Source)
    records: list = field(default_factory=list)   # (Source, [Root("attr", (Source, name))])
    arrays: list = field(default_factory=list)    # Root("source", Source) of numpy schedules (schedules.py)
    const_stores: set = field(default_factory=set)  # (name, number) the step's code stores as literals
    counters: list = field(default_factory=list)  # Root("slot", (Slot, key)): optimizers' Python numbers

    def roots(self) -> list:
        return self.leaves + self.sources + [r for _, attrs in self.records for r in attrs] + self.counters


def plan(sources, leaves, leaf_labels, args, exclude, slots=()) -> TrackPlan:
    p = TrackPlan()
    # An optimizer that keeps its step count as a Python number in its per-parameter state
    # (``state['step'] += 1``: microsoft/LoRA's AdamW, transformers' Adafactor, torch's
    # SparseAdam): the count is tracked, so the arithmetic on it is read live at each replay and
    # the increment is written again after it (NumberEffect), as the optimizer's Python would.
    # A param group's int is one too (Adan's ``group['step']``, Lookahead's ``lookahead_step``:
    # keyed by value, each call recaptured).
    p.counters = [Root("slot", (s, s.key), s.source) for s in slots
                  if s.kind in ("optstate", "group") and number(s.get())]
    for i, x in enumerate(leaves):
        if number(x):
            p.leaves.append(Root("leaf", i, leaf_labels[i] if i < len(leaf_labels) else f"input {i}"))
    records: set = set()
    # A record reached by a path from the step's variables first: the ``self`` of a method it
    # calls (``meters['loss'].update``) is the object of the first call, not the one read now.
    for s in sorted(sources, key=lambda s: s.kind == "object"):
        v = s.read_or(args)
        k = kind_of(s, v, args, exclude)
        if k == "number":
            p.sources.append(Root("source", s, s.describe()))
        elif k == "array":
            p.arrays.append(Root("source", s, s.describe()))
        elif k == "record" and id(v) not in records:
            records.add(id(v))
            p.records.append((s, [Root("attr", (s, name), f"{s.describe()}.{name}")
                                  for name, x in vars(v).items() if number(x)]))
    return p


def key_of(s, v, args, exclude):
    """The cache-key part of one source, ``v`` its value now (as ``Source.value`` for the
    untracked ones; computed once: this runs on every call)."""
    if s.from_step and not s.identity_only and s not in exclude:
        if number(v) and writable(s, args):
            return _NUMBER
        rk = record_key(v)
        if rk is not None:
            return rk
    if v is _MISSING:
        return _MISSING
    return s.key_for(v)


_NUMBER = ("number",)


def swap_in(track: TrackPlan, uses, args) -> list:
    """Put a proxy where the step reads each tracked source and record attribute; returns what
    :func:`swap_out` puts back."""
    swapped = []
    try:
        for r in track.sources:
            v = r.ref.read(args)
            p = uses.wrap(v, r)
            write(r.ref, p, args)
            swapped.append((r, None, v, p))
        for r in track.arrays:   # (put back by swap_out as the numbers are: ``cur is p``)
            v = r.ref.read(args)
            p = schedules.view(v, r, uses)
            write(r.ref, p, args)
            swapped.append((r, None, v, p))
        for r in track.counters:
            slot = r.ref[0]
            v = slot.get()
            if number(v) and type(v) not in _PROXIES:
                slot.owner[slot.key] = p = uses.wrap(v, r)
                swapped.append((r, slot.owner, v, p))
        for s, attrs in track.records:
            d = vars(s.read(args))
            for r in attrs:
                v = d.get(r.ref[1])
                if number(v) and type(v) not in _PROXIES and not current(v, _tracer()):  # (not a live float)
                    d[r.ref[1]] = p = uses.wrap(v, r)
                    swapped.append((r, d, v, p))
    except BaseException:
        swap_out(swapped, args)
        raise
    return swapped


@dataclass(eq=False)
class NumberEffect:
    """A tracked number the step assigned from arithmetic on tracked numbers (``completed_steps
    += 1``): after each replay the expression is evaluated again and written where the step
    wrote it, as eager's Python would."""
    root: object          # numchecks.Root: where it is written
    container: object     # the dict of a record attribute, or None (a Source)
    expr: object          # numchecks expression over Roots and constants

    @property
    def source(self):
        """The pyvalues Source written (None for an optimizer's state entry: a state slot)."""
        if self.root.kind == "slot":
            return None
        return self.root.ref if self.container is None else self.root.ref[0]

    def value(self, leaves, args, memo):
        from .numchecks import evaluate
        return evaluate(self.expr, leaves, args, memo)

    def write(self, value, args) -> None:
        if self.container is None:
            write(self.root.ref, value, args)
        elif self.root.kind == "slot":
            self.root.ref[0].set(value)
        else:   # the record found by its path now (a meter made anew each epoch)
            src, name = self.root.ref
            vars(src.read(args))[name] = value


def swap_out(swapped: list, args, const_stores=frozenset(), untracked=None) -> list:
    """Put the values back, unless the step assigned new ones (then those stay, as plain
    numbers): what eager leaves. Runs even when the step raised. Returns the
    :class:`NumberEffect` of each number the step assigned from tracked arithmetic; ``untracked``:
    ``(root, old, new)`` of an optimizer's number set otherwise (GSAM's ``self.rho_t``)."""
    effects = []
    for r, d, v, p in reversed(swapped):
        try:
            if d is None and ((cur := r.ref.read(args)) is p or type(cur) in _PROXIES):
                write(r.ref, v if cur is p else cur._v, args)
            elif d is not None:
                cur = d.get(r.ref[1])
                if cur is p or type(cur) in _PROXIES:
                    d[r.ref[1]] = v if cur is p else cur._v
            if cur is not p and type(cur) in _PROXIES and getattr(cur, "_e", None) is not None:
                effects.append(NumberEffect(r, d, cur._e))
            elif cur is not p and type(cur) in (int, float) and (_slot_name(r, d), cur) in const_stores:
                effects.append(NumberEffect(r, d, cur))   # (a literal the step's code stores: ``pos = 0``)
            elif r.kind == "slot" and cur is not p and type(cur) not in _PROXIES and isinstance(cur, (int, float)) \
                    and untracked is not None and float(cur.real) != float(v.real):   # (no decision recorded on it)
                untracked.append((r, v, cur))
        except Exception:  # noqa: BLE001 - the step deleted or replaced the container
            pass
    return effects


def _slot_name(r, d):
    """The attribute, key or variable name a tracked number is stored under."""
    return r.ref[1] if d is not None else source_name(r.ref)


def source_name(src) -> str:
    """The attribute, key or variable name a Source's value is stored under (what
    ``PyValues.const_stores`` pairs with a literal)."""
    return src.path[-1][1] if src.path else src.name


def group_entries(reg, keep):
    """``(Source, value)`` of each param-group entry of the registry's optimizers whose value
    ``keep`` accepts (``opt.param_groups[0]['lr']``)."""
    from .pyvalues import Source
    for name, opt in reg.optimizers:
        for gi, group in enumerate(opt.param_groups):
            for k, v in list(group.items()):
                if keep(v):
                    yield Source("object", group, f"{name}.param_groups[{gi}]", (("item", k),)), v


def _same_float(v, old) -> bool:
    """``v`` is the value ``old`` held (a live float's plain copy put back after the trace, or a
    tuple of them: OneCycleLR's ``betas``)."""
    if isinstance(v, (tuple, list)) and isinstance(old, (tuple, list)):
        return len(v) == len(old) and all(_same_float(a, b) for a, b in zip(v, old))
    return type(v) is float and isinstance(old, float) and float.__float__(old) == v


def hyper_effects(reg, assigned=(), scheduled=(), const_stores=frozenset(), args=()) -> list:
    """Put back the live values the trace put in (``assigned``: ``(group, key, old value, live
    value)``; for a Source, the bindings.Binding it was put at as key), unless the step assigned
    new ones (a scheduler stepped inside it): those are what eager leaves. Runs even when the
    step raised.

    A param group's hyper-parameter the step assigned from tracked numbers (``g['lr'] =
    get_lr(it)``): written again after each replay (the graph itself read the number live or
    checked it), left plain now. One the step replaced by a constant of this graph (DINO's
    ``g['lr'] = lr_schedule[it]``, a numpy float picked by guarded values) is written again
    after each replay too, as eager leaves it -- unless an LR scheduler stepped inside the step
    set it (``scheduled``: ``(group, key, value)``, libraries.record_scheduler_steps): the
    scheduler, run again after each replay, sets the next value itself (DLRM's
    ``lr_scheduler.step()``: the lr froze at this one). A float variable read live that the
    step set from tracked numbers (imagenet's ``end = time.time()``) or to a literal of its
    code (``total_loss = 0`` at a logging step) is written again after each replay too."""
    from .pyvalues import Source
    effects = []
    for group, k, old, live in reversed(assigned):
        if isinstance(group, Source):   # k: its bindings.Binding, where the live value was put
            if k.get() is live:
                k.set(old)   # (exactly there: a class attribute read through an instance)
            cur = group.read(args)
            if cur is live:   # (the step assigned it where it reads it now: ``h.x = h.x``)
                group.write(old, args)
            elif type(cur) in _PROXIES and getattr(cur, "_e", None) is not None:
                effects.append(NumberEffect(Root("source", group, group.describe()), None, cur._e))
                group.write(cur._v, args)
            elif type(cur) in (int, float) and (source_name(group), cur) in const_stores:
                effects.append(NumberEffect(Root("source", group, group.describe()), None, cur))
            continue
        if group.get(k) is live:
            group[k] = old
            continue
        if nextlr.restore(group, k, old):   # (set by a scheduler stepped in the step: nextlr.py)
            continue
        v = group.get(k, live)
        if type(v) in _PROXIES or issubclass(type(v), HostFloat) or isinstance(v, torch.Tensor) \
                or v is old or _same_float(v, old):   # (left as it was, or a plain copy of it)
            continue
        if any(g is group and key == k and x is v for g, key, x in scheduled):
            continue
        name = next((f"{n}.param_groups[{gi}]" for n, opt in reg.optimizers
                     for gi, g in enumerate(opt.param_groups) if g is group), "param_groups[?]")
        src = Source("object", group, name, (("item", k),))
        effects.append(NumberEffect(Root("source", src, src.describe()), None, v))
    for src, v in group_entries(reg, lambda v: type(v) in _PROXIES):
        # (an LR scheduler stepped in the step set it: the scheduler, run again after each
        # replay, sets the next value -- its lambda read a tracked module attribute, the
        # Annotated Transformer's ``rate(step, model.src_embed[0].d_model, ...)``, and this
        # effect wrote the capture's lr back over it at every replay)
        if not any(x is v for _, _, x in scheduled):
            effects.append(NumberEffect(Root("source", src, src.describe()), None, v._e))
        src.write(v._v)
    return effects


def names_slot(src, args, slots) -> bool:
    """``src`` reads a param-group entry that is live as a hyper-parameter (the step's own
    ``optimizer.param_groups[0]["lr"]``): that substitution serves both names (two would leave
    the first's stand-in in the group when the second is put back)."""
    return bool(src.path) and src.path[-1][0] == "item" and slot_of(src, args) in slots
