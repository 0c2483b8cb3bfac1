"""Guards: a cheap signature of everything a captured graph assumed, and why two differ.

The signature is a flat tuple of sections, computed on every call and used as the key of the
graph cache. Each section has a name so a miss can be explained in one line, e.g.
``arg 0 (x) shape (8, 256) -> (4, 256)`` or ``opt.param_groups[0]['lr'] 0.1 -> 0.05``.
"""
from __future__ import annotations

import operator
import re
import weakref

import torch
import torch.utils._pytree as pytree

from .hostscalar import predicate_results
from .forward_attrs import module_sources
from .pyvalues import _MISSING, PyValues, find_sources, guard_value
from .pyeffects import (carried_element, live_input, live_tuple, rebound_names, source_id, state_free,
                        tensor_key)
from .trackplan import TrackPlan, key_of, number, plain_object, plan, record_key
from .groupwrites import held_ids
from .sigkey import GradsKey, Ident, Signature, SignatureKey, TensorMeta
from .optkeys import groups_quick, hyper_value, live_key, state_ids
from .state import StateRegistry, stateless_config
from .watch import registration_epoch
from ..errors import user_class
from .reasons import Reasons, leaf_names
from .livekeys import LiveKeys
from . import argtree
from .arrays import array_key, input_array

_STATE_TYPES = (torch.nn.Module, torch.optim.Optimizer)


def _grad_state(t: torch.Tensor) -> str:
    # A leaf input that requires grad gets .grad from the step's backward: whether it already
    # has one decides between "assign" and "accumulate", so it is part of the signature.
    if t.requires_grad and t.is_leaf:
        return "none" if t.grad is None else "tensor"
    return "-"


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    # requires_grad of a non-leaf input (a hidden state returned by the previous call, which a
    # replay hands back without autograd history) changes nothing the graph computes.
    return TensorMeta(type(t), t.dtype, t.device, tuple(t.shape), t.stride(), t.requires_grad and t.is_leaf,
                      _grad_state(t))


def cpu_generator(v) -> bool:
    """A CPU ``torch.Generator`` argument: keyed by kind, its state handed to the graph's own
    generator around each replay (CapturedStep.replay). By identity, a new Generator per call
    (``torch.Generator().manual_seed(seed + i)``) was a capture per call."""
    return isinstance(v, torch.Generator) and v.device.type == "cpu"


def _leaf_value(v, covered=frozenset()):
    if isinstance(v, torch.Tensor):
        return tensor_meta(v)
    if cpu_generator(v):
        return ("generator", "cpu")
    if number(v):
        return ("number",)  # its value and type: checked per graph, where used (tracked.py)
    if isinstance(v, torch.nn.Module):
        config = stateless_config(v)
        if config is not None:
            return ("stateless module", config)
    instance = instance_key(v, covered)
    if instance is not None:
        return instance
    if isinstance(v, _STATE_TYPES):
        # By identity, without holding it: a dropped model frees its graphs (runtime._prune)
        # before another object can reuse its id.
        return ("object", type(v), id(v))
    if isinstance(v, float) and v != v:
        return ("value", float, "nan")  # nan != nan: key it by name, or it never matches
    try:
        hash(v)
        return ("value", type(v), v)
    except TypeError:
        return ("object", type(v), Ident(v))


def instance_key(v, covered=frozenset(), depth: int = 0):
    """A plain object of the user's class passed as an argument (the Annotated Transformer's
    ``SimpleLossCompute(model.generator, criterion)``, made anew for each epoch), or an optimizer
    that is no state (its ``DummyOptimizer()`` for the eval epoch, which never ran
    ``Optimizer.__init__``): keyed by its class and what it holds, not by identity. By identity,
    every epoch was a warm-up and a capture, and eager past ``max_captures``.

    What it holds: modules and optimizers by identity (a module holding no tensors by its
    settings), tensors by metadata, plain objects of the user's class the same way, numbers,
    strings and small containers of them by value, anything else by identity. ``covered``: the
    attributes the step's code reads as sources of their own (pyvalues.py: ``self.scale`` read
    in ``__call__``, found again from each call's object, a float read live), keyed by type
    here. Keyed by type, an attribute read where no source is found (a method five calls deep,
    a module's forward given the object) was replayed with the first object's value (helper-71).
    None for any other value."""
    if isinstance(v, torch.optim.Optimizer) and not (hasattr(v, "state") and
                                                     all("params" in g for g in getattr(v, "param_groups", [{}]))):
        groups = getattr(v, "param_groups", None)
        return ("optimizer holding nothing", type(v), guard_value(groups) if isinstance(groups, list) else None)
    if not plain_object(v) or type(v).__eq__ is not object.__eq__ or type(v).__hash__ is not object.__hash__ \
            or len(vars(v)) > 64 or not all(user_class(c) for c in type(v).__mro__[:-1]):
        return None   # (a library base class's methods read it out of the sources' sight)
    parts = []
    for k, x in vars(v).items():
        if (k,) in covered and not isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
            parts.append((k, "read", type(x)))
        elif isinstance(x, torch.Tensor):
            parts.append((k, tensor_meta(x)))
        elif isinstance(x, torch.nn.Module):
            config = stateless_config(x)   # (held weakly: a dropped model frees its graphs)
            parts.append((k, "module", type(x), id(x)) if config is None else (k, "stateless module", config))
        elif isinstance(x, torch.optim.Optimizer):
            parts.append((k, "optimizer", type(x), id(x)))
        elif depth < 2 and (inner := instance_key(x, {c[1:] for c in covered if c[0] == k and len(c) > 1},
                                                  depth + 1)) is not None:
            parts.append((k, inner))
        else:
            parts.append((k, "value", guard_value(x)))
    return ("instance", type(v), tuple(parts))


def _covered(sources, args) -> dict:
    """Per argument object (by id), the attribute paths the step's code reads as sources of
    their own (``("loss", "alpha")`` for ``cfg.loss.alpha``)."""
    out: dict = {}
    for s in sources:
        if s.kind == "arg" and s.path and all(k == "attr" for k, _ in s.path) and s.root < len(args):
            out.setdefault(id(args[s.root]), set()).add(tuple(a for _, a in s.path))
    return out


def _where(s) -> tuple:
    root = s.root() if isinstance(s.root, weakref.ref) else s.root
    return s.kind, s.root if s.kind == "arg" else id(root), s.name, s.path


def _same(old, new):
    """``old`` (a Source found before at the same place) with what ``new`` found now: found
    again (after the warm-up, a model dropped), a source stays the same object, so what was
    decided about it stays (read live, keyed, its value at the warm-up)."""
    if old is None:
        return new
    kept = old.overwritten
    old.__dict__.update(new.__dict__)
    old.overwritten = old.overwritten or kept
    return old


def _found_again(old: PyValues, new: PyValues, args, keep: bool) -> None:
    """``new``'s sources found before stay the objects ``old`` had (_same). ``keep``: found
    again because a function the step calls was rebound (the eval epoch's
    ``DummyOptimizer().step``): what ``old`` had found stays too, in its order, what is new comes
    after -- the graphs of the other functions still match when those come back (found anew,
    every graph's key differed: the Annotated Transformer never replayed)."""
    before = {_where(s): s for s in old.sources}
    if not keep:
        new.sources = [_same(before.pop(_where(s), None), s) for s in new.sources]
        return
    found = {_where(s): s for s in new.sources}
    new.sources = [s if (n := found.pop(w, None)) is None else _same(s, n) for w, s in before.items()] \
        + list(found.values())
    slots = dict(zip(old.names, old.callables))
    slots.update((n, c) for n, c in zip(new.names, new.callables) if n not in slots)
    new.callables, names = list(slots.values()), tuple(slots)
    new.names = old.names if names == old.names else names
    new.scanned = new.slots_key(args)


def _opened_inputs(values, args) -> set:
    """Ids of the sources reading a tensor attribute of an argument opened like a batch
    (``train_state.tokens``, found when the TrainState held no tensor): that tensor is a leaf
    of the arguments, an input of the graph, keyed by metadata there; by identity here, a new
    TrainState each epoch was a new graph."""
    return {id(s) for s, v in values if s.kind == "arg" and len(s.path) == 1 and type(v) is torch.Tensor
            and s.root < len(args) and argtree.opened(args[s.root])}


def _quick_state(a):
    """A state object by identity; a module holding no tensors by its settings (a new
    ``nn.CrossEntropyLoss()`` per call can take the freed one's id: by id, a call with other
    settings replayed the old graph)."""
    config = stateless_config(a)
    return id(a) if config is None else config


def _module_key(key, v, held: frozenset):
    """A module holding no tensors that is not the state found (a global ``criterion``
    rebound to a new ``nn.CrossEntropyLoss(label_smoothing=s)`` in the loop): keyed by its
    settings, as an argument's is. By identity, every new one recaptured, and its settings
    changed later were not guarded: its forward was never read."""
    if isinstance(v, torch.nn.Module) and isinstance(key, tuple) and key[:1] == ("object",) and id(v) not in held:
        config = stateless_config(v)
        if config is not None:
            return ("stateless module", config)
    return key


def _spec_key(spec):
    try:
        hash(spec)
        return spec
    except TypeError:
        return str(spec)


class Guards(Reasons, LiveKeys):
    """Builds call signatures for one step function's reachable state."""

    def __init__(self, reg: StateRegistry, arg_names: list[str]):
        self.reg = reg
        self.arg_names = arg_names
        self._training = operator.attrgetter("training")
        self._grad = operator.attrgetter("grad")
        self.live: set = set()   # (optimizer index, group index, key) or Source read live by the graphs
        self.preds: dict = {}    # live value -> ((path, op, constant), ...) the graphs branched on
        self.py = PyValues()     # Python values the step's code reads (pyvalues.py)
        self.keyed: set = set()  # sources a graph baked without tracking them: keyed by value
        self.rebound: frozenset = frozenset()   # what the step's code assigns (pyeffects.rebound_names)
        self.arrays_read: set = set()  # leaf positions of input arrays the step read in Python (arrays.py)
        self._fn = None
        self.filled, self.helper_calls = [], []   # (pybefore.filled_defaults; callbinds.recording)

    def find_python_values(self, fn, args, keep: bool = False) -> None:
        """(Re)read which Python values the step reads: at the first call and whenever the
        state found changes (a new model passed as an argument); ``keep``: see _found_again."""
        names = {id(m): (f"{root}.{k}" if k else root) for root, mod in self.reg.modules
                 for k, m in mod.named_modules()}
        self._fn = fn   # (found again when a function it calls is rebound: signature)
        old = self.py
        self.py = find_sources(fn, modules=self.reg.all_modules, args=args, hooks=self.reg.user_hooks(),
                               helpers=self.helper_calls)
        self.scanned_hooks = self.reg.hook_key()   # (a hook registered since: scanned again, runtime.py)
        self.rebound = rebound_names(fn)   # (a recurrent state's tuple: pyeffects.live_tuple)
        self.py.sources += module_sources(self.reg.all_modules, names)
        _found_again(old, self.py, args, keep)

    def _py_key(self, args) -> tuple:
        live = self.live
        skip = live | self.keyed if self.keyed else live
        known, held_modules = self.reg.names, self.reg.module_ids
        # (a live variable holding no float now -- ``loss_ema = None`` at an epoch's start --
        # is keyed by value: a graph reading it live would read that None)
        # (the step's own ``opt.param_groups[0]["lr"]`` holding the device tensor stepgraph made
        # of it on the GPU: the hyper-parameter part of the key has it; keyed here by metadata,
        # then by identity once the capture knew it, it recaptured once for nothing)
        held = held_ids(self.reg)
        values = [(s, s.read_or(args, _MISSING)) for s in self.py.sources]
        # (a carried tuple, and its elements the step's code reads by index: ``mems[0]``)
        carried = {source_id(s) for s, v in values if live_tuple(s, v, args, known, self.rebound)}
        opened = _opened_inputs(values, args)
        return tuple(self._marker(s, v) if s in live and isinstance(v, float)
                     else ("device hyper-parameter",) if id(v) in held
                     else tensor_key(v) if not s.overwritten and (live_input(s, v, args, known, self.rebound) or id(s) in opened
                                            or carried and (source_id(s) in carried
                                                            or type(v) is torch.Tensor and carried_element(s, carried)))
                     else _module_key(state_free(key_of(s, v, args, skip), v, known), v, held_modules)
                     for s, v in values)

    def _marker(self, h, value):
        """A live value's part of a signature: only what the graphs decided from it."""
        p = self.preds.get(h)
        return "<live>" if not p else ("<live>", predicate_results(value, p))

    def tracking(self, args, kwargs) -> TrackPlan:
        """The numbers a capture of this call tracks (trackplan.py)."""
        leaves = argtree.leaves(args, kwargs)
        labels = [re.sub(r"^arg \d+ \((\w+)\)", r"\1", n) for n in leaf_names(self.arg_names, args, kwargs)]
        track = plan(self.py.sources, leaves, labels, args, self.live | self.keyed,
                     self.reg.slots() + self.reg.number_slots(self.live))
        track.const_stores = self.py.const_stores
        return track

    def pin_objects(self, args) -> bool:
        """Objects that hold more than numbers and strings (a meter holding tensors) are keyed by
        identity from now on, even when a fresh one holds only numbers: a meter that starts at
        ``sum = 0`` and holds a tensor after its first update would otherwise change key twice.
        True when the key changed."""
        new = {s for s in self.py.sources if s.from_step and s not in self.keyed
               and not number(v := s.read_or(args)) and plain_object(v) and record_key(v) is None}
        self.keyed |= new
        return bool(new)

    def quick_key(self, args, kwargs) -> tuple:
        """A cheap key compared by ``==`` with the last replayed call's (never hashed).

        It holds the objects themselves, so tuple equality short-circuits on identity: the
        same parameter-group dicts' values, the same ``.grad`` objects (or None), the same
        input metadata. Any difference falls back to the full signature; equality here
        implies equal full signatures.
        """
        reg = self.reg
        ins = tuple((type(a), a.dtype, a.device, a.shape, a.stride(), a.requires_grad and a.is_leaf,
                     a.requires_grad and a.is_leaf and a.grad is None)
                    if isinstance(a, torch.Tensor) else array_key(a, i in self.arrays_read) if input_array(a)
                    else (type(a), None if number(a) else _quick_state(a) if isinstance(a, _STATE_TYPES) else a)
                    for i, a in enumerate(args))
        return (
            ins,
            len(set(map(id, args))),  # aliasing: the same tensor passed twice
            tuple(kwargs.items()) if kwargs else (),
            torch.is_grad_enabled(),
            _autocast_state(),
            tuple(map(self._training, reg.all_modules)),
            groups_quick(self),
            tuple((opt.state, len(opt.state), state_ids(opt, reg.numeric_state)) for _, opt in reg.optimizers),
            registration_epoch(),
            tuple(p.requires_grad for _, p in reg.params),
            GradsKey(tuple(map(self._grad, reg.grad_params)), tensor_meta),
            reg.hook_key(),
            self._py_key(args),
            self.py.slots_key(args),
        )

    def signature(self, args, kwargs) -> Signature:
        reg = self.reg
        requires = tuple(p.requires_grad for _, p in reg.params)
        if requires != reg.requires_grad:   # a layer frozen/unfrozen: grad_params follow it
            reg.refresh_names()
        leaves, spec = argtree.flatten(args, kwargs)   # (batch objects opened)
        # (numpy arrays are graph inputs too: arrays.py)
        tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) or input_array(x)]
        inputs = _inputs(self, leaves, args)
        ids = [id(leaves[i]) for i in tensor_pos]
        alias = tuple(ids.index(i) for i in ids) if len(set(ids)) != len(ids) else ()
        reg = self.reg
        slots = _slots_now(self, args)
        key = SignatureKey(
            _spec_key(spec),
            inputs,
            alias,
            torch.is_grad_enabled(),
            _autocast_state(),
            tuple(m.training for m in reg.all_modules),
            tuple(tuple(tuple((k, live_key(self, (oi, gi, k), v) if (oi, gi, k) in self.live else hyper_value(v))
                              for k, v in g.items() if k != "params")
                        + (("#params", len(g["params"])),) for gi, g in enumerate(opt.param_groups))
                  for oi, (_, opt) in enumerate(reg.optimizers)),
            # (the per-parameter dicts too: ``opt.state.clear()`` refilled by the next step has the
            # same dict and length, and replayed the first graph on the dropped tensors)
            tuple((id(opt.state), len(opt.state), state_ids(opt, reg.numeric_state)) for _, opt in reg.optimizers),
            registration_epoch(),
            requires,
            tuple(None if p.grad is None else tensor_meta(p.grad) for p in reg.grad_params),
            reg.hook_key(),
            self._py_key(args),
            slots,
        )
        return Signature(key, leaves, tensor_pos)

    def arrays_were_read(self, positions, sig: Signature) -> Signature:
        """The step read these input arrays in Python: keyed by value (arrays.array_key) from now on."""
        self.arrays_read |= set(positions)
        return Signature(sig.key._replace(inputs=tuple(array_key(x, True) if i in self.arrays_read and input_array(x)
                                                       else k for i, (x, k) in enumerate(zip(sig.leaves, sig.key.inputs)))),
                         sig.leaves, sig.tensor_pos)


def _inputs(self: Guards, leaves, args) -> tuple:
    covered = _covered(self.py.sources, args)
    return tuple(array_key(x, i in self.arrays_read) if input_array(x) else
                 _leaf_value(x, covered.get(id(x), frozenset())) for i, x in enumerate(leaves))


def _slots_now(self: Guards, args) -> tuple:
    """The ``callables`` section now. A function the step calls was rebound (callslots.py): what
    the new one reads is found first; the key differs, so the change recaptures, explained here."""
    slots = self.py.slots_key(args)
    if slots != self.py.scanned and self._fn is not None:
        self.find_python_values(self._fn, args, keep=True)
        slots = self.py.slots_key(args)
    return slots


def _autocast_state() -> tuple:
    out = []
    for dev in ("cpu", "cuda"):
        on = torch.is_autocast_enabled(dev)
        out.append((on, torch.get_autocast_dtype(dev) if on else None))
    out.append(torch.is_autocast_cache_enabled())
    return tuple(out)


def arg_names(fn) -> list[str]:
    """Positional parameter names of ``fn`` (best effort, for messages)."""
    import inspect
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []
