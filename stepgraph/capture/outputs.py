"""What the step hands back to Python besides tensors, and Python state it changes.

A replay runs no Python code: a Python value the step returns is the capture's value, and a
Python value the step assigns (a counter, ``history.append``) is not assigned again. Returned
values that come from a live source (an optimizer's ``lr``, a live Python float) are read live
at each replay; a value the guards prove unchanged is fine; anything else is warned about once.
Changes the step makes to Python values it reads are refused with the line that reads them.
"""
from __future__ import annotations

import collections
import logging
import warnings

import torch
import torch.utils._pytree as pytree

from ..errors import CaptureError, NeedsReplay
from .hostscalar import group_reader
from .pycalls import reads_of
from .pyvalues import _show, guard_value
from .heldoutputs import held_leaf

log = logging.getLogger("stepgraph")


def container_slots(py, args) -> list:
    """Per source, what its list or dict holds (by identity, shallow) or None: a container keyed
    by identity (its items are not in the guard key) can change under the guards' eyes."""
    out = []
    for s in py.sources:
        v = s.read_or(args)
        if type(v) is list:
            out.append(("list", [id(x) for x in v], id(v)))
        elif isinstance(v, collections.deque):   # (its items held: a full ``maxlen`` one keeps its length)
            out.append(("deque", tuple(v), id(v)))
        elif type(v) is dict:
            out.append(("dict", {k: id(x) for k, x in v.items()}, id(v)))
        elif isinstance(v, (list, dict, set)):
            out.append(("sized", [None] * len(v), id(v)))
        else:
            out.append(None)
    return out


def _size(snap):
    return None if snap is None else len(snap[1])


def _holds_tensor(container, k) -> bool:
    try:
        x = container[k]
    except (IndexError, KeyError):
        return False   # (a slot removed: the guard key's length or the next read sees it)
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else (x,)
    return any(isinstance(i, torch.Tensor) for i in items)


def refuse_slot_stores(py, before: list, after: list, args, covered=()) -> None:
    """Raise when the step put a new tensor into a list or dict slot that no replay writes
    again (``info.update({"loss": loss.detach()})``, ``hist[key] = t``: every replay would leave
    this call's object there). Appends are the lists' own business (warn_appends, pyeffects);
    ``covered``: the Sources whose slot a replay writes (pyeffects.SourceEffect, NumberEffect)."""
    from .trackplan import slot_of
    done = {slot_of(s, args) for s in covered}
    for s, a, b in zip(py.sources, before, after):
        if a is None or b is None or a[0] != b[0] or a[0] in ("sized", "deque") or a[2] != b[2] or not s.from_step \
                or ".param_groups" in s.describe():   # (rebound: the guard key's business; lr: live)
            continue
        v = s.read_or(args)
        if a[0] == "list":
            changed = [i for i, (x, y) in enumerate(zip(a[1], b[1])) if x != y]
            if len(b[1]) < len(a[1]):
                changed.append(len(b[1]))
        else:
            changed = [k for k in b[1] if a[1].get(k) != b[1][k]] + [k for k in a[1] if k not in b[1]]
        # Only tensors differ from replay to replay of one graph: a number or object built from
        # guarded values is the same each time (a value read from a tensor is warned apart).
        changed = [k for k in changed if (id(v), k) not in done and _holds_tensor(v, k)]
        if changed:
            name = f"{s.describe()}[{changed[0]!r}]"
            raise CaptureError(
                f"the step stores a new value into {name}: a replay runs no Python code, so that slot "
                "would keep this call's value\n  this call ran eagerly to its end: your model and "
                "optimizer hold the result of this step", op=f"store into {name}", where=s.where,
                fix=f"return the value from the step and store it in {s.describe()} outside the step "
                    "(or assign it with a constant key: d['loss'] = t is replayed)")


def warn_appends(py, before: list, after: list, step_name: str, replayed=frozenset()) -> list:
    """Containers the step only calls methods on (``history.append(x)``) that grew: a replay
    will not append. Warned (returned for explain()), not refused: the graph does not read them.
    Not ``replayed``: lists given only graph tensors and host reads, which replays append to
    (pyeffects.collect_appends). A deque changed otherwise is refused (_refuse_deque)."""
    _refuse_deque(py, before, after, replayed)
    notes = [f"{s.describe()} grew by {b - a} in the call captured (read at {s.where}); replays do not run "
             "Python code, so they will not add to it (return the values from the step instead)"
             for s, a, b in zip(py.sources, map(_size, before), map(_size, after)) if s.identity_only
             and a is not None and b is not None and a != b and id(s) not in replayed]
    return _warned(notes, step_name)


def _refuse_deque(py, before: list, after: list, replayed) -> None:
    """A deque the step changed (``dq.append(step)``, ``dq.popleft()``) that no replay changes
    again: refused, as a list it reads is. Keyed by identity (or, full at its ``maxlen``, by a
    length that does not change), replays left it as the capture did, silently."""
    for s, a, b in zip(py.sources, before, after):
        if a is None or b is None or a[0] != "deque" or b[0] != "deque" or a[2] != b[2] \
                or not s.from_step or id(s) in replayed:
            continue
        if len(a[1]) != len(b[1]) or any(x is not y for x, y in zip(a[1], b[1])):
            raise CaptureError(
                f"the step changes the deque {s.describe()} ({len(a[1])} -> {len(b[1])} items) with values "
                "a replay cannot compute again (only tensors the step computes and values read from "
                "them are appended after each replay); a replay runs no Python code, so it would not "
                "change it\n  this call ran eagerly to its end: your model and optimizer hold the "
                "result of this step", op=f"change of {s.describe()}", where=s.where,
                fix=f"change {s.describe()} in the loop outside the step, or append only tensors the "
                    "step computes (or their .item())")


def _warned(notes: list, step_name: str) -> list:
    for n in notes:
        msg = f"stepgraph: {step_name}: {n}"
        warnings.warn(msg, stacklevel=6)
        log.warning(msg)
    return notes


def _place(s, args=()):
    """Where a source's value lives (one place, whatever path the code took to it; an
    attribute of an argument found through the call's ``args``)."""
    from .trackplan import slot_of
    return slot_of(s, args) or id(s)


def _train_flag(s, args) -> bool:
    """``self.training`` of a module, read by the step's code (``F.dropout(x, p,
    training=self.training)``) and set by its ``model.train()`` (PyTorch Geometric's examples, with
    ``model.eval()`` between calls): the graph's entry mode is guarded and the mode the step leaves
    is set after each replay (pipeline: ``training_before``), so no side effect to refuse."""
    if not s.path or s.path[-1] != ("attr", "training"):
        return False
    try:
        parent = type(s)(s.kind, s.root, s.name, s.path[:-1]).read_or(args)
    except Exception:  # noqa: BLE001 - a chain that does not resolve: not a module's flag
        return False
    return isinstance(parent, torch.nn.Module)


def refuse_python_side_effects(py, before: tuple, after: tuple, scheduled: bool = False,
                               replayed=(), slots=(), args=(), held=None) -> None:
    """Raise when the traced call changed a Python value its own code reads. Not refused: a
    param group's value an LR scheduler stepped inside the step changed, a number assigned
    from tracked arithmetic (``replayed``, ``completed_steps += 1``) and a buffer the step
    rebinds (``slots``: state.Slot escapes, ``self.center = ...``): replays redo them; a list
    rebound to the tensors it held (``held``: pybefore.PyBefore.tensors; ``same_tensors``)."""
    from .pyeffects import carried_element, source_id
    carried = {source_id(s) for s in replayed}   # (a carried tuple's elements come with it)
    replayed = {_place(s, args) for s in replayed} | {(id(s.owner), s.key) for s in slots if s.kind == "buffer"}
    for i, (s, a, b) in enumerate(zip(py.sources, before, after)):
        if carried_element(s, carried) or (held is not None and same_tensors(held.get(i), s.read_or(args, None))):
            continue
        if _in_place(a, b):
            continue   # (the members of a container the step changed in place, its length kept:
            # not refused, as when such containers were keyed by identity and length only)
        if a != b and s.from_step and _place(s, args) not in replayed \
                and not (scheduled and ".param_groups[" in s.describe()) and not _train_flag(s, args):
            if _tensor_key(a) or _tensor_key(b):   # (vqvae's new nn.Parameter each step)
                raise CaptureError(
                    f"the step rebinds {s.describe()} to another tensor ({_show(a)} -> {_show(b)}); a "
                    "replay runs no Python code, so it would keep the tensor of this capture\n  this "
                    "call ran eagerly to its end: your model and optimizer hold the result of this step",
                    op=f"assignment to {s.describe()}", where=s.where,
                    fix=f"update {s.describe()} in place instead (with torch.no_grad(): "
                        f"{s.describe()}.copy_(new), or {s.describe()}.data = new), which a replay repeats")
            now = s.read_or(args, None)
            same = isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == ("object",) \
                and a[1] == b[1]   # (the same list grown in place, CycleGAN's image pool: not rebound)
            if isinstance(now, (list, tuple)) and now and all(isinstance(t, torch.Tensor) for t in now) and not same:
                # (Transformer-XL's ``loss, mems = ret[0], ret[1:]``: a recurrent state the forward
                # returns, rebound at each call -- no loop around the step can update it)
                raise CaptureError(
                    f"the step rebinds {s.describe()} to a {type(now).__name__} of {len(now)} tensors it "
                    "computes; a replay runs no Python code, so it would not rebind it\n  this call ran "
                    "eagerly to its end: your model and optimizer hold the result of this step",
                    op=f"assignment to {s.describe()}", where=s.where,
                    fix=f"pass {s.describe()} to the step as an argument and return the new one "
                        f"(loss, {s.describe()} = step(batch, {s.describe()})): a recurrent state "
                        "carried from call to call is an input and an output of the graph")
            raise CaptureError(
                f"the step changes the Python value {s.describe()} ({_show(a)} -> {_show(b)}); a replay "
                "runs no Python code, so it would not change it again\n  this call ran eagerly to its "
                "end: your model and optimizer hold the result of this step",
                op=f"assignment to {s.describe()}", where=s.where,
                fix=f"update {s.describe()} outside the step (in the loop around it), or keep it in a "
                    "tensor the step updates in place; pass values that change as arguments")


def same_tensors(old, now) -> bool:
    """A list rebound to the very tensors it held (torchvision's AnchorGenerator: ``self.cell_anchors
    = [a.to(dtype, device) for a in self.cell_anchors]``, a no-op ``.to()``): nothing for a replay
    to redo; keyed by those tensors from then on (pybefore.rebound_key)."""
    return type(old) in (list, tuple) and type(now) is type(old) and now is not old and len(now) == len(old) \
        and all(x is y for x, y in zip(now, old))


def _in_place(a, b) -> bool:
    """Both keys are a nested container's members (valuekeys: ``("contents", len, ...)``) of one
    type and length."""
    return isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == ("contents",) \
        and a[1] == b[1] and a[2][:1] == b[2][:1]


def _tensor_key(k) -> bool:
    return isinstance(k, tuple) and (k[:1] == ("tensor",) or k[:1] == ("live tensor",))


def live_outputs(tr, reg, py, args, step_name: str) -> None:
    """Rewrite ``tr.out_leaves``: Python numbers read live where their source is known."""
    keypaths = [p for p, _ in pytree.tree_flatten_with_path(tr.result)[0]]
    paths = [pytree.keystr(p) for p in keypaths]
    values = [s.read_or(args) for s in py.sources]
    guarded = {id(v) for v in values if v is not None}
    # (``self.log("epoch", float(self.current_epoch))``: a number made from a value the graph is keyed by)
    keyed = {v for v in values if type(v) in (int, float)}
    read_guarded = {id(v) for v in (tr.reads.guarded if tr.reads is not None else ())}  # (host reads, by value)
    guarded |= read_guarded
    checked = tr.uses.returned if tr.uses is not None else set()  # checks hold them (tracked.py)
    out, unsure = [], []
    for (kind, v), where, kp in zip(tr.out_leaves, paths, keypaths):
        if kind != "const" or isinstance(v, bool) or not isinstance(v, (int, float)):
            out.append((kind, v))
            continue
        held = held_leaf(tr.result, kp, py.sources, args, tr.number_effects)
        if held is not None:
            out.append(held)
            continue
        group_hit = next(((g, k) for _, opt in reg.optimizers for g in opt.param_groups
                          for k, x in g.items() if x is v), None)
        if group_hit is not None and isinstance(v, float):
            out.append(("live", group_reader(*group_hit)))
            continue
        if not (isinstance(v, float) and id(v) in guarded) and id(v) not in read_guarded \
                and id(v) not in checked and v not in py.literals and v not in keyed:
            unsure.append(f"output{where}={_show(guard_value(v))}")
        out.append((kind, float(v) if isinstance(v, float) else v))
    tr.out_leaves = out
    if unsure:
        msg = (f"stepgraph: {step_name} returns Python number(s) {', '.join(unsure[:4])}: a replay returns "
               "the value this capture computed; return a tensor (e.g. torch.tensor(x)) for a value "
               "that changes from call to call")
        warnings.warn(msg, stacklevel=5)
        log.warning(msg)


def read_side_effects(tr, step_name: str) -> list:
    """Values read from tensors that the step printed or stored in Python objects (a meter, a
    list, a global): that Python runs only at capture. Warned and returned for explain()."""
    from .hooks import private_cells
    from .hostreads import stored_reads
    log_ = tr.reads
    printed = list(dict.fromkeys(log_.printed)) if log_ is not None else []
    # (any other print(): '%.4f' % loss.item() formats in C, past every hook of the read value)
    # (a print redone after each replay, pycalls.py, is no print that runs only at capture)
    redone = {c.where.split(" (")[0] for c in tr.call_effects if c.method == "print"}
    plain = [p for p in dict.fromkeys(tr.uses.prints if tr.uses is not None else ())
             if p not in printed and p.split(" (")[0] not in redone]
    notes = []
    clocks = list(dict.fromkeys(tr.uses.clocks if tr.uses is not None else ()))
    if clocks:
        notes.append(f"reads the clock at {', '.join(clocks[:3])} and uses that value where a replay "
                     "cannot read it again (int(), a value a CUDA graph takes): there it is this "
                     "capture's value at every replay; time the call outside the step")
    if plain:
        notes.append(f"calls print() at {', '.join(plain[:3])}: that runs only at warm-up and capture; "
                     "replays print nothing (return the values and print them outside the step)")
    if log_ is None:
        return _warned(notes, step_name)
    if printed:
        notes.append(f"prints/formats values read from tensors at {', '.join(printed[:3])}: "
                     "that runs only at capture; replays print nothing (return the values and "
                     "log them outside the step)")
    containers: list = []

    def walk(x, depth=0):
        if depth < 6 and isinstance(x, (list, tuple, dict)):
            containers.append(x)
            for v in (x.values() if isinstance(x, dict) else x):
                walk(v, depth + 1)
    walk(tr.result)
    for ctx in list(log_.ctxs):   # (``ctx.scale = x.item()``: used live by its backward, fnbackward.py)
        walk(vars(ctx))
    containers += private_cells(tr.hooks)   # (``lambda g: g * s``: used live by the hook, too)
    containers.append(vars(tr))  # the TraceResult itself holds the result
    import gc   # ...and the pipeline's one-item tuple of it (``return tot``, a float summed from reads)
    containers += [r for r in gc.get_referrers(tr.result) if type(r) is tuple and len(r) == 1]
    stored = stored_reads(log_, containers)
    if stored:
        notes.append(f"stores values read from tensors (at {', '.join(stored[:3])}) in Python objects "
                     "(a meter, a list, a global): replays run no Python, so they keep this call's "
                     "value; return the values from the step and update those objects outside it")
    return _warned(notes, step_name)


def kept_reads(tr) -> list:
    """(what, where) of each value read on the host (or from the clock) that the step hands to
    Python: a variable, a list, a method. Only Python between or after graph segments keeps it."""
    return [(e.source.describe(), e.source.where) for e in tr.source_effects + tr.append_effects
            if e.kind == "read"] + [(f"{c.source.describe()}.{c.method}()", c.where)
                                    for c in tr.call_effects if any(True for _ in reads_of([c]))]


def refuse_host_python(tr, numbers_left: bool = True) -> None:
    """NeedsReplay for a CUDA graph without segments (Inductor's) whose Python values come from
    host reads: numbers computed from them, variables and lists they are written back to. The
    cudagraph backend's segments run that Python between and after its graphs. ``numbers_left``:
    numbers read at each replay stay Python (not fed in as device scalars)."""
    if tr.uses.lifted and numbers_left:
        # A Python number read at each replay (``meter.sum += loss.item() * n``, an lr computed
        # from the iteration argument) is a Python node one compiled graph cannot hold; baked
        # instead, it missed at every call (a recapture per step, 1-4 s each: timm, torchvision
        # on an H100).
        labels = {n.target.number_label for n in tr.uses.lifted.values()}
        names = ", ".join(sorted(labels, key=lambda x: (x.startswith("global "), x))[:4])
        raise NeedsReplay(
            f"the step computes Python numbers from values that change at each call ({names}; e.g. "
            "a meter's sum += loss.item(), an lr from the iteration): one compiled graph cannot "
            "recompute them at each replay",
            op="Python number read at each replay", where="the step function",
            fix="use backend='cudagraph' (CUDA) or 'replay' (backend='auto' does so), or keep "
                "that Python outside the step (an lr assigned to the param groups before the call "
                "is read live; a meter updated from a returned tensor)")
    reads_kept = kept_reads(tr)
    if reads_kept:
        raise NeedsReplay(
            f"the step hands a value read on the host to {reads_kept[0][0]}: one graph cannot run "
            "that Python at each replay", op="host read kept in a Python variable",
            where=reads_kept[0][1] or "the step function",
            fix="use backend='cudagraph' or 'replay' (backend='auto' does so), or accumulate a tensor "
                "(total += loss.detach()) and read it outside the step")


def hidden_containers(py, args) -> list:
    """Before the trace: the containers in the attributes of the user's own objects that the
    step reads (a replay buffer's ``memory.buffer`` deque, filled by ``memory.put(t)``), which
    no Source covers because the step's code never reads them itself: (source, attribute,
    container, its length)."""
    import collections

    from .attrstores import _users_class
    values = [s.read_or(args) for s in py.sources]
    covered, seen, out = {id(v) for v in values}, set(), []
    for s, v in zip(py.sources, values):
        if v is None or id(v) in seen or isinstance(v, (torch.nn.Module, torch.optim.Optimizer, type)) \
                or not _users_class(type(v)) or not isinstance(getattr(v, "__dict__", None), dict):
            continue
        seen.add(id(v))
        out += [(s, name, c, len(c)) for name, c in vars(v).items()
                if isinstance(c, (list, dict, set, collections.deque))
                and (id(c) not in covered or type(c) not in (list, dict))]   # (a list or dict the step reads: warn_appends, pyeffects)
    return out


def _changed(before: list, trace, args) -> list:
    """The containers of ``hidden_containers`` whose length the trace changed, but for those of
    an object whose calls are redone after each replay (pycalls: a logger's ``add_scalar``)."""
    redone = {id(e.source.read_or(args)) for e in trace.call_effects if e.source is not None}
    return [(s, name, c, n) for s, name, c, n in before if len(c) != n and id(s.read_or(args)) not in redone]


def refuse_hidden_changes(before: list, trace, args, fn) -> None:
    """After the trace: such a container that grew or shrank was changed by code the step
    called (``memory.put(t)``); a replay runs no Python code, so it would not change it again
    (and the trace may have stored its own proxies there): refused, state as the call left it.
    Before, the replays silently skipped the change."""
    changed = _changed(before, trace, args)
    if changed:
        s, name, c, n = changed[0]
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "the step function"
        raise CaptureError(
            f"the step changes {s.describe()}.{name} (a {type(c).__name__} of {n} -> {len(c)} items) in "
            "code it calls: a replay runs no Python code, so it would not change it again",
            op=f"{s.describe()}.{name}", where=where,
            fix=f"change {s.describe()} in the loop outside the step (e.g. store the transition before "
                "calling it), and pass what the step needs as arguments")


def hidden_changed(before: list, trace, args) -> bool:
    return bool(_changed(before, trace, args))
