"""Buffers and optimizer state the step rebinds (DINO's ``self.center = self.center * m + c * (1 -
m)``, a custom BatchNorm's ``self.running_mean = ...``, an optimizer's ``state['m'] = beta *
state['m'] + g`` or timm LaProp's ``state['exp_avg_lr_2'] = state['exp_avg_lr_2'] * beta2 + ...``):
written into the old tensor in place by the graph.

As a rebinding, each replay would bind a new tensor while the graph kept reading the old one,
its constant (a stale center), and the step's own code, reading ``self.center``, keyed it by
identity: a capture per call. Instead the graph ends with ``old.copy_(new)``, and after the
trace the buffer is bound back to its old tensor holding the new values: one graph, the buffer
always current, the same values as eager (only its identity stays, unlike eager's new tensor).
"""
from __future__ import annotations

import collections

import torch

from .rollback import before_write


class SlotTarget:
    """An optimizer state entry the step sets to a float its graph computes (timm LaProp's
    ``state['exp_avg_lr_1'] = state['exp_avg_lr_1'] * beta1 + (1 - beta1) * group['lr']``, the
    lr read live): a pyeffects.SourceEffect's target, written as a plain float after each replay.
    Before, the capture's value was written back at every replay."""

    def __init__(self, slot):
        self.slot = slot

    def write(self, value, args) -> None:
        self.slot.set(float(value))

    def describe(self) -> str:
        return self.slot.source


def float_effect(slot, new, tracer):
    """The effect writing ``new`` into ``slot`` after each replay when it is a float the graph
    computes (hostscalar.current), else None."""
    from .hostscalar import current
    from .pyeffects import SourceEffect
    if slot.kind in ("optstate", "group") and isinstance(new, float) and current(new, tracer):
        return SourceEffect(SlotTarget(slot), "read", node=new.node)
    return None


def rebind_in_place(gm: torch.fx.GraphModule, escapes: list, olds: list, first: int, state=()) -> tuple[list, list]:
    """For each buffer or optimizer state entry ``escapes[i]`` (its tensor before the step ``olds[i]``, its new value the
    graph's output ``first + i``) of the same shape, dtype, device and strides: the graph copies
    the new value into the old tensor instead of returning it, and the buffer is bound back to the
    old tensor, now holding the new values. Returns the escapes still rebound after each replay and,
    for those, ``(slot, tensor before)``: what stale_read_checks looks for in the graph."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    consts = {id(getattr(gm, n.target, None)): n for n in gm.graph.nodes if n.op == "get_attr"}
    # (a new value sharing memory with state -- ``state['prev'] = p.detach()`` -- is an alias in
    # eager, which a copy is not: left rebound, checked by stale_read_checks)
    shared = {_storage(getattr(gm, n.target, None)) for n in gm.graph.nodes if n.op == "get_attr"} - {None}
    # (an old tensor sharing memory with other state -- SAM's ``p.data = state[p]['old_p']`` at the
    # previous step, then ``state[p]['old_p'] = p.data.clone()`` -- is that state too: a copy into
    # it wrote the parameter. ``state``: the step's state tensors before it ran)
    owners = collections.Counter(_storage(t) for t in state)
    kept, kept_olds, drop = [], [], set()
    for i, (s, old) in enumerate(zip(escapes, olds)):
        new = s.get()
        if not (s.kind in ("buffer", "optstate") and isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
                and type(old) is torch.Tensor and not old.requires_grad
                and new.untyped_storage().data_ptr() not in shared and owners[_storage(old)] <= 1
                and (old.shape, old.dtype, old.device, old.stride()) == (new.shape, new.dtype, new.device, new.stride())):
            kept.append(s)
            if s.kind != "grad" and isinstance(old, torch.Tensor):   # (a grad before is a graph input)
                kept_olds.append((s, old))
            continue
        with gm.graph.inserting_before(out):
            ref = consts.get(id(old))
            if ref is None:
                name = f"_sg_rebound_{len(consts)}"
                setattr(gm, name, old)
                ref = consts[id(old)] = gm.graph.get_attr(name)
            gm.graph.call_function(torch.ops.aten.copy_.default, (ref, outs[first + i]))
        drop.add(first + i)
        before_write(old)   # (undone with the rest if the capture fails after this)
        with torch.no_grad():
            old.copy_(new)
        s.set(old)
    if drop:
        out.args = ([o for k, o in enumerate(outs) if k not in drop],)
        gm.recompile()
    return kept, kept_olds


def _storage(t):
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
        try:
            return t.untyped_storage().data_ptr()
        except RuntimeError:   # (a DTensor, FSDP2's freed unsharded storage: no data pointer)
            return None
    return None


class _HoldsCaptured:
    """``slot.get() is old`` as a check's function (numchecks.Op): the tensor a graph reads as its
    constant is still the one bound there."""
    __name__ = "same tensor as captured"

    def __init__(self, old):
        self.old = old   # (the graph holds it too, as its constant)

    def __call__(self, now) -> bool:
        return now is self.old


def state_objects(reg):
    """``(optimizer name, key, object)`` of each Python object (not a tensor, a number or a
    container) an optimizer keeps in its per-parameter state: GaLore's ``state['projector']``."""
    for oname, opt in reg.optimizers:
        for st in list(opt.state.values()):
            for k, v in (list(st.items()) if isinstance(st, dict) else ()):
                if not isinstance(v, (torch.Tensor, type)) and isinstance(getattr(v, "__dict__", None), dict):
                    yield oname, k, v


def object_tensors(reg) -> list:
    """``(slot, tensor)`` of each tensor attribute of a Python object an optimizer keeps in its
    per-parameter state (pytorch_optimizer GaLore's ``state['projector']``, whose ``ortho_matrix``
    it rebinds every ``update_proj_gap`` steps): no slot of stepgraph's names it, so a graph read
    the captured matrix after the projector had made a new one -- silently wrong. With
    stale_read_checks, a rebinding captures again."""
    from .state import Slot
    return [(Slot("optstate", f"{oname}.state[...]['{k}'].{a}", vars(v), a), t)
            for oname, k, v in state_objects(reg) for a, t in list(vars(v).items()) if isinstance(t, torch.Tensor)]


class _ListItem:
    """``state[k][i]`` of an optimizer's per-parameter state, read at each check (the list itself
    is what the optimizer rebinds: pytorch_optimizer SOAP's ``state['Q']``)."""
    kind = "optstate"

    def __init__(self, owner, key, i, source):
        self.owner, self.key, self.i, self.source = owner, key, i, source

    def get(self):
        v = self.owner.get(self.key)
        return v[self.i] if isinstance(v, (list, tuple)) and len(v) > self.i else None


def list_tensors(reg) -> list:
    """``(slot, tensor)`` of each tensor in a list an optimizer keeps in its per-parameter state
    (SOAP's eigenbases ``state['Q']``, a new list at each preconditioning step): a graph read the
    old ones as constants, and after a call that rebound the list (refused, eager), replays of
    an older graph used them, silently (helper-93). With stale_read_checks, it captures again."""
    return [(_ListItem(st, k, i, f"{oname}.state[...]['{k}'][{i}]"), t)
            for oname, opt in reg.optimizers for st in list(opt.state.values()) if isinstance(st, dict)
            for k, v in list(st.items()) if isinstance(v, (list, tuple))
            for i, t in enumerate(v) if isinstance(t, torch.Tensor)]


def stale_read_checks(gm: torch.fx.GraphModule, kept_olds: list) -> list:
    """A buffer or state entry the step rebinds to a tensor of another shape, dtype or layout
    (an optimizer's history ``state['h'] = torch.cat([state['h'], g])[-3:]`` while it grows),
    whose old tensor the graph reads as a constant: after a replay binds the new one there, that
    graph would read the stale one. A check that the slot still holds the tensor the graph reads:
    the next call captures again, once the rebinding keeps its shape it is done in place."""
    from .numchecks import Check, Op, Root
    read = {id(getattr(gm, n.target, None)) for n in gm.graph.nodes if n.op == "get_attr"}
    return [Check(Op(_HoldsCaptured(old), (Root("slot", (s, s.key), s.source),)), True,
                  decided=True)
            for s, old in kept_olds if id(old) in read]
