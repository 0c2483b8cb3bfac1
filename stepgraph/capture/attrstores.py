"""Tensors the step stores on an object's attribute: written back after each replay.

nn-zero-to-hero's layers keep their output on ``self.out`` (read after training for activation
and gradient plots, ``layer.out.retain_grad()`` in the step) and rebind their running statistics
under ``no_grad`` (``self.running_mean = 0.9 * self.running_mean + 0.1 * xmean``); a module's
forward keeps attention weights on ``self.attn``. Such an object is often reached by no path a
Source names (``for layer in layers: x = layer(x)``), so pyeffects.py never saw the attribute: a
replay left the captured call's tensor there, silently.

After the trace, every tensor the graph computed that an attribute of an nn.Module or of an
object of the user's own classes still holds is found (one ``gc.get_referrers`` pass) and
becomes a graph output, bound to that attribute after each replay (``.grad`` too, for a tensor
whose gradient the step retained). Where the graph read the attribute's previous tensor as a
constant (a running statistic rebound from itself), that tensor is kept equal to the attribute
after each replay, so the next replay reads what the last one left: it is the graph's now (the
user's old reference to it sees the new values). Module parameters, buffers and grads are slots
(state.py) and never an attribute here.
"""
from __future__ import annotations

import gc
import inspect
import re
import types
import weakref

import torch
from torch import nn

from ..errors import library_file
from . import modstate


def _users_class(cls) -> bool:
    """A class of the user's code (by where its methods are: a module exec'd from a file is in
    no ``sys.modules``, where inspect.getfile looks)."""
    code = next((v.__code__ for v in vars(cls).values() if isinstance(v, types.FunctionType)), None)
    try:
        f = code.co_filename if code is not None else inspect.getfile(cls)
    except (TypeError, OSError):
        return False
    if f.startswith("<"):
        return not f.startswith(("<frozen", "<stepgraph"))   # (a notebook's, exec'd code)
    return not library_file(f)


_KINDS = weakref.WeakKeyDictionary()   # type -> may own attributes written back (weakly: fx makes a class
#                                        per GraphModule, whose forward holds the graph's constants)


def _owner_kind(o) -> bool:
    t = type(o)
    got = _KINDS.get(t)
    if got is None:
        got = _KINDS[t] = not issubclass(t, (type, torch.Tensor, torch.autograd.function.FunctionCtx,
                                            types.ModuleType, types.FunctionType, types.MethodType)) \
            and (issubclass(t, nn.Module) or _users_class(t))
    return got   # (not a custom Function's ctx: autograd's, kept by the returned loss's graph)


def own_state_objects(reg) -> None:
    """Objects an optimizer keeps in its per-parameter state (pytorch_optimizer GaLore's
    ``state['projector']``, a library class whose ``ortho_matrix`` the step rebinds to a tensor
    it computes): their attributes are written back as a user class's are."""
    from .rebound import state_objects
    for _, _, v in state_objects(reg):
        _KINDS[type(v)] = True


_TRACER_CONSTANT = re.compile(r"_(tensor|param)_constant\d+")   # make_fx's names on its scratch module
_BEFORE: dict = {}   # (id(owner), name) -> the tensor it held when the trace began
_OWNERS: dict = {}   # id(owner) -> owner, for _BEFORE's keys (during a trace only)
_HELD: list = []     # _Synced of the last collect: taken by trace.py (take_held)


def snapshot() -> None:
    """At the start of a trace: the tensors attributes of user objects and modules hold (a
    rebound one the graph read, ``self.running_mean``, is then known: see ``collect``)."""
    _BEFORE.clear()
    _OWNERS.clear()
    for o in gc.get_objects():
        if _owner_kind(o):
            d = getattr(o, "__dict__", None)
            if isinstance(d, dict):
                for k, v in d.items():
                    if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                        _BEFORE[(id(o), k)] = v
                        _OWNERS[id(o)] = o
                if modstate.library_module(o):
                    modstate.note(o, d)   # (its lists: appended to by a library's code)


class AttrStore:
    """``owner.name = <this replay's tensor>`` (or its ``.grad``): a pyeffects.SourceEffect's
    source, written after each replay."""

    kind, path, from_step, identity_only, where = "attr", (), True, False, ""

    def __init__(self, owner, name: str, grad: bool = False, const=None):
        try:
            self._ref = weakref.ref(owner)
        except TypeError:
            self._ref = lambda owner=owner: owner
        self.name, self.grad = name, grad
        self.const = const   # the tensor the graph reads for it (its value before the step)
        self.last = None     # the tensor the last call bound there (_Synced)
        self.root = owner if not grad else self   # (trackplan.slot_of: (id(root), name))

    def describe(self) -> str:
        o = self._ref()
        return f"{type(o).__name__}.{self.name}" + (".grad" if self.grad else "")

    def read_or(self, args=(), default=None):
        o = self._ref()
        v = None if o is None else vars(o).get(self.name, default)
        return getattr(v, "grad", None) if self.grad and isinstance(v, torch.Tensor) else v

    read = read_or

    def write(self, value, args=()) -> None:
        o = self._ref()
        if o is None:
            return
        if self.grad:
            t = vars(o).get(self.name)
            if isinstance(t, torch.Tensor) and (value is None or value.shape == t.shape):
                t.grad = value
            return
        vars(o)[self.name] = self.last = value
        if self.const is not None:   # (the next replay reads what this one left, as eager)
            with torch.no_grad():
                self.const.copy_(value)


def collect(graph_outs: list, is_traced, done=()) -> list:
    """Inside the trace, after the step ran: (AttrStore, tensor) for each attribute of a user
    object or module that holds a tensor the graph computed; ``done``: ids of the tensors
    already written back by another effect."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    mode = get_proxy_mode()
    tracker = getattr(getattr(mode, "tracer", None), "tensor_tracker", None)
    if tracker is None:
        return []
    live = [t for t in list(tracker.keys()) if isinstance(t, torch.Tensor)]
    if not live:
        return []
    ids = {id(t) for t in live}
    refs = gc.get_referrers(*live)
    dicts = [r for r in refs if type(r) is dict]
    owners = [r for r in refs if type(r) is not dict and _owner_kind(r)]
    if dicts:
        dict_ids = {id(d) for d in dicts}
        owners += [o for o in gc.get_referrers(*dicts) if type(o) is not dict and _owner_kind(o)
                   and id(getattr(o, "__dict__", None)) in dict_ids]
    del refs, dicts
    from torch.utils._python_dispatch import _disable_current_modes

    from .rollback import before_write
    consts = {id(getattr(mode.tracer.root, n.target, None)) for n in mode.tracer.graph.nodes if n.op == "get_attr"}
    out, seen, stores, index = [], set(), {}, _holders()
    root = getattr(mode.tracer, "root", None)   # (make_fx's scratch module: its constants)
    for o in owners:
        if id(o) in seen or o is root:
            continue
        seen.add(id(o))
        d = getattr(o, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for name, v in list(d.items()):
            if not (isinstance(v, torch.Tensor) and id(v) in ids and is_traced(v)) or id(v) in done \
                    or isinstance(v, nn.Parameter) or (type(o) is nn.Module and _TRACER_CONSTANT.fullmatch(name)):
                continue   # (the last: an earlier trace's scratch module, garbage gc has not collected yet)
            old = _BEFORE.get((id(o), name))
            read = old is not None and old is not v and id(old) in consts and old.shape == v.shape \
                and old.dtype == v.dtype and old.device == v.device and not old.requires_grad \
                and not _held_elsewhere(old, (id(o), name), index)
            if read:   # (self.running_mean = 0.9 * self.running_mean + ...: a graph constant)
                before_write(old)   # (undone with the rest if the capture fails after this)
                with _disable_current_modes(), torch.no_grad():
                    old.copy_(v)   # (replays read what this call left)
            store = AttrStore(o, name, const=old if read else None)
            store.last = v
            stores[(id(o), name)] = store
            out.append((store, v))
            g = v.grad if v.is_leaf or v.retains_grad else None
            if g is not None and is_traced(g):   # (layer.out.retain_grad())
                out.append((AttrStore(o, name, grad=True), g))
    # (a rebinding whose old tensor the graph reads and another holder keeps -- torchmetrics'
    # Running, whose window slots hold the base metric's states: the next replay would read it
    # stale -- is checked by identity, a capture per call; one rebound with its old tensor kept
    # current, or left in place, is synced)
    _HELD[:] = [_Synced(o, name, old, None, copy=not _held_elsewhere(old, key, index)) if same else
                _Synced(o, name, old, st if st.const is old else None, copy=st.const is old)
                for key, old in _BEFORE.items() if id(old) in consts
                for o in [_OWNERS[key[0]]] for name in [key[1]] for st in [stores.get(key)]
                for same in [vars(o).get(name) is old] if (same or st is not None) and o is not root
                and not isinstance(o, torch.fx.GraphModule) and not _TRACER_CONSTANT.fullmatch(name)]
    _BEFORE.clear()
    _OWNERS.clear()
    return out


def _held_elsewhere(old, key, index: dict) -> bool:
    """Another attribute, or a dict or list an attribute holds, keeps ``old`` (torchmetrics'
    ``_defaults``, the tensor ``reset()`` clones, is the state ``add_state`` bound): copying
    the step's new value into it, for the next replay to read, would change what it sees."""
    return bool(index.get(id(old), set()) - {key})


def _holders() -> dict:
    """id(tensor) -> the places (owner id, name) holding it, before the step (_BEFORE) or after
    it (an attribute, or an entry of a dict or list an attribute holds): one pass for all checks."""
    out: dict = {}
    for k, t in _BEFORE.items():
        out.setdefault(id(t), set()).add(k)
    for oid, o in _OWNERS.items():
        for k, v in list(vars(o).items()):
            if isinstance(v, torch.Tensor):
                out.setdefault(id(v), set()).add((oid, k))
            elif type(v) in (dict, list):
                for x in (v.values() if type(v) is dict else v):
                    if isinstance(x, torch.Tensor):
                        out.setdefault(id(x), set()).add((oid, k, "in"))
    return out


def take_held() -> list:
    """The attributes the last collect found holding a tensor the graph reads as its constant."""
    out = list(_HELD)
    _HELD.clear()
    return out


class _Current:
    """``owner.name`` now: a numchecks.Root's slot."""

    def __init__(self, ref, name: str):
        self.ref, self.name = ref, name

    def get(self):
        o = self.ref()
        return None if o is None else vars(o).get(self.name)


class _Synced:
    """Before a replay: ``owner.name`` still holds the tensor the graph reads as its constant (or
    the one the last replay bound there). torchmetrics' ``Metric.reset()`` at an epoch's end, or
    a loop's ``meter.total = torch.zeros(())``, binds a fresh tensor there, outside the step;
    the graph kept updating the old one, the reset silently undone. A fresh tensor of the same
    layout is copied into the constant and the attribute bound to it: the replay reads and updates
    what eager would (only the tensor object differs: footgun (t)). Another layout, no tensor,
    or a constant another holder keeps (``copy`` False): a miss, captured again."""
    __name__ = "holds the captured tensor or one of its layout"

    def __init__(self, owner, name: str, const, store, copy: bool):
        self.slot = _Current(AttrStore(owner, name)._ref, name)
        self.label = f"{type(owner).__name__}.{name}"
        self.const, self.store, self.copy = const, store, copy

    def __call__(self, now) -> bool:
        c = self.const
        if now is c or (self.store is not None and now is self.store.last):
            return True
        if not self.copy or type(now) is not torch.Tensor or now.requires_grad or \
                (now.shape, now.dtype, now.device, now.stride()) != (c.shape, c.dtype, c.device, c.stride()):
            return False
        with torch.no_grad():
            c.copy_(now)
        o = self.slot.ref()
        if o is not None:
            vars(o)[self.slot.name] = c
        return True


def attribute_checks(gm: torch.fx.GraphModule, held: list) -> list:
    """numchecks.Checks of the attributes in ``held`` whose constant ``gm`` still reads."""
    from .numchecks import Check, Op, Root
    read = {id(getattr(gm, n.target, None)) for n in gm.graph.nodes if n.op == "get_attr"}
    return [Check(Op(h, (Root("slot", (h.slot, h.slot.name), h.label),)), True, decided=True)
            for h in held if id(h.const) in read]
