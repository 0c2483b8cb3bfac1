"""Guards: a cheap signature of everything a captured graph assumed, and why two differ.

The signature is a flat tuple of sections, computed on every call and used as the key of the
graph cache. Each section has a name so a miss can be explained in one line, e.g.
``arg 0 (x) shape (8, 256) -> (4, 256)`` or ``opt.param_groups[0]['lr'] 0.1 -> 0.05``.
"""
from __future__ import annotations

from dataclasses import dataclass

import operator
import re

import torch
import torch.utils._pytree as pytree

from .hostscalar import LIVE_HYPERS, predicate_results
from .pyvalues import _MISSING, PyValues, find_sources, module_sources
from .pyeffects import live_tensor, state_free, tensor_key
from .trackplan import TrackPlan, key_of, number, plain_object, plan, record_key
from .sigkey import DIFF_ORDER, SECTION_NAMES, SignatureKey, TensorMeta
from .state import StateRegistry
from .watch import registration_epoch

_STATE_TYPES = (torch.nn.Module, torch.optim.Optimizer)
_TENSOR_FIELDS = ("type", "dtype", "device", "shape", "stride", "requires_grad", ".grad")


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


def _hyper_value(v):
    if isinstance(v, torch.Tensor):
        # A tensor hyper-parameter (lr=torch.tensor(...)) is read by the graph at replay time:
        # only its identity and metadata are baked.
        return ("tensor", id(v), v.dtype, v.device, tuple(v.shape))
    if isinstance(v, list):
        return tuple(_hyper_value(x) for x in v)
    return v


def _leaf_value(v):
    if isinstance(v, torch.Tensor):
        return tensor_meta(v)
    if number(v):
        return ("number",)  # its value and type: checked per graph, where used (tracked.py)
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
        return ("object", type(v), id(v))


def _spec_key(spec):
    try:
        hash(spec)
        return spec
    except TypeError:
        return str(spec)


@dataclass
class Signature:
    """The guard key of one call; ``key`` is hashed, the rest explains a miss."""
    key: SignatureKey
    leaves: list
    tensor_pos: list


class Guards:
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

    def find_python_values(self, fn, args) -> None:
        """(Re)read which Python values the step reads: at the first call and whenever the
        state found changes (a new model passed as an argument)."""
        names = {id(m): (f"{root}.{k}" if k else root) for root, mod in self.reg.modules
                 for k, m in mod.named_modules()}
        self.py = find_sources(fn, modules=self.reg.all_modules, args=args)
        self.py.sources += module_sources(self.reg.all_modules, names)

    def _py_key(self, args) -> tuple:
        live = self.live
        skip = live | self.keyed if self.keyed else live
        known = self.reg.names
        return tuple(self._marker(s, v) if s in live
                     else tensor_key(v) if type(v) is torch.Tensor and live_tensor(s, v, args, known)
                     else state_free(key_of(s, v, args, skip), v, known)
                     for s in self.py.sources for v in (s.read_or(args, _MISSING),))

    def _marker(self, h, value):
        """A live value's part of a signature: only what the graphs decided from it."""
        p = self.preds.get(h)
        return "<live>" if not p else ("<live>", predicate_results(value, p))

    def tracking(self, args, kwargs) -> TrackPlan:
        """The numbers a capture of this call tracks (trackplan.py)."""
        leaves = pytree.tree_leaves((args, kwargs))
        labels = [re.sub(r"^arg \d+ \((\w+)\)", r"\1", n) for n in leaf_names(self.arg_names, args, kwargs)]
        return plan(self.py.sources, leaves, labels, args, self.live | self.keyed)

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
                    if isinstance(a, torch.Tensor) else (type(a), None if number(a) else
                                                           id(a) if isinstance(a, _STATE_TYPES) else a)
                    for a in args)
        return (
            ins,
            len(set(map(id, args))),  # aliasing: the same tensor passed twice
            tuple(kwargs.items()) if kwargs else (),
            torch.is_grad_enabled(),
            _autocast_state(),
            tuple(map(self._training, reg.all_modules)),
            self._groups_quick(),
            tuple((opt.state, len(opt.state)) for _, opt in reg.optimizers),
            registration_epoch(),
            tuple(map(self._grad, reg.grad_params)),
            reg.hook_key(),
            self._py_key(args),
        )

    def signature(self, args, kwargs) -> Signature:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        inputs = tuple(_leaf_value(x) for x in leaves)
        ids = [id(leaves[i]) for i in tensor_pos]
        alias = tuple(ids.index(i) for i in ids) if len(set(ids)) != len(ids) else ()
        reg = self.reg
        key = SignatureKey(
            _spec_key(spec),
            inputs,
            alias,
            torch.is_grad_enabled(),
            _autocast_state(),
            tuple(m.training for m in reg.all_modules),
            tuple(tuple(tuple((k, self._marker((oi, gi, k), v) if (oi, gi, k) in self.live else _hyper_value(v))
                              for k, v in g.items() if k != "params")
                        + (("#params", len(g["params"])),) for gi, g in enumerate(opt.param_groups))
                  for oi, (_, opt) in enumerate(reg.optimizers)),
            tuple((id(opt.state), len(opt.state)) for _, opt in reg.optimizers),
            registration_epoch(),
            tuple(None if p.grad is None else tensor_meta(p.grad) for p in reg.grad_params),
            reg.hook_key(),
            self._py_key(args),
        )
        return Signature(key, leaves, tensor_pos)

    def _groups_quick(self) -> tuple:
        if not self.live:
            return tuple(tuple(g.values()) for _, opt in self.reg.optimizers for g in opt.param_groups)
        return tuple(tuple(self._marker((oi, gi, k), v) if (oi, gi, k) in self.live else v for k, v in g.items())
                     for oi, (_, opt) in enumerate(self.reg.optimizers) for gi, g in enumerate(opt.param_groups))

    def changed_hypers(self, old: tuple, new: tuple) -> list:
        """(optimizer index, group index, key) of float hyper-parameters that differ."""
        out = []
        for oi, (ga, gb) in enumerate(zip(old.hypers, new.hypers)):
            for gi, (x, y) in enumerate(zip(ga, gb)):
                dx, dy = dict(x), dict(y)
                for k in dx:
                    a, b = dx[k], dy.get(k)
                    floaty = all(isinstance(v, float) for v in (a if isinstance(a, tuple) else (a,))) and \
                        all(isinstance(v, float) for v in (b if isinstance(b, tuple) else (b,)))
                    if a != b and floaty:
                        out.append((oi, gi, k))
        return out

    def live_candidates(self, args, keys=LIVE_HYPERS) -> list:
        """What a replay graph can read live from its first capture: the float hyper-parameters
        ``keys`` of every group, and the float globals/cells/attributes the step's own code
        reads (not arguments: those come with each call). Reading them live costs a dict or
        attribute read per replay; baking them cost one recapture at the first schedule change
        (every corpus client with a scheduler recaptured once)."""
        out = []
        for oi, (_, opt) in enumerate(self.reg.optimizers):
            for gi, g in enumerate(opt.param_groups):
                for k in keys:
                    v = g.get(k)
                    vs = v if isinstance(v, tuple) else (v,)
                    if vs and all(isinstance(x, float) for x in vs):
                        out.append((oi, gi, k))
        for s in self.py.sources:
            if s.from_step and s.kind != "arg" and isinstance(s.read_or(args), float):
                out.append(s)
        return out

    def frozen_key(self, args, kwargs) -> SignatureKey:
        """The signature key with nothing read live (every value as it is now): taken before a
        capture, so that values the capture ends up baking are guarded as they were *before*
        the call (the call itself changes grads, counters, ...)."""
        # (every source keyed by value: a source the capture bakes is keyed so from then on)
        saved, self.live = self.live, set()
        saved_keyed, self.keyed = self.keyed, self.keyed | set(self.py.sources)
        try:
            return self.signature(args, kwargs).key
        finally:
            self.live, self.keyed = saved, saved_keyed

    def rebake(self, sig: "Signature", frozen: SignatureKey, baked) -> "Signature":
        """``sig`` with the live markers of ``baked`` replaced by their values in ``frozen``, and
        those of values with predicates answered for their ``frozen`` (pre-call) values."""
        def entry(h, v, fv):
            if h in baked:
                return fv
            return self._marker(h, fv) if h in self.live else v
        key = sig.key
        hypers = tuple(tuple(tuple((k, entry((oi, gi, k), v, fv)) for (k, v), (_, fv) in zip(g, fg))
                             for gi, (g, fg) in enumerate(zip(go, fo)))
                       for oi, (go, fo) in enumerate(zip(key.hypers, frozen.hypers)))
        py_values = tuple(entry(s, v, fv) for s, v, fv in zip(self.py.sources, key.py_values, frozen.py_values))
        return Signature(key._replace(hypers=hypers, py_values=py_values), sig.leaves, sig.tensor_pos)

    def add_predicates(self, preds) -> dict:
        """Record ``(hyper, path, op, constant)`` comparisons a trace made on live values;
        returns {hyper: how many were new} (keys taken before hold fewer answers: rekey them)."""
        added: dict = {}
        for h, path, op, other in preds:
            cur = self.preds.get(h, ())
            if (path, op, other) not in cur and h in self.live:
                self.preds[h] = (*cur, (path, op, other))
                added[h] = added.get(h, 0) + 1
        return added

    def rekey(self, key: SignatureKey, added: dict) -> list:
        """The keys an older graph (which did not branch on the comparisons just ``added``) now
        answers to: its key with every combination of answers to those comparisons."""
        import itertools
        slots = []  # (section, position path) of each marker to extend
        for oi, go in enumerate(key.hypers):
            for gi, g in enumerate(go):
                for j, (k, v) in enumerate(g):
                    if (oi, gi, k) in added and (v == "<live>" or isinstance(v, tuple) and v[:1] == ("<live>",)):
                        slots.append(("hypers", (oi, gi, j, k), added[(oi, gi, k)]))
        for i, (src, v) in enumerate(zip(self.py.sources, key.py_values)):
            if src in added:
                slots.append(("py_values", i, added[src]))
        if not slots:
            return [key]
        out = []
        for combo in itertools.product(*[list(itertools.product((True, False), repeat=n)) for *_, n in slots]):
            k6 = [[list(g) for g in go] for go in key.hypers]
            k11 = list(key.py_values)
            for (comp, where, _), answers in zip(slots, combo):
                if comp == "hypers":
                    oi, gi, j, name = where
                    old = k6[oi][gi][j][1]
                    k6[oi][gi][j] = (name, ("<live>", (old[1] if isinstance(old, tuple) else ()) + answers))
                else:
                    old = k11[where]
                    k11[where] = ("<live>", (old[1] if isinstance(old, tuple) else ()) + answers)
            out.append(key._replace(hypers=tuple(tuple(tuple(g) for g in go) for go in k6),
                                    py_values=tuple(k11)))
        return out

    def live_label(self, h) -> str:
        """How explain() and the graph's readers name a live value."""
        if isinstance(h, tuple):
            oi, gi, k = h
            return f"{self.reg.optimizers[oi][0]}.param_groups[{gi}]['{k}']"
        return h.describe()

    def candidate_values(self, args, keys=LIVE_HYPERS) -> dict:
        """``live_candidates`` with their values now (a float, or a tuple of floats)."""
        out = {}
        for h in self.live_candidates(args, keys):
            if isinstance(h, tuple):
                oi, gi, k = h
                out[h] = self.reg.optimizers[oi][1].param_groups[gi].get(k)
            else:
                out[h] = h.read_or(args)
        return out

    # ---- explaining a miss -------------------------------------------------------------
    def diff(self, old: SignatureKey, new: SignatureKey, args=(), kwargs=None) -> str:
        """One line naming the first difference between two signature keys."""
        self.leaf_names = leaf_names(self.arg_names, args, kwargs or {})
        fine = dict(inputs=self._diff_inputs, training=self._diff_training, hypers=self._diff_hyper,
                    opt_state=self._diff_optstate, grads=self._diff_grads)
        for section in DIFF_ORDER:
            a, b = getattr(old, section), getattr(new, section)
            if a == b:
                continue
            if section == "registration":
                return "a module parameter, buffer or submodule was assigned (module structure changed)"
            if section == "autocast":
                return f"autocast {_autocast_str(a)} -> {_autocast_str(b)}"
            if section == "py_values" and len(a) == len(b):
                return self.py.diff(a, b) or "a Python value the step reads changed"
            if section == "hooks":
                if a[2] != b[2]:   # (StateRegistry.hook_key: DDP's sync flags)
                    return (f"DistributedDataParallel (require_backward_grad_sync, require_forward_param_sync) "
                            f"{a[2]} -> {b[2]} (no_sync() around the call?)")
                if a[3] != b[3]:
                    return "FSDP2 settings changed (set_reshard_after_forward, set_requires_gradient_sync, ...)"
                return "a hook was added to or removed from the step's modules or parameters"
            f = fine.get(section)
            detail = f(a, b) if f else None
            return detail or f"{SECTION_NAMES[section]} {_short(a)} -> {_short(b)}"
        return "signature changed"

    def _diff_inputs(self, a, b):
        if len(a) != len(b):
            return f"number of input leaves {len(a)} -> {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if x == y:
                continue
            name = self.leaf_names[i] if i < len(self.leaf_names) else f"input leaf {i}"
            if _is_tensor_meta(x) and _is_tensor_meta(y):
                for field, u, v in zip(_TENSOR_FIELDS, x, y):
                    if u != v:
                        return f"{name} {field} {_short(u)} -> {_short(v)}"
            return f"{name} {_describe_leaf(x)} -> {_describe_leaf(y)}"
        return None

    def _diff_training(self, a, b):
        mods = {id(m): n for root, mod in self.reg.modules for n, m in
                [(f"{root}.{k}" if k else root, m) for k, m in mod.named_modules()]}
        for m, x, y in zip(self.reg.all_modules, a, b):
            if x != y:
                return f"{mods.get(id(m), type(m).__name__)}.training {x} -> {y}"
        return None

    def _diff_hyper(self, a, b):
        for (oname, _), ga, gb in zip(self.reg.optimizers, a, b):
            if len(ga) != len(gb):
                return f"{oname}: number of param_groups {len(ga)} -> {len(gb)}"
            for gi, (x, y) in enumerate(zip(ga, gb)):
                dx, dy = dict(x), dict(y)
                for k in dict.fromkeys(list(dx) + list(dy)):
                    if dx.get(k) != dy.get(k):
                        return f"{oname}.param_groups[{gi}]['{k}'] {_short(dx.get(k))} -> {_short(dy.get(k))}"
        return None

    def _diff_optstate(self, a, b):
        for (oname, _), x, y in zip(self.reg.optimizers, a, b):
            if x[0] != y[0]:
                return f"{oname}.state was replaced (load_state_dict?)"
            if x[1] != y[1]:
                return f"{oname}.state: entries {x[1]} -> {y[1]}"
        return None

    def _diff_grads(self, a, b):
        params = [(s, p) for s, p in self.reg.params if p.requires_grad]  # == reg.grad_params
        for (src, _), x, y in zip(params, a, b):
            if x != y:
                fx = "None" if x is None else "a tensor"
                fy = "None" if y is None else "a tensor"
                if x is not None and y is not None:
                    fx, fy = _short(x[1:]), _short(y[1:])
                return f"{src}.grad {fx} -> {fy}"
        return None


def _autocast_str(state) -> str:
    on = [f"{dev}:{str(dt).replace('torch.', '')}" for dev, (flag, dt) in zip(("cpu", "cuda"), state[:2]) if flag]
    return "on(" + ", ".join(on) + ")" if on else "off"


def _autocast_state() -> tuple:
    out = []
    for dev in ("cpu", "cuda"):
        on = torch.is_autocast_enabled(dev)
        out.append((on, torch.get_autocast_dtype(dev) if on else None))
    out.append(torch.is_autocast_cache_enabled())
    return tuple(out)


def _short(v) -> str:
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, tuple) and v and v[0] == "tensor":
        return "tensor"
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _is_tensor_meta(x) -> bool:
    return isinstance(x, TensorMeta)


def _describe_leaf(x) -> str:
    if _is_tensor_meta(x):
        return f"tensor {_short(x.dtype)}{list(x.shape)}"
    if x[0] == "value":
        return _short(x[2])
    if x[0] == "number":
        return "a Python number"
    return f"{x[1].__name__} object" + (f" at {x[2]:#x}" if len(x) > 2 else "")


def arg_names(fn) -> list[str]:
    """Positional parameter names of ``fn`` (best effort, for messages)."""
    import inspect
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def leaf_names(params: list[str], args, kwargs) -> list[str]:
    """A readable name per flattened input leaf: ``arg 0 (x)``, ``arg 1 (batch)['ids']``."""
    out = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not path:
            out.append("input")
            continue
        head = path[0].idx if hasattr(path[0], "idx") else 0
        rest = path[1:]
        if head == 0 and rest:
            i = rest[0].idx
            label = f"arg {i}" + (f" ({params[i]})" if i < len(params) else "")
            rest = rest[1:]
        elif rest:
            label = f"kwarg {rest[0].key!r}" if hasattr(rest[0], "key") else "kwarg"
            rest = rest[1:]
        else:
            label = "input"
        out.append(label + "".join(str(k) for k in rest))
    return out
