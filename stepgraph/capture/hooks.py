"""Find hooks whose Python side effects would run only at capture, and say so.

Hooks run while the step is traced, so their *tensor* effects are in the graph and replay
every call; anything else they do (append to a list, bump a counter, log) happens only at
warm-up and capture. Hooks are gathered from the step's modules and parameters and from
``register_hook`` calls made during the trace, and each one's bytecode is checked for
stores outside its own frame and for calls that usually mean a side effect.
"""
from __future__ import annotations

import dis
import functools
import gc
import os
import types

from .watch import GLOBAL_HOOK_ATTRS, MODULE_HOOK_ATTRS

_EFFECT_CALLS = {"append", "extend", "insert", "add", "update", "pop", "remove", "clear", "write",
                 "print", "info", "debug", "warning", "warn", "error", "log", "put", "setdefault",
                 "__setitem__", "__delitem__", "__iadd__", "setattr"}   # (a lambda hook: stats.__setitem__(...))
_EFFECT_STORES = {"STORE_GLOBAL", "STORE_DEREF", "STORE_ATTR", "STORE_SUBSCR"}
_TENSOR_ATTRS = {"grad", "data"}


def _code_of(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    if hasattr(fn, "__code__"):
        return fn.__code__
    call = getattr(type(fn), "__call__", None)
    return getattr(call, "__code__", None)


def side_effects(fn) -> list[str]:
    """Reasons to believe ``fn`` has Python side effects (empty if none found)."""
    code = _code_of(fn)
    if code is None:
        return []
    found = []
    for ins in dis.get_instructions(code):
        if ins.opname == "STORE_ATTR" and ins.argval in _TENSOR_ATTRS:
            continue  # p.grad = ... is a tensor effect: the graph captures and rebinds it
        if ins.opname in _EFFECT_STORES:
            what = {"STORE_GLOBAL": "assigns a global", "STORE_DEREF": "assigns a nonlocal",
                    "STORE_ATTR": f"sets attribute .{ins.argval}", "STORE_SUBSCR": "assigns an item"}[ins.opname]
            found.append(what)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME") \
                and isinstance(ins.argval, str) and ins.argval in _EFFECT_CALLS:
            found.append(f"calls {ins.argval}()")
    return list(dict.fromkeys(found))


def private_cells(hooks) -> list:
    """Closure cells that only hooks registered during the trace hold, through closures of
    closures (``s = h.max().item(); h.register_hook(lambda g: g * s)``; a multi-grad hook's
    inner hooks hold the user's). Their backward ran under the step's modes (fnbackward.py), so
    a read kept there was used live: no Python state a replay leaves stale. A cell the step's
    own function shares (``nonlocal s``) is state outside the hook: not one of these."""
    tuples, cells, seen, todo = set(), [], set(), [fn for _, fn in hooks]
    while todo:
        fn = todo.pop()
        while isinstance(fn, functools.partial):
            fn = fn.func
        fn = getattr(fn, "__func__", fn)
        closure = getattr(fn, "__closure__", None)
        if id(fn) in seen or not closure:
            continue
        seen.add(id(fn))
        tuples.add(id(closure))
        for c in closure:
            cells.append(c)
            try:
                todo.append(c.cell_contents)
            except ValueError:   # (a cell not assigned yet)
                pass
    tuples.add(id(cells))
    return [c for c in cells
            if all(id(r) in tuples or isinstance(r, types.FrameType) for r in gc.get_referrers(c))]


def registered_hooks(reg) -> list:
    """(description, fn) for hooks on the step's modules and parameters."""
    from torch.nn.modules import module as _m
    out = []
    for attr in GLOBAL_HOOK_ATTRS:
        for fn in getattr(_m, attr, {}).values():
            out.append((f"global module {attr[8:-1]}", fn))
    for sub in reg.all_modules:
        for attr in MODULE_HOOK_ATTRS:
            for fn in getattr(sub, attr, {}).values():
                out.append((f"{type(sub).__name__}.{attr.strip('_')[:-1]}", fn))
    for src, p in reg.params:
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            d = getattr(p, attr, None) or {}
            for fn in d.values():
                out.append((f"{src} {attr.strip('_')[:-1]}", fn))
    return out


def describe(fn) -> str:
    code = _code_of(fn)
    if code is None:
        return repr(fn)
    return f"{getattr(fn, '__qualname__', code.co_name)} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def replayed_targets(tr) -> set:
    """ids of the Python containers a replay writes again: lists it appends to, dicts and
    objects whose items or attributes it sets (pyeffects.py)."""
    from .trackplan import _parent
    out = set()
    for effects, target in ((tr.append_effects, lambda s: s.read(())), (tr.source_effects, lambda s: _parent(s, ()))):
        for e in effects:
            try:
                out.add(id(target(e.source)))
            except Exception:  # noqa: BLE001 - not readable: not known to be replayed
                continue
    return out


def _effects_replayed(fn, replayed: set) -> bool:
    """Every store and container call of the hook's code goes into one of ``replayed`` (a
    backward hook's ``norms.append(g.norm().item())``, a Grad-CAM hook's ``cam['g'] = g``)."""
    from .chains import _chains
    code, f = _code_of(fn), getattr(fn, "__func__", fn)
    cells = dict(zip(code.co_freevars, getattr(f, "__closure__", None) or ()))
    hits = 0
    for op, name, path, _ in _chains(code):
        effect = path and (path[-1][0] in ("call", "method") and path[-1][1] in _EFFECT_CALLS or path[-1][0] == "item")
        if not effect or op not in ("LOAD_DEREF", "LOAD_GLOBAL"):   # (its own locals: not outside state)
            continue
        root = cells[name].cell_contents if op == "LOAD_DEREF" and name in cells else \
            getattr(f, "__globals__", {}).get(name) if op == "LOAD_GLOBAL" else None
        if root is None or len(path) != 1 or id(root) not in replayed:
            return False
        hits += 1
    stores = {i.opname for i in dis.get_instructions(code)} & {"STORE_GLOBAL", "STORE_DEREF", "STORE_ATTR"}
    return hits > 0 and not stores


def warn_side_effects(hooks, step_name: str, replayed=frozenset()):
    """One warning naming each hook with side effects; returns the lines (for explain()).
    ``replayed``: containers replays write again (replayed_targets)."""
    import warnings
    lines, seen = [], set()
    for where, fn in hooks:
        key = _code_of(fn)
        if key is None or key in seen:
            continue
        seen.add(key)
        why = side_effects(fn)
        if why and replayed and _effects_replayed(fn, replayed):
            continue
        if why:
            lines.append(f"{where} hook {describe(fn)}: {', '.join(why)}")
    if lines:
        warnings.warn(f"stepgraph: {step_name}: these hooks have Python side effects that run only at "
                      "warm-up and capture, not on replays (their tensor effects are captured):\n  "
                      + "\n  ".join(lines), stacklevel=5)
    return lines


def hooks_left_registered(tr, name: str) -> list[str]:
    """Tensor hooks the step registers and leaves registered: warned (every call recaptures)."""
    import warnings
    left = [src for src, t, fn in tr.state_hooks
            if any(h is fn for d in (t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None))
                   if d for h in d.values())]
    if not left:
        return []
    msg = (f"stepgraph: {name} registers hooks on {', '.join(dict.fromkeys(left))} and leaves "
           "them registered: in eager they stack up call after call, so every call will "
           "recapture; register them once outside the step, or remove them before it returns")
    warnings.warn(msg, stacklevel=5)
    return [msg]
