"""Find the state a step function touches (modules, optimizers) and name every tensor by source.

State is found by walking what the function can reach: its closure, the globals its code
names (and those of plain functions it calls), the ``self`` of a bound method, one level of
attributes and containers. Tensors the trace meets that are not found here still work (they
are graph constants); they are only named ``<constant #k>``.
"""
from __future__ import annotations

import inspect
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .fsdp import fsdp_modules
from .stateholding import HookWatching, WeakHolding


@dataclass
class Slot:
    """A place in the user's objects that holds a tensor and may be rebound by the step."""
    kind: str          # "grad" | "buffer" | "optstate" | "group" (a group's int, an optimizer attribute: number_slots)
    source: str
    owner: object      # the Parameter (grad), the Module (buffer), the per-param state dict
    key: object = None

    def get(self):
        return self.owner.grad if self.kind == "grad" else self.owner._buffers.get(self.key) \
            if self.kind == "buffer" else self.owner.get(self.key)

    def set(self, value) -> None:
        if self.kind == "grad":
            self.owner.grad = value
        elif self.kind == "buffer":
            self.owner._buffers[self.key] = value
        elif value is None:
            self.owner.pop(self.key, None)
        else:
            self.owner[self.key] = value


@dataclass
class StateRegistry(WeakHolding, HookWatching):
    """The modules, optimizers and tensors a step reaches, each tensor named by its source."""
    names: dict = field(default_factory=dict)          # id(tensor) -> source
    params: list = field(default_factory=list)         # (source, Parameter), unique
    grad_params: list = field(default_factory=list)    # params that require grad, in params order
    requires_grad: tuple = ()   # each param's requires_grad when grad_params was read
    module_hook_dicts: list = field(default_factory=list)  # the step's modules' hook OrderedDicts
    pre_hooked: list = field(default_factory=list)     # params that had hooks when first watched
    _seen: set = field(default_factory=set)
    pre_hooked_dicts: list = field(default_factory=list)  # hook dicts of modules hooked when first seen
    device_hypers: list = field(default_factory=list)  # (group, key, tensors) held on the GPU
    numeric_state: frozenset = frozenset()   # ids of optimizers with a number in opt.state (optkeys.state_ids)
    # Models and optimizers found through the call's arguments or the step's code are held
    # weakly: when the user drops them, ``on_death`` lets the step free its graphs (which hold
    # their tensors). Only what ``state=`` names is held strongly.
    weak_ids: set = field(default_factory=set)
    on_death: object = None
    _mods: list = field(default_factory=list)          # (name, holder) of modules
    _opts: list = field(default_factory=list)          # (name, holder) of optimizers
    _all: list = field(default_factory=list)           # (None, holder) of every submodule
    _ddp: list = field(default_factory=list)           # (name, holder) of DistributedDataParallel modules
    _fsdp: list = field(default_factory=list)          # (name, holder) of fully_shard (FSDP2) modules
    collective_groups: list = field(default_factory=list)  # process groups of dist.all_reduce & co. in the step
    _all_plain: list | None = None                     # all_modules when none is held weakly
    # Leaf tensors that require grad, reached by the step's code outside any module or optimizer
    # (makemore's ``parameters = [C, W1, b1, W2, b2]``): parameters too, their .grad a slot.
    loose: list = field(default_factory=list)          # (source, tensor)
    module_ids: frozenset = frozenset()                # id of every module held (guards._module_key)
    module_counters: list = field(default_factory=list)  # (weakref, name): library modules' ints (modstate.py)

    @classmethod
    def of_optimizers(cls, optimizers) -> "StateRegistry":
        """A registry of just these ``(name, optimizer)`` pairs (tests' eager twins)."""
        reg = cls()
        reg.optimizers = list(optimizers)
        return reg

    def prune(self) -> None:
        """Forget dropped models and optimizers and everything found through them."""
        self._mods = [(n, h) for n, h in self._mods if h() is not None]
        self._opts = [(n, h) for n, h in self._opts if h() is not None]
        self.weak_ids = {id(h()) for _, h in self._mods + self._opts if isinstance(h, weakref.ref)}
        self.refresh_names()
        live = {id(p) for _, p in self.params} | {id(m) for m in self.all_modules}
        self._seen &= live
        self.pre_hooked = [p for p in self.pre_hooked if id(p) in live]
        groups = {id(g) for _, o in self.optimizers for g in o.param_groups}
        self.device_hypers = [h for h in self.device_hypers if id(h[0]) in groups]

    def name_of(self, t) -> str | None:
        return self.names.get(id(t))

    def refresh_names(self) -> None:
        """Re-read every source (cheap); run before each capture since state may be new."""
        self.names.clear()
        self.params.clear()
        subs = []
        seen_mod = set()
        for mname, mod in self.modules:
            for sub in mod.modules():
                if id(sub) not in seen_mod:
                    seen_mod.add(id(sub))
                    subs.append(sub)
            for pname, p in mod.named_parameters(remove_duplicate=True):
                if id(p) not in self.names:
                    self.names[id(p)] = f"{mname}.{pname}"
                    self.params.append((f"{mname}.{pname}", p))
            for bname, b in mod.named_buffers(remove_duplicate=True):
                self.names.setdefault(id(b), f"{mname}.{bname}")
        for oname, opt in self.optimizers:
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    if id(p) not in self.names:
                        src = f"{oname}.param_groups[{gi}]['params'][{pi}]"
                        self.names[id(p)] = src
                        self.params.append((src, p))
                for k, v in group.items():
                    if isinstance(v, torch.Tensor):
                        self.names.setdefault(id(v), f"{oname}.param_groups[{gi}]['{k}']")
            for p, st in opt.state.items():
                if not isinstance(st, dict):   # (MADGRAD's ``self.state['k'] = torch.tensor([0])``)
                    if isinstance(st, torch.Tensor):
                        self.names.setdefault(id(st), f"{oname}.state[{p!r}]")
                    continue
                pn = self.names.get(id(p), "?")
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        self.names.setdefault(id(v), f"{oname}.state[{pn}]['{k}']")
        for tname, t in self.loose:
            if id(t) not in self.names:
                self.names[id(t)] = tname
                self.params.append((tname, t))
        self.grad_params = [p for _, p in self.params if p.requires_grad]
        self.numeric_state = frozenset(id(opt) for _, opt in self.optimizers
                                       if any(type(v) is int or type(v) is float for v in opt.state.values()))
        self.requires_grad = tuple(p.requires_grad for _, p in self.params)
        self._all = [(None, self._hold(m)) for m in subs]
        self.module_ids = frozenset(map(id, subs))
        self._all_plain = subs if not any(id(m) in self.weak_ids for m in subs) else None
        ddp_type = getattr(nn.parallel, "DistributedDataParallel", ())
        self._ddp = [(mname + (f".{sub}" if sub else ""), self._hold(m)) for mname, mod in self.modules
                     for sub, m in mod.named_modules() if isinstance(m, ddp_type)]
        self._fsdp = [(n, self._hold(m)) for n, m in fsdp_modules(self.modules)]
        self._watch_hooks(subs)

    def slots(self, extra_params=()) -> list[Slot]:
        """Every rebindable tensor slot: grads, buffers, optimizer state entries."""
        out = []
        seen = set()
        params = list(self.params) + [(self.names.get(id(p), f"<param #{i}>"), p)
                                      for i, p in enumerate(extra_params)]
        # (a parameter an optimizer steps is trainable even while the step has it frozen:
        # pix2pix's set_requires_grad(netD, False) at the end of the step, True at its start.
        # Without its slot the grads its backward made were never written back: stale .grad)
        stepped = {id(q) for _, opt in self.optimizers for g in opt.param_groups for q in g["params"]}
        for src, p in params:
            if id(p) in seen or not (p.requires_grad or p.grad is not None or id(p) in stepped):
                continue
            seen.add(id(p))
            out.append(Slot("grad", f"{src}.grad", p))
        for mname, mod in self.modules:
            for sname, sub in mod.named_modules(remove_duplicate=True):
                for bname in list(sub._buffers):
                    pre = f"{mname}.{sname}." if sname else f"{mname}."
                    out.append(Slot("buffer", pre + bname, sub, bname))
        for oname, opt in self.optimizers:
            # (an entry of the optimizer's own, not a parameter's: MADGRAD's ``state['k']``, SPAM's
            # ``state['total_step']``; a number there is a counter, trackplan.TrackPlan.counters)
            out += [Slot("optstate", f"{oname}.state[{k!r}]", opt.state, k) for k, v in list(opt.state.items())
                    if not isinstance(v, dict) and not isinstance(k, torch.Tensor)]
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    st = opt.state.get(p)
                    if st is None:
                        continue
                    pn = self.names.get(id(p), "?")
                    for k in list(st):
                        out.append(Slot("optstate", f"{oname}.state[{pn}]['{k}']", st, k))
        return out

    def number_slots(self, live=frozenset()) -> list[Slot]:
        return number_slots(self, live)


def number_slots(reg, live=frozenset()) -> list[Slot]:
    """The param-group entries held as plain ints (Adan's ``group['step'] += 1``), the optimizers' own
    number attributes (AdaLOMO's ``reg.num_steps += 1``: no guard saw it, replays kept the capture's
    count -- silently wrong) and library modules' counters (modstate.py): tracked numbers, as a
    per-parameter ``state['step']`` is (trackplan.TrackPlan.counters); ``live``: read live instead."""
    out = [Slot("group", f"{oname}.param_groups[{gi}]['{k}']", group, k)
           for oi, (oname, opt) in enumerate(reg.optimizers) for gi, group in enumerate(opt.param_groups)
           for k, v in list(group.items()) if group_counter(v) and (oi, gi, k) not in live]
    return out + [Slot("group", f"{oname}.{k}", d, k) for oname, opt in reg.optimizers
                  for d in [getattr(opt, "__dict__", None)] if isinstance(d, dict)
                  for k, v in list(d.items()) if type(v) in (int, float)] \
        + [Slot("group", f"{type(m).__name__}.{k}", vars(m), k) for r, k in reg.module_counters
           for m in [r()] if m is not None and type(vars(m).get(k)) in (int, float)]


def group_counter(v) -> bool:
    """A param-group value tracked as a number, not keyed by its value: a plain int (not a
    bool; floats are hyper-parameters, read live or keyed: livefloats.py)."""
    return type(v) is int


def _walk_step(fn) -> dict:
    found: dict = {}   # (and the user code a library step calls: Lightning's training_step)
    for f in [fn] + [f for f, _ in getattr(fn, "_stepgraph_user_calls", ())]:
        _walk_function(f, found)
    return found


def _walk_function(fn, found: dict, depth: int = 0) -> None:
    if depth > 2:
        return
    if isinstance(fn, types.MethodType):
        _consider("self", fn.__self__, found, depth)
        fn = fn.__func__
    if isinstance(fn, nn.Module):
        return _consider("model", fn, found, depth)
    if not isinstance(fn, types.FunctionType):
        return _consider("self", fn, found, depth) if callable(fn) and not isinstance(fn, type) else None
    try:
        cv = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return
    defaults = dict(zip(fn.__code__.co_varnames[fn.__code__.co_argcount - len(fn.__defaults__ or ()):],
                        fn.__defaults__ or ())) | (fn.__kwdefaults__ or {})   # (``def step(x, lf=lf)``)
    for name, val in list(cv.nonlocals.items()) + list(cv.globals.items()) + list(defaults.items()):
        # (and ``update_metrics = holder.update_metrics``: its object, and the metrics its code reads)
        if isinstance(val, types.FunctionType) and val is not fn or isinstance(val, types.MethodType) \
                and isinstance(val.__func__, types.FunctionType):
            _walk_function(val, found, depth + 1)
        else:
            _consider(name, val, found, depth)


_MODULE_OWN = frozenset(vars(nn.Module()))   # nn.Module's own bookkeeping (hooks, training, ...)


def stateless_config(m) -> tuple | None:
    """A module holding no tensors (``nn.CrossEntropyLoss()``, ``nn.ReLU()``), made anew at each
    call (``loss = step(model, nn.CrossEntropyLoss(), x, y)``): its configuration, which is all
    a graph depends on -- every plain attribute, private ones too (``self._scale``); None for a
    module with parameters, buffers, hooks or an attribute with no value to compare. Such a
    module is no state: keyed by this, not identity (each new one was a warm-up and a capture:
    the step never replayed, with no warning)."""
    if not isinstance(m, nn.Module):
        return None
    out = []
    for name, sub in m.named_modules():
        items = []
        for k, v in vars(sub).items():
            if k in ("_parameters", "_buffers"):
                if any(t is not None for t in v.values()):
                    return None
            elif k in _MODULE_OWN:
                if isinstance(v, (dict, set)) and v and k != "_modules":
                    return None   # (hooks: each module object its own)
            elif isinstance(v, (bool, int, float, str, type(None))):
                items.append((k, v))
            else:
                return None
        out.append((name, type(sub), sub.training, tuple(sorted(items))))
    return tuple(out)


def _consider(name: str, obj, found: dict, depth: int, leaf: bool = False) -> None:
    """``leaf``: ``obj`` is a leaf of the call's arguments (or inside a list, tuple or dict of
    them), which the signature keys by value."""
    if leaf and isinstance(obj, nn.Module) and stateless_config(obj) is not None:
        # (keyed by its configuration, guards._leaf_value: a new one per call is no new state.
        # One the step reaches otherwise -- closure, globals, an object's attribute -- is state:
        # its forward's reads are guarded (forward_attrs.py) and its train/eval keyed; skipped,
        # a loop's ``criterion.label_smoothing = 0.3`` was replayed with the old value)
        return
    if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        found.setdefault(id(obj), (name, obj))
        if isinstance(obj, nn.Module) and depth <= 1:
            # An optimizer the model owns (an agent's self.optimizer, forward-forward's
            # Layer.opt, layers kept in a plain list): missed, its lr would be baked.
            for k, v in list(vars(obj).items())[:64]:
                if not k.startswith("_") and isinstance(v, (torch.optim.Optimizer, list, tuple, dict)):
                    _consider(f"{name}.{k}", v, found, depth + 1)
        return
    if isinstance(obj, torch.Tensor) and depth <= 1 and obj.is_leaf and obj.requires_grad:
        found.setdefault(id(obj), (name, obj))   # a bare parameter (StateRegistry.loose)
        return
    if depth > 1 or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.Tensor, type,
                                     types.ModuleType, types.FunctionType)):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj[:64]):
            _consider(f"{name}[{i}]", v, found, depth + 1, leaf)
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:64]:
            if isinstance(k, str):
                _consider(f"{name}[{k!r}]", v, found, depth + 1, leaf)
        return
    opt = getattr(obj, "optimizer", None)  # LR schedulers, GradScaler-like holders
    if isinstance(opt, torch.optim.Optimizer):
        found.setdefault(id(opt), (f"{name}.optimizer", opt))
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and depth <= 1:
        # (an argument keyed by what it holds, guards.instance_key: a module of it holding no
        # tensors is keyed by its settings there, as an argument's own is: no state)
        leaf = leaf and depth == 0 and type(obj).__hash__ is object.__hash__
        for k, v in list(d.items())[:64]:
            if isinstance(v, (nn.Module, torch.optim.Optimizer, list, tuple, dict)):
                _consider(f"{name}.{k}", v, found, depth + 1, leaf and isinstance(v, nn.Module))


def _arg_objects(args, kwargs, arg_names=()) -> list:
    """(name, object) of the step's arguments, named as the user's parameters are."""
    out = [(arg_names[i] if i < len(arg_names) else f"arg{i}", a) for i, a in enumerate(args)]
    out += [(k, v) for k, v in (kwargs or {}).items()]
    return out


def _found_to_registry(found: dict, reg: "StateRegistry", weak=()) -> bool:
    """Put newly found modules/optimizers into ``reg``; True when anything was added."""
    have = {id(m) for _, m in reg.modules} | {id(o) for _, o in reg.optimizers}
    inside = {id(s) for _, m in reg.modules for s in m.modules()}
    mods = [(n, o) for n, o in found.values() if isinstance(o, nn.Module) and id(o) not in have]
    # Drop modules that are submodules of another found module: their tensors get the longer name.
    sub_ids = {id(s) for _, m in mods for s in list(m.modules())[1:]} | inside
    new_mods = [(n, m) for n, m in mods if id(m) not in sub_ids]
    # (an Optimizer subclass that never ran Optimizer.__init__ -- the Annotated Transformer's
    # DummyOptimizer for its eval epoch, ``param_groups = [{"lr": 0}]`` -- updates nothing:
    # not state; its param groups crashed the registry with KeyError 'params')
    new_opts = [(n, o) for n, o in found.values() if isinstance(o, torch.optim.Optimizer) and id(o) not in have
                and hasattr(o, "state") and all("params" in g for g in getattr(o, "param_groups", [{}]))]
    loose = {id(t) for _, t in reg.loose}
    new_loose = [(n, t) for n, t in found.values() if isinstance(t, torch.Tensor) and id(t) not in loose]
    if not new_mods and not new_opts and not new_loose:
        return False
    reg.loose += new_loose
    # (a module holding no tensor is held: its death frees nothing, and a loss module made anew at
    # each call, keyed by its settings, would drop every graph at each call)
    reg.weak_ids |= {id(o) for _, o in new_mods + new_opts if id(o) in weak and _holds_tensors(o)}
    # A found module that contains an already known one takes its place (longer names).
    new_inside = {id(s) for _, m in new_mods for s in m.modules()}
    reg.modules = [(n, m) for n, m in reg.modules if id(m) not in new_inside] + new_mods
    reg.optimizers += new_opts
    reg.refresh_names()
    return True


def _holds_tensors(o) -> bool:
    if not isinstance(o, nn.Module):
        return True
    return next(o.parameters(), None) is not None or next(o.buffers(), None) is not None


def discover(fn, extra=(), args=(), kwargs=None, arg_names=()) -> StateRegistry:
    """Find modules and optimizers reachable from ``fn`` and from this call's arguments (plus
    ``extra`` objects given by the user): a model passed as ``step(model, opt, x, y)`` is state
    exactly as one read from a closure."""
    found: dict = {}
    for i, obj in enumerate(extra):
        _consider(f"state[{i}]" if not isinstance(obj, tuple) else obj[0],
                  obj if not isinstance(obj, tuple) else obj[1], found, 0)
    held = set(found)   # what the user's state= names: held strongly
    for name, obj in _arg_objects(args, kwargs, arg_names):
        _consider(name, obj, found, 0, leaf=True)
    found = {k: v for k, v in found.items() if not isinstance(v[1], torch.Tensor)}  # (arguments: inputs)
    via_code = _walk_step(fn)
    # (what the step's code reaches is weak too: a global ``model`` rebound per k-fold fold kept
    # every earlier fold's model, optimizer state and graphs alive, and its parameters in the
    # guards, until every call ran eagerly; the global or cell holds the one in use)
    for k, v in via_code.items():
        found.setdefault(k, v)
    reg = StateRegistry()
    _found_to_registry(found, reg, weak=set(found) - held) or reg.refresh_names()   # (an empty one: the hook dicts)
    return reg


def adopt_code(reg: StateRegistry, fn) -> bool:
    """Add modules/optimizers the step's code reaches now that ``reg`` does not know (a global
    ``model`` rebound to a new one: k-fold cross-validation, a restart). True when it changed."""
    # (a module holding no tensor is keyed by its settings where the code reads it: no state)
    via_code = {k: v for k, v in _walk_step(fn).items() if _holds_tensors(v[1])}
    return bool(via_code) and _found_to_registry(via_code, reg, weak=set(via_code))


def adopt_arguments(reg: StateRegistry, args, kwargs, arg_names=()) -> bool:
    """Add modules/optimizers this call passes as arguments that ``reg`` does not know yet
    (a step called with another model). True when the registry changed."""
    found: dict = {}
    for name, obj in _arg_objects(args, kwargs, arg_names):
        if not isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
            _consider(name, obj, found, 0, leaf=True)
    found = {k: v for k, v in found.items() if not isinstance(v[1], torch.Tensor)}  # (inputs)
    return bool(found) and _found_to_registry(found, reg, weak=set(found))
