"""Python variables the step accumulates into: read live, written back after each replay.

``total_loss += loss.detach().float()`` (the Hugging Face no_trainer scripts) and
``train_loss += loss.item()`` (kuangliu's CIFAR global) rebind a loop variable to a value the
step computed; a replay runs no Python, so this used to be refused. Now:

* a variable holding a plain tensor that the step reads (a global, a closure cell, an attribute
  or dict item of a plain object) is a **graph input**, keyed by dtype/shape/device/stride, not
  identity: a new epoch's ``total_loss`` is no new graph; ``total_loss += x`` writes it in place;
* a variable the step **rebinds** to a tensor it computed (``0 -> tensor``, ``t = t + x``)
  gets that tensor as an extra graph output, written back (cloned) after each replay;
* one rebound to a float the graph computes (``train_loss += loss.item()``) likewise.

Rebinding to anything else (a tensor from before the step) stays a clear error. Only variables
reached without the call's arguments (not ``args.x``) take part.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from . import nextlr
from .effects import Problem, _is_traced
from .hostscalar import _plain, current
from .pyvalues import _MISSING


@dataclass(eq=False)
class SourceEffect:
    """A variable the step rebinds to a graph value: written back after each replay."""
    source: object   # pyvalues.Source
    kind: str        # "tensor" (an output cloned like the user's) | "read" (a host number) | "group" |
    #                  "tensors" (a tuple of ``n`` outputs from ``index`` on: a recurrent state)
    index: int = -1  # its graph output position (reads: set once the graph is made)
    node: object = None  # a read's graph node, until placed
    n: int = 1
    seq: type = tuple    # ("tensors": a tuple, or a list -- Transformer-XL's ``ret[1:]``)

    def value(self, outs):
        """What a replay writes back, from the graph's outputs (a new container each replay)."""
        if self.kind == "group":   # (node: the (param group, key) the redone scheduler set)
            return float(self.node[0][self.node[1]])
        return self.seq(outs[self.index:self.index + self.n]) if self.kind == "tensors" else outs[self.index]


def reachable(s) -> bool:
    """The step's own variable, reachable without the call's arguments."""
    return s.from_step and not s.identity_only and s.kind != "arg"


def live_tensor(s, v, args, known) -> bool:
    """``s`` holds a tensor the graph reads as an input (keyed by metadata, not identity):
    a plain tensor without autograd, not model or optimizer state nor a view of it (``known``:
    ids). A view of a plain tensor (``b_obs = obs.reshape(...)``, rebound each iteration) is an
    input too."""
    from .trackplan import writable
    base = v._base if type(v) is torch.Tensor else None
    return (type(v) is torch.Tensor and reachable(s) and not v.requires_grad and id(v) not in known
            and (base is None or id(base) not in known and not base.requires_grad)
            and writable(s, args))


def rebound_names(fn) -> frozenset:
    """What the step's own code assigns: ("global" | "cell" | "attr", name)."""
    import dis
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    kinds = {"STORE_GLOBAL": "global", "STORE_DEREF": "cell", "STORE_ATTR": "attr"}
    return frozenset((kinds[i.opname], i.argval) for i in dis.get_instructions(code)
                     if i.opname in kinds) if code is not None else frozenset()


def _rebound(s, names) -> bool:
    if not s.path:
        return (s.kind, s.name) in names
    return s.path[-1][0] == "attr" and ("attr", s.path[-1][1]) in names


def live_tuple(s, v, args, known, rebound=frozenset()) -> bool:
    """``s`` holds a tuple (or list) of such tensors and the step's own code assigns it
    (``rebound``): a recurrent state rebound at each call (Transformer-XL's ``loss, mems =
    ret[0], ret[1:]``, an LSTM's ``hidden = (h, c)``), each element an input. (A list the step
    changes in place instead: refused, ``collect``. One it only reads, a pool it picks from, stays
    keyed by identity: a tensor picked from it is the pool's own object in eager.)"""
    return type(v) in (tuple, list) and 0 < len(v) <= _MAX_TUPLE and _rebound(s, rebound) \
        and all(_element(s, t, args, known) for t in v) \
        and len({t.untyped_storage().data_ptr() for t in v}) == len(v)


def live_input(s, v, args, known, rebound=frozenset()) -> bool:
    """A variable's tensor the graph reads as an input: ``live_tensor``, or a tensor the step's own
    code rebinds (a GRU's ``hidden``) with the history an eager warm-up left it (the step detaches
    it). The signature (guards.py) and the trace's inputs (``tensor_sources``) ask this one rule."""
    return type(v) is torch.Tensor and (live_tensor(s, v, args, known)
                                        or _rebound(s, rebound) and _element(s, v, args, known))


def _element(s, t, args, known) -> bool:
    """As ``live_tensor``, but a tensor with autograd history is one too: the state an eager
    warm-up left (an LSTM's output ``(h, c)``), which the step detaches first (a replay's are
    plain outputs)."""
    if type(t) is not torch.Tensor or (t.requires_grad and t.grad_fn is None):
        return False
    return live_tensor(s, t.detach(), args, known) and id(t) not in known


_MAX_TUPLE = 64


def tensor_key(v) -> tuple:
    if type(v) in (tuple, list):
        return ("live tensors", type(v), tuple(tensor_key(t) for t in v))
    return ("live tensor", v.dtype, v.device, tuple(v.shape),
            v.stride() if v.layout == torch.strided else v.layout)   # (a sparse CSR adjacency has no strides)


def source_id(s, path=None) -> tuple:
    """Where a source reads (its root and path): a carried tuple's element ``mems[0]``, which
    the step's code reads too, is ``source_id(mems) + item`` (``carried_element``)."""
    return s.kind, id(s.root), s.name, s.path if path is None else path


def carried_element(s, carried: set) -> bool:
    """``s`` reads an element of a carried tuple (``carried``: their ``source_id``)."""
    return bool(s.path) and s.path[-1][0] == "item" and source_id(s, s.path[:-1]) in carried


def _items(s, v) -> list:
    """One Source per element of the tuple ``s`` holds (read at each call as an input)."""
    from .pyvalues import Source
    return [Source(s.kind, s.root, s.name, s.path + (("item", i),), s.where) for i in range(len(v))]


def state_free(key, v, known):
    """A record holding model or optimizer state (a graph constant) is keyed by identity."""
    if isinstance(key, tuple) and key[:1] == ("record",) and any(
            isinstance(x, torch.Tensor) and id(x) in known for x in vars(v).values()):
        return ("object", id(v))
    return key


def _records(guards, args) -> list:
    """The attributes of the records the step reads (trackplan.record_parts)."""
    from .trackplan import kind_of, record_key, record_parts
    skip, known = guards.live | guards.keyed, guards.reg.names
    return [sub for s in guards.py.sources if reachable(s)
            and kind_of(s, v := s.read_or(args), args, skip) == "record"
            and state_free(record_key(v), v, known)[:1] == ("record",)
            for sub in record_parts(s, v)]


def tensor_sources(guards, args) -> list:
    """Variables whose tensor the graph reads as an input, record attributes included (their
    metadata is in the record's key)."""
    from .trackplan import record_tensor
    known = guards.reg.names
    found = [s for s in guards.py.sources if s not in guards.live
             and live_input(s, s.read_or(args), args, known, guards.rebound)] + \
        [s for s in _records(guards, args) if record_tensor(s.read_or(args))] + \
        [e for s in guards.py.sources if s not in guards.live
         and live_tuple(s, v := s.read_or(args), args, known, guards.rebound) for e in _items(s, v)]
    return _by_path(found, lambda s: id(s.read_or(args)))


def effect_sources(guards, args) -> list:
    """Variables whose rebinding to a graph value a replay redoes."""
    from .trackplan import slot_of, writable
    # (and a module's float its forward reads live, which a library call in the step may set:
    # wav2vec2's ``model.set_gumbel_temperature(t)``; replays left the captured call's value)
    found = [s for s in guards.py.sources if (reachable(s) or s.kind == "object" and s in guards.live)
             and writable(s, args)] + _records(guards, args)
    return _by_path(found, lambda s: slot_of(s, args))


def _by_path(sources, place) -> list:
    """One source per place (a tensor, an attribute), the one found by a path from the step's
    variables first: the ``self`` of a method the step calls on ``meters['top1']`` is the meter
    of the first call, not the one the step reads now."""
    out, seen = [], set()
    for s in sorted(sources, key=lambda s: s.kind == "object"):
        k = place(s)
        if k not in seen:
            seen.add(k)
            out.append(s)
    return out


class _Olds(list):
    members: dict   # position -> the ids a list held (a list changed in place: collect)


def before(sources) -> list:
    """What each candidate holds before the step (compared by identity after it)."""
    from . import attrstores
    attrstores.snapshot()   # (and the tensors objects' attributes hold: attrstores.collect)
    out = _Olds(s.read_or(()) for s in sources)
    out.members = {k: tuple(map(id, v)) for k, v in enumerate(out) if type(v) in (list, deque) and len(v) <= _MAX_TUPLE}
    return out


def _graph_kind(v, tracer) -> str | None:
    """What a replay can hand back for ``v``: "tensor" (a tensor the step computed: a graph
    output) or "read" (a float read on the host: its graph node); None for anything else."""
    if isinstance(v, torch.Tensor) and _is_traced(v):
        return "tensor"
    if isinstance(v, float) and current(v, tracer):
        return "read"
    return None


def _effect(s, v, kind: str, graph_outs: list) -> SourceEffect:
    """The effect replaying ``v`` into ``s`` (a tensor joins ``graph_outs``; a read keeps its node)."""
    if kind == "tensor":
        graph_outs.append(v)
        return SourceEffect(s, "tensor", len(graph_outs) - 1)
    if (slot := nextlr.slot(v)) is not None:   # (an lr a scheduler stepped in the step set: read when written)
        return SourceEffect(s, "group", node=slot)
    return SourceEffect(s, "read", node=v.node)


def collect(sources, olds, graph_outs: list, problems: list, where, number_effects=(),
            const_stores=frozenset(), rebound=frozenset(), taken=()) -> tuple[list, list]:
    """After the step ran (inside the trace): the variables it rebound. Tensors it computed are
    appended to ``graph_outs``; returns (tensor effects, read effects), ``taken`` (effects already
    made: argchanges.replayed) among them; a rebinding the graph cannot redo is a problem. (A record's attribute is checked here, whatever its value: the
    guards key a record by its structure, so nothing else would see it change.)"""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    from .trackplan import number, source_name
    tracer = get_proxy_mode().tracer
    replayed = {(id(e.root.ref[0]), e.root.ref[1]) for e in number_effects if e.container is not None}
    tensors = [e for e in taken if e.kind != "read"]
    reads = [e for e in taken if e.kind == "read"]
    members = getattr(olds, "members", {})
    for k, (s, old) in enumerate(zip(sources, olds)):
        new = s.read_or(())
        if new is old and k in members and tuple(map(id, new)) != members[k] \
                and any(_graph_kind(t, tracer) == "tensor" for t in new):
            problems.append(Problem(   # (keyed by its tensors' metadata: nothing else would see it)
                f"the step puts tensors it computes into the {type(new).__name__} {s.describe()} in place: a replay "
                "could not redo that", s.where or where,
                f"rebind it to a new list or tuple ({s.describe()} = [...]), which a replay writes back",
                plain=True))
            continue
        if new is old or (number(new) and type(new) is type(old) and new == old):
            continue
        rec = getattr(s, "record", None)
        if rec is not None and (id(rec), s.path[-1][1]) in replayed:
            continue
        kind = _graph_kind(new, tracer)
        if type(new) in (tuple, list) and new and all(_graph_kind(t, tracer) == "tensor" for t in new) \
                and rec is None and len(new) <= _MAX_TUPLE and (_rebound(s, rebound) or _unread(old, tracer)):
            # (mems = ret[1:]; or scratch no graph reads before it is rebound: torchvision RAFT's
            # ``self.corr_pyramid = [corr_volume, ...]``, built and read within each forward)
            graph_outs.extend(new)
            tensors.append(SourceEffect(s, "tensors", len(graph_outs) - len(new), n=len(new), seq=type(new)))
        elif kind == "tensor":
            tensors.append(_effect(s, new, kind, graph_outs))
        elif kind == "read":
            reads.append(_effect(s, new, kind, graph_outs))
            s.write(_plain(new))   # eager leaves a plain float there
        elif isinstance(number_effects, list) and ((number(new) or new is None) and (source_name(s), new) in const_stores
                                                   or type(new) is torch.Size):
            # (``tokens = 0`` at a logging step: the Annotated Transformer's) the literal the step's code stores
            # is written again after each replay; a shape too (``self.in_shape = x.shape``: the graph's own)
            from .numchecks import Root
            from .trackplan import NumberEffect
            number_effects.append(NumberEffect(Root("source", s, s.describe()), None, new))
        elif not reachable(s):   # (a live float of a module's forward, set by a library call)
            problems.append(Problem(
                f"a call in the step sets {s.describe()}, which a forward reads, to a number a replay cannot "
                "recompute", s.where or where, f"set {s.describe()} between calls (it is read live at each "
                "call)", plain=True))
        elif isinstance(new, torch.Tensor) or isinstance(old, torch.Tensor) or rec is not None:
            problems.append(Problem(
                f"the step rebinds {s.describe()} to a value it did not compute (a tensor from "
                "before the step, or a non-tensor where a tensor was): a replay could not redo that",
                s.where or where, f"compute the new value of {s.describe()} in the step, or "
                "rebind it outside the step", plain=True))
    from . import attrstores   # (``self.out = x @ self.weight`` on an object no Source names)
    done = {id(graph_outs[e.index]) for e in tensors if e.kind == "tensor"}
    for src, t in attrstores.collect(graph_outs, _is_traced, done):
        tensors.append(_effect(src, t, "tensor", graph_outs))
    return tensors, reads


def _unread(old, tracer) -> bool:
    """``old`` (a value before the step) is nothing, or a list or tuple of tensors none of which
    the graph reads as a constant."""
    if old is None or old is _MISSING:
        return True
    if type(old) not in (tuple, list) or not all(isinstance(t, torch.Tensor) for t in old):
        return False
    ids = {id(t) for t in old}
    return not any(n.op == "get_attr" and id(getattr(tracer.root, n.target, None)) in ids for n in tracer.graph.nodes)


def group_reads(reg, tracer) -> list:
    """Param-group values the step assigned from live floats (``g['lr'] = get_lr(it)`` where
    the schedule's constants are read live): read effects, written after each replay as eager's
    assignment left them; plain floats there now."""
    from .trackplan import group_entries
    out = []
    for src, v in group_entries(reg, lambda v: isinstance(v, float) and current(v, tracer)):
        out.append(SourceEffect(src, "read", node=v.node))
        src.write(_plain(v))
    return out


def append_sources(guards, args) -> list:
    """Lists and deques the step's own code reads and only calls methods on (``history.append(x)``)."""
    return [s for s in guards.py.sources if s.identity_only and s.from_step and s.kind != "arg"
            and isinstance(s.read_or(args), (list, deque))]


def lengths(sources) -> list:
    """A list's length; a deque's items (a full ``maxlen`` deque keeps its length as it grows)."""
    return [tuple(v) if isinstance(v := s.read_or(()), deque) else len(v) for s in sources]


def _appended(lst, n0, tracer) -> int:
    """How many items the step appended: past a list's length ``n0``; a deque's trailing items the
    step computed, after what it held (``n0``) less its oldest dropped by ``maxlen`` (0: it did
    anything else to the deque, refused by outputs.warn_appends)."""
    if not isinstance(lst, deque):
        return max(len(lst) - n0, 0) if isinstance(lst, list) else 0
    items, k = list(lst), 0
    while k < len(items) and _graph_kind(items[-1 - k], tracer) is not None:
        k += 1
    kept = items[:len(items) - k]
    return k if len(kept) <= len(n0) and all(a is b for a, b in zip(kept, n0[len(n0) - len(kept):])) else 0


def collect_appends(sources, lens, graph_outs: list, tracer) -> list:
    """After the step ran (inside the trace): what it appended to each list, when every new item
    is a tensor it computed (a graph output, cloned like its results) or a number it read on the
    host (``loss.item()``: a graph output, plain float in the list). A replay appends them again;
    a list given anything else is left to ``outputs.warn_appends``."""
    effects = []
    for s, n0 in zip(sources, lens):
        lst = s.read_or(())
        k = _appended(lst, n0, tracer)
        if not k:
            continue
        start = len(lst) - k
        kinds = [_graph_kind(lst[i], tracer) for i in range(start, len(lst))]
        if None in kinds:
            continue
        for i, kind in enumerate(kinds, start):
            effects.append(_effect(s, lst[i], kind, graph_outs))
            if kind == "read":
                lst[i] = _plain(lst[i])   # eager leaves a plain float there
    return effects


def truncate(sources, lens):
    """Undo a failed trace's appends (the call then runs eagerly from its start)."""
    def restore():
        for s, n0 in zip(sources, lens):
            lst = s.read_or(())
            if isinstance(lst, deque):
                lst.clear()
                lst.extend(n0)
            elif isinstance(lst, list):
                del lst[n0:]
    return restore


def place_reads(gm, reads: list) -> None:
    """Read effects become graph outputs (after all others)."""
    if not reads:
        return
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    for e in reads:
        if e.kind == "group":
            continue
        e.index = len(outs)
        outs.append(e.node)
        e.node = None
    out.args = (outs,)
    gm.recompile()


def place_read_roots(gm, number_effects) -> list:
    """Int host reads a replayed number is computed from (``correct += n``, hostreads.ReadRef)
    become graph outputs (after all others): ``[(Root, output position)]``."""
    from .numchecks import roots_of
    roots = {id(r): r for e in number_effects for r in roots_of(e.expr) if r.kind == "read"}
    if not roots:
        return []
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    placed = []
    for r in roots.values():
        placed.append((r, len(outs)))
        outs.append(r.ref.node)
    out.args = (outs,)
    gm.recompile()
    return placed
