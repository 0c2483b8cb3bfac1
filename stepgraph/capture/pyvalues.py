"""Python values a step reads: found in its bytecode, guarded on every call, or read live.

A captured graph bakes every Python value the step's code read while it was traced: a global
``lr`` in ``p.data.add_(p.grad, alpha=-lr)``, ``args.clip``, a list of rewards turned into
``torch.tensor(returns)``, the global ``model`` itself. Such values are found by reading the
bytecode of the step function and of the plain user functions and user-class methods it calls:
each ``LOAD_GLOBAL`` / ``LOAD_DEREF`` / argument load followed by attribute loads and
constant subscripts is a :class:`Source` (``global lr``, ``args.clip``, ``cfg['lr']``). Its
value is part of the guard signature (scalars and small containers of scalars by value,
tensors and other objects by identity), so a change recaptures with a one-line reason. On the
replay backend a float of the step's own code is read live instead, from the first capture
(as optimizer ``lr`` is), so an annealed ``lr`` never recaptures. A value that the step itself changes (a
counter, ``history.append``) is a Python side effect a replay cannot perform: refused.
Modules' ``forward`` methods are read the same way (forward_attrs.py) for scalar attributes (``self.p`` of
Dropout, a temperature): train/eval alone does not describe what a forward computes.
A step function that is library code calling user code (``stepgraph.integrations``: Lightning's
loop calling ``training_step``) names that code in ``fn._stepgraph_user_calls``: a list of
``(function, {parameter name: object})``, read as functions the step calls, where the named
parameters (besides a bound method's ``self``) are keyed like ``self``.
"""
from __future__ import annotations

import builtins
import collections
import dis
import functools
import os
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import core_file, library_module
from .argtree import opened
from .chains import (_all_code, _chains, _prefixes, _user_code,  # noqa: F401 - _user_code re-exported
                     autograd_parts, constant_stores, has_var, statement_calls, unwrapped_function)
from .arrays import input_array
from .freshreads import parametrized, view_of_parent
from . import callslots
from .sigkey import Ident
from .valuekeys import CALL_ARGS, _MAX_ITEMS, _MISSING, _SCALARS, _SKIP, _show, default_probe, guard_value, item, rebound_key  # noqa: F401 - re-exported


@dataclass(eq=False)
class Source:
    """A Python value the step's code reads: a root (global, closure cell, argument, an object
    the code is bound to) and a chain of attribute names / constant subscripts."""
    kind: str            # "global" | "cell" | "arg" | "object"
    root: object         # globals dict | cell | argument index | the object
    name: str            # the root's name in the code
    path: tuple = ()     # (("attr", "clip"), ("item", "lr"))
    where: str = ""      # file:line of the first load
    from_step: bool = True  # read by the step's own code (vs a module's forward)
    identity_only: bool = False  # a container the code only calls methods on
    calls_only: bool = False     # a library object the code only calls, as statements (pycalls.py)
    append_only: bool = False    # a list the code only appends to (``losses.append(x)``, ``+=``)
    methods: tuple = ()          # methods of a library object the code calls as statements
    fetched: bool = False        # an iterator the step takes its batches from (fetches.py)
    overwritten: bool = False    # a tensor the step replaces before any read (pybefore.overwritten)
    same_tensors: bool = False   # a list the step rebinds to the tensors it held (pybefore.overwritten)

    def describe(self) -> str:
        s = self.name
        for kind, k in self.path:
            s += f".{k}" if kind == "attr" else f"[{k!r}]"
        return ("global " + s) if self.kind == "global" and not self.path else s

    def __post_init__(self):
        # A model or optimizer is named weakly: a source must not keep a dropped one alive.
        if self.kind == "object" and isinstance(self.root, (nn.Module, torch.optim.Optimizer)):
            self.root = weakref.ref(self.root)

    def _root_value(self, args):
        if self.kind == "global":
            d = self.root
            if self.name in d:
                return d[self.name]
            b = d.get("__builtins__")
            b = b if isinstance(b, dict) else vars(b)
            return b[self.name]
        if self.kind == "cell":
            return self.root.cell_contents
        if self.kind == "arg":   # (read with no arguments given, at replay: the call's)
            return (args or CALL_ARGS.get())[self.root]
        if isinstance(self.root, weakref.ref):
            v = self.root()
            if v is None:
                raise LookupError(f"{self.name} was dropped")
            return v
        return self.root

    def read(self, args=()):
        v = self._root_value(args)
        for kind, k in self.path:
            v = getattr(v, k) if kind == "attr" else item(v, k)
        return v

    def read_or(self, args=(), default=None):
        try:
            return self.read(args)
        except Exception:  # noqa: BLE001 - a missing attribute/key is a value too
            return default

    def value(self, args=()):
        v = self.read_or(args, _MISSING)
        if v is _MISSING:
            return _MISSING
        return self.key_for(v)

    def key_for(self, v):
        """The key of the value ``v`` read here (untracked sources)."""
        if (self.overwritten or self.same_tensors) and (k := rebound_key(self, v)) is not None:
            return k
        if self.fetched:   # (batches taken before the call: a new iterator per epoch is no new graph)
            return ("fetched from", type(v))
        if self.calls_only:   # (a new tqdm bar each epoch is no new graph: pycalls.py)
            return ("calls", type(v))
        if self.append_only and type(v) is list:
            # (a new ``clipfracs = []`` each epoch is no new graph: a replay appends to the list
            # found there then, captured.py; nothing else the graph did read it)
            return ("appended list",)
        if self.identity_only and type(v).__name__ != "ndarray":   # (arr.mean(): values, not identity)
            return ("object", id(v))
        if self.kind == "arg" and not self.path and not isinstance(v, (torch.Tensor,) + _SCALARS):
            return ("argument", type(v))   # (``self`` of its methods: keyed as its leaf, guards.instance_key)
        return guard_value(v)

    def write(self, value, args=()) -> None:
        """Rebind the value where the code reads it (used to substitute a live float while
        tracing, then to put the original back)."""
        if not self.path:
            if self.kind == "global":
                self.root[self.name] = value
            elif self.kind == "cell":
                self.root.cell_contents = value
            return
        parent = self._root_value(args)
        for kind, k in self.path[:-1]:
            parent = getattr(parent, k) if kind == "attr" else item(parent, k)
        kind, k = self.path[-1]
        setattr(parent, k, value) if kind == "attr" else parent.__setitem__(k, value)


@dataclass
class PyValues:
    """Every source found for one step function, and how to key them."""
    sources: list = field(default_factory=list)
    literals: set = field(default_factory=set)   # numbers written in the step's code
    const_stores: set = field(default_factory=set)  # (name, number): ``self.pos = 0`` in its code
    callables: list = field(default_factory=list)  # slots holding a function, or the environment
    names: tuple = ()       # ((describe, where), ...) of ``callables``, one tuple: compared by identity
    scanned: tuple = ()     # slots_key when these sources were found (callslots.py)
    partial: bool = False   # a chain did not resolve whole when found: found again after the warm-up

    def key(self, args=()) -> tuple:
        return tuple(s.value(args) for s in self.sources)

    def slots_key(self, args=()) -> tuple:
        """The signature's ``callables`` section (callslots.py)."""
        return (self.names, tuple(callslots.source_slot_key(s, args, _MISSING) for s in self.callables))

    def diff(self, a: tuple, b: tuple) -> str | None:
        # (a new object first: a value that flips back and forth is not why graphs keep coming)
        pairs = [(s, x, y) for s, x, y in zip(self.sources, a, b) if x != y]
        pairs.sort(key=lambda p: not (isinstance(p[2], tuple) and p[2][:1] == ("object",)))
        for s, x, y in pairs:
            name = s.describe()
            if isinstance(x, tuple) and isinstance(y, tuple) and x[:1] == y[:1] == ("record",) \
                    and len(x[2]) == len(y[2]):   # (trackplan.record_key) the first attribute
                u, v = next((u, v) for u, v in zip(x[2], y[2]) if u != v)
                name, x, y = f"{name}.{u[0]}", _attr_kind(u), _attr_kind(v)
            return f"{name} {_show(x)} -> {_show(y)}" + (f" (read at {s.where})" if s.where else "")
        return None


def _attr_kind(part):
    """A record attribute's part of its key, as _show shows it."""
    return ("live tensor", *part[2:5]) if part[1] == "tensor" else ("number",) if part[1] == "number" else part[2]


# ---- finding sources -------------------------------------------------------------------
# Container methods that do not read the contents: a container only called with these is
# keyed by identity (a replay redoes appends: pyeffects.collect_appends; others are refused).
_CONTAINER_WRITES = frozenset({"append", "extend", "insert", "add", "update", "clear", "__setitem__"})


def find_sources(fn, max_depth: int = 3, modules=(), args=(), hooks=(), helpers=()) -> PyValues:
    """Sources read by ``fn`` and by the user functions / user-class methods it calls (and by
    the ``forward`` of user-defined classes among ``modules``, once per class)."""
    out: dict = {}
    seen: set = set()
    literals: set = set()
    const_stores: set = set()

    def visit(func, depth, bound=None, binds=None, self_is_record=False, name="partial", where="", origin=None):
        while isinstance(func, functools.partial):   # (``next_batch = partial(loader.next_batch, 2)``:
            kw = func.keywords                        # what it calls reads the loader and its data;
            binds = {**callslots.partial_binds(func, name), **(binds or {})}   # (``partial(loss_fn, cfg)``: cfg's too)
            _add(Source("object", kw, name + ".keywords", (), where), depth)   # (its keys, scalars' values)
            for k in kw:
                _add(Source("object", kw, name + ".keywords", (("item", k),), where), depth)
            func = func.func
        if isinstance(func, types.MethodType):
            bound, func = func.__self__, func.__func__
        func = unwrapped_function(func, bound)
        if not isinstance(func, types.FunctionType) or id(func.__code__) in seen or depth > max_depth:
            return
        code = func.__code__
        if not _user_code(code) and (core_file(code.co_filename) or depth > 0 and not func.__closure__):
            return   # (the compiled function or a package factory's closure is scanned: ignite's update)
        seen.add(id(code))
        literals.update(c for co in _all_code(code) for c in co.co_consts
                        if isinstance(c, (int, float)) and not isinstance(c, bool))
        const_stores.update(constant_stores(code))
        params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        stored = {x.argval for c in _all_code(code) for x in dis.get_instructions(c)
                  if x.opname in ("STORE_FAST", "DELETE_FAST")}
        if statement_calls(code, "print") and func.__globals__.get("print", builtins.print) is builtins.print:
            # (``print(f"loss {loss.item():.4f}")`` in the step: redone after each replay with that
            # replay's values, pycalls.py; it printed only at capture)
            s = modules_called.setdefault(("module", id(builtins)),
                                          Source("object", builtins, "builtins", (), code.co_filename))
            s.calls_only, s.methods = True, tuple(dict.fromkeys(s.methods + ("print",)))
        for op, name, path, line in _chains(code):
            where = f"{code.co_filename}:{line}"
            if op == "LOAD_GLOBAL":
                src = Source("global", func.__globals__, name, path, where)
            elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
                if name not in code.co_freevars or func.__closure__ is None:
                    continue
                src = Source("cell", func.__closure__[code.co_freevars.index(name)], name, path, where)
            elif name in params and name not in stored:
                idx = params.index(name)
                if binds and name in binds:
                    b = binds[name]
                    src = Source("object", b.root, b.name, b.path + path, where) if type(b) is callslots.Via \
                        else Source("object", b, name, path, where)
                elif bound is not None:
                    if idx == 0 and not self_is_record and origin is not None:
                        # (an argument's method: read from the object passed at each call --
                        # rooted at this one, a new loss object's ``self.scale`` read the old's)
                        src = Source(origin.kind, origin.root, origin.name, origin.path + path, where)
                    elif idx == 0 and not self_is_record:   # (a record's attributes: its parts)
                        src = Source("object", bound, name, path, where)
                    else:
                        continue  # arguments of a method called from the step: not ours to key
                elif depth == 0 and idx >= len(_DUMMY_ARGS) and callslots.has_default(func, name, idx):
                    # (a default the call leaves: state like a closure cell's, ``_state={"n": 0}``)
                    src = Source("cell", callslots.DefaultSlot(func, name, idx), name, path, where)
                elif depth == 0 and idx < code.co_argcount:
                    root = _DUMMY_ARGS[idx] if idx < len(_DUMMY_ARGS) else None
                    call = getattr(type(root), "__call__", None)
                    from .trackplan import plain_object
                    if not path and isinstance(call, types.FunctionType) and plain_object(root):
                        # (``loss_compute(out, y)``: what its ``__call__`` reads, from the object
                        # passed at each call -- keyed by what it holds, guards.instance_key)
                        visit(types.MethodType(call, root), depth + 1, origin=Source("arg", idx, name, (), where))
                        continue
                    if not path or root is None or isinstance(root, (torch.Tensor, list, tuple, dict) + _SCALARS) \
                            or input_array(root) or opened(root):
                        continue  # keyed by the argument guard (pytree leaves and values; arrays.py)
                    src = Source("arg", idx, name, path, where)
                else:
                    continue
            else:
                continue
            _add(src, depth)

    def _slot(s: Source):
        """A slot holding a function (or the environment): keyed by callslots.slot_key."""
        key = (s.kind, id(s.root) if s.kind != "arg" else s.root, s.name, s.path)
        v = s.read_or(_DUMMY_ARGS, _MISSING)
        if key not in slots and callslots.slot_key(v) == callslots.slot_key(s.read_or(_DUMMY_ARGS, _MISSING)):
            slots[key] = s   # (one that reads as a new object each time has no identity to key)

    def _add(src: Source, depth):
        if has_var(src.path):   # (TRL's ``self._metrics[mode][k].append(v)``: its keys after a call too)
            from .varitems import expand_into
            partial[0] |= expand_into(src, _DUMMY_ARGS, out, lambda s: _add(s, depth))
            return
        root = Source(src.kind, src.root, src.name).read_or(_DUMMY_ARGS) if src.path else None
        if src.path and library_module(root):
            for got in callslots.library_slots(src.path, root):   # (``F.cross_entropy`` patched; env)
                _slot(Source("object", os.environ, "os.environ", (), src.where) if got == ("env",)
                      else Source(src.kind, src.root, src.name, got, src.where))
            # ``math.pi``, ``np.e``: a library's constants (a live ``math.pi`` cut lr schedules);
            # ``logging.info(...)``, ``wandb.log(...)`` as statements: calls a replay redoes
            if src.path[-1][0] == "call" and len(src.path) <= 2:
                from .pycalls import library_calls
                library_calls(Source(src.kind, src.root, src.name, src.path[:-1], src.where),
                              src.path[-1][1], _DUMMY_ARGS, modules_called)
            return
        path, method, statement = src.path, None, False
        if path and path[-1][0] in ("method", "call"):
            path, method, statement = path[:-1], path[-1][1], path[-1][0] == "call"
        # Guard the longest prefix of the chain that resolves (``args.clip``, not ``args``).
        for p in _prefixes(path):
            s = Source(src.kind, src.root, src.name, p, src.where)
            if parametrized(s, _DUMMY_ARGS):
                continue   # (not read: the module holding it is the source)
            try:
                v, probe = s.read(_DUMMY_ARGS), False
            except Exception:  # noqa: BLE001
                v, probe = default_probe(s.path, Source(s.kind, s.root, s.name, s.path[:-1]).read_or(_DUMMY_ARGS, _MISSING)), True
                if v is _MISSING:
                    partial[0] = partial[0] or bool(p)   # (``self.last_loss = ...`` before its first call)
                    continue
            if p != () and type(v).__module__ == "numpy" and type(v).__name__ != "ndarray" \
                    and p[-1][0] == "item":
                continue   # (``cw[0]``: a numpy scalar made at each read; the array is the source)
            if p != () and p[-1] == ("attr", "grad") and (v is None or isinstance(v, torch.Tensor)):
                continue   # (``model.fc.weight.grad``: a parameter's grad is state, its slot's to guard and write)
            if callslots.is_env(v):
                _slot(Source("object", os.environ, "os.environ", (), s.where))
            if isinstance(v, callslots.SLOTS) and (s.kind != "global" or p or s.name in s.root):
                _slot(s)   # (a builtin, ``len``, found in no globals: not keyed)
            if isinstance(v, (types.FunctionType, types.MethodType, functools.partial)):
                # (``lc.compute``, an argument's bound method: its ``self`` read from each call's)
                origin = Source(s.kind, s.root, s.name, p[:-1]) if s.kind == "arg" and p and p[-1][0] == "attr" \
                    and type(v) is types.MethodType else None
                visit(v, depth + 1, name=s.describe().removeprefix("global "), where=s.where, origin=origin)
            elif p == path and method is not None and (callslots.instance_callable(v, method) is not None
                                                       or callslots.held_object(v, method)):
                # ``obj.criterion(o, y)``: a function, or a module / callable object, the object holds
                # (a trainer's ``self.criterion = crits[phase]`` swapped between live modules
                # replayed the first one, silently: only ``self`` was keyed)
                _add(Source(s.kind, s.root, s.name, p + (("attr", method),), s.where), depth)
            elif p == path and method == "apply" and (parts := autograd_parts(v)):   # (what ``Fn.apply`` runs)
                for f in parts:
                    visit(f, depth + 1)
            elif p == path and method is not None and not isinstance(v, (types.ModuleType, type)):
                m = getattr(type(v), method, None)   # a method called on a user object
                from .pycalls import replayable_callee   # (unless a replay redoes the call)
                if isinstance(m, types.FunctionType) and not (statement and replayable_callee(v, method)):
                    from .trackplan import record_key   # (meters['x'].update(): a record, by path)
                    visit(types.MethodType(m, v), depth + 1, self_is_record=record_key(v) is not None,
                          origin=s if s.kind == "arg" else None)
            elif not isinstance(v, (types.ModuleType, type, nn.Module)):
                call = getattr(type(v), "__call__", None)   # a callable user object
                if isinstance(call, types.FunctionType):   # (a record's too: ``loss_avg()``)
                    from .trackplan import record_key
                    visit(types.MethodType(call, v), depth + 1, self_is_record=record_key(v) is not None,
                          origin=s if s.kind == "arg" else None)
            key = (s.kind, id(s.root) if s.kind != "arg" else s.root, s.name, p)
            from .pycalls import replayable_callee
            calls.setdefault(key, []).append(method if p == path and statement and s.kind != "arg"
                                             and replayable_callee(v, method) else None)
            appends.setdefault(key, []).append(p == path and statement and method in ("append", "extend"))
            g = s.key_for(v) if s.kind == "arg" and not p else guard_value(v)
            if p == path and method in _CONTAINER_WRITES and isinstance(v, (list, dict, set, collections.deque)):
                # Only a method is called on it (``history.append(x)``): its identity matters,
                # not its contents (reading them is another instruction, keyed by value). A
                # method that reads them (``cfg.get(k)``, ``.items()``) is such a read.
                s.identity_only = True
                g = ("object", id(v))
            # A property that builds a new object at each read has no identity to guard.
            fresh = not probe and isinstance(g, tuple) and g[:1] == ("object",) and s.value(_DUMMY_ARGS) != g
            if g is not _SKIP and not fresh and not view_of_parent(s, v, _DUMMY_ARGS) \
                    and (key not in out or out[key].identity_only):
                out[key] = s
            break

    _DUMMY_ARGS = tuple(args)
    partial = [False]   # a chain that did not resolve whole: made by the step itself, maybe
    calls: dict = {}   # key -> the method each chain to it calls as a statement (None: another use)
    appends: dict = {}   # key -> per chain to it: an append or extend as a statement
    modules_called: dict = {}   # a library module's functions the step calls as statements
    slots: dict = {}   # key -> Source: slots holding a function, or the environment (callslots.py)
    # (first the helpers with what the step binds to them, callbinds.py; then the step; user code
    # library code calls; the hooks on the step's modules and parameters)
    for func, binds in list(helpers) + [(fn, None)] + list(getattr(fn, "_stepgraph_user_calls", ())) \
            + [(h, None) for h in hooks]:
        visit(func, 0 if func is fn else 1, binds=binds)
    classes: dict = {}   # class -> (the instance its forward was scanned with, the sources it gave)
    for m in modules:
        f = getattr(type(m), "forward", None)
        if type(m) not in classes and isinstance(f, types.FunctionType):
            before = set(out)
            visit(types.MethodType(f, m), 1)
            classes[type(m)] = (m, [out[k] for k in out if k not in before])
        elif type(m) in classes:   # (the same code reads the same attributes of this one: an EMA
            first, found = classes[type(m)]   # copy's helper method was keyed on the first only)
            for src in found:
                if src.kind == "object" and src._root_value(()) is first:
                    c = Source("object", m, src.name, src.path, src.where, from_step=src.from_step)
                    out.setdefault(("object", id(m), src.name, src.path), c)
    for key, s in out.items():
        s.methods = tuple(dict.fromkeys(m for m in calls.get(key, ()) if m))
        s.calls_only = bool(s.methods) and None not in calls[key]
        s.append_only = s.identity_only and all(appends.get(key, [False]))
    out.update(modules_called)
    pv = PyValues(list(out.values()), literals, const_stores, list(slots.values()),
                  tuple((s.describe(), s.where) for s in slots.values()))
    pv.scanned = pv.slots_key(_DUMMY_ARGS)
    pv.partial = partial[0]
    return pv
