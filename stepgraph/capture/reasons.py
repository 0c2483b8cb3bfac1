"""Why two guard signatures differ, in one line: ``arg 0 (x) shape (8, 256) -> (4, 256)``,
``opt.param_groups[0]['lr'] 0.1 -> 0.05``. A mixin of ``guards.Guards`` (it reads the
registry, the Python values and the live set that ``Guards`` keeps)."""
from __future__ import annotations


import torch

import torch.utils._pytree as pytree

from . import fetches
from .valuekeys import stateless_text
from .sigkey import DIFF_ORDER, SECTION_NAMES, SignatureKey, TensorMeta

_TENSOR_FIELDS = ("type", "dtype", "device", "shape", "stride", "requires_grad", ".grad")


class Reasons:
    """``Guards.diff``: the first differing section of two signature keys, named for a user."""

    def diff(self, old: SignatureKey, new: SignatureKey, args=(), kwargs=None) -> str:
        """One line naming the first difference between two signature keys."""
        self.leaf_names = leaf_names(self.arg_names, args, kwargs or {})
        fine = dict(spec=lambda a, b: spec_diff(a, b, self.arg_names), inputs=self._diff_inputs, training=self._diff_training, hypers=self._diff_hyper,
                    opt_state=self._diff_optstate, grads=self._diff_grads, requires_grad=self._diff_requires_grad)
        for section in DIFF_ORDER:
            a, b = getattr(old, section), getattr(new, section)
            if a == b:
                continue
            if section in ("requires_grad", "grads", "opt_state", "hypers", "training") and len(a) != len(b):
                continue   # (the registry grew: a rebound global's new model -- said by py_values)
            if section == "registration":
                return "a module parameter, buffer or submodule was assigned (module structure changed)"
            if section == "autocast":
                return f"autocast {_autocast_str(a)} -> {_autocast_str(b)}"
            if section == "callables":
                from .callslots import explain
                return explain(a, b) or "a function the step calls changed"
            if section == "py_values":   # (found again with more sources: those found before lead)
                m = min(len(a), len(b))
                return self.py.diff(a[:m], b[:m]) or "a Python value the step reads changed"
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
            while x[:1] == y[:1] == ("instance",) and x[1] is y[1]:   # (guards.instance_key: the part differing)
                ka, kb = dict((p[0], p[1:]) for p in x[2]), dict((p[0], p[1:]) for p in y[2])
                k = next((k for k in {**ka, **kb} if ka.get(k) != kb.get(k)), None)
                name, u, v = f"{name}.{k}", ka.get(k), kb.get(k)
                if u is None or v is None or not (u[0][:1] == v[0][:1] == ("instance",)):
                    return f"{name} {_describe_part(u)} -> {_describe_part(v)}"
                x, y = u[0], v[0]
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
            if x[2] != y[2]:
                return f"{oname}.state: its per-parameter states were replaced (a state reset?)"
        return None

    def _diff_requires_grad(self, a, b):
        for (src, _), x, y in zip(self.reg.params, a, b):
            if x != y:
                return f"{src}.requires_grad {x} -> {y}"
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


def spec_diff(a, b, params) -> str | None:
    """Where two argument structures (``(args, kwargs)`` TreeSpecs) first differ, named as the
    inputs are: ``arg 0 (batch) dict keys ['x', 'y'] -> ['y', 'x']`` (a TreeSpec's repr was
    printed before, cut after 60 characters, before any difference)."""
    if not (isinstance(a, pytree.TreeSpec) and isinstance(b, pytree.TreeSpec)) or a.num_children != 2 \
            or b.num_children != 2:
        return None
    (ea, ka), (eb, kb) = _kids(a), _kids(b)
    for i, (x, y) in enumerate(zip(_kids(ea), _kids(eb))):
        if x != y:
            return _spec_walk(x, y, f"arg {i}" + (f" ({params[i]})" if i < len(params) else ""))
    if ea.num_children != eb.num_children:
        return f"number of arguments {ea.num_children} -> {eb.num_children}"
    from .fetches import FETCH_KW   # (the draws and batches taken before the call: fetches.py)
    fa, fb = (FETCH_KW in (k.context if isinstance(k.context, list) else ()) for k in (ka, kb))
    if fa or fb:   # (CaiT's ``randrange`` only when every layer's coin said drop: not its kwarg's name)
        return (f"the step's draws on random / numpy.random and next() of its iterators: "
                f"{'some' if fa else 'none'} at capture, {('others' if fa else 'some') if fb else 'none'} now")
    return _spec_walk(ka, kb, "keyword arguments")


def _spec_walk(a, b, path: str) -> str:
    if a.is_leaf() or b.is_leaf() or a.type is not b.type:
        return f"{path}: {_spec_text(a)} -> {_spec_text(b)}"
    if a.context != b.context or a.num_children != b.num_children:
        if isinstance(a.context, list) and isinstance(b.context, list):
            return f"{path} {a.type.__name__} keys {_short(a.context)} -> {_short(b.context)}"
        return f"{path}: {_spec_text(a)} -> {_spec_text(b)}"
    keys = a.context if isinstance(a.context, list) and len(a.context) == a.num_children else range(a.num_children)
    for k, x, y in zip(keys, _kids(a), _kids(b)):
        if x != y:
            return _spec_walk(x, y, f"{path}[{k!r}]")
    return f"{path}: {_spec_text(a)} -> {_spec_text(b)}"


def _kids(s) -> list:
    # (``children()`` from torch 2.13, where ``children_specs`` warns; 2.11 has only the list)
    return s.children() if _HAS_CHILDREN else s.children_specs


_HAS_CHILDREN = callable(getattr(pytree.TreeSpec, "children", None))


def _spec_text(s) -> str:
    if s.is_leaf():
        return "a value"
    return f"a {s.type.__name__} of {s.num_children}"


def _autocast_str(state) -> str:
    on = [f"{dev}:{str(dt).replace('torch.', '')}" for dev, (flag, dt) in zip(("cpu", "cuda"), state[:2]) if flag]
    return "on(" + ", ".join(on) + ")" if on else "off"


def _short(v) -> str:
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, tuple) and v and v[0] == "tensor":
        return "tensor"
    if v == "<live>" or isinstance(v, tuple) and v[:1] == ("<live>",):   # (Guards._marker)
        return "(read live)"
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
    if x[0] == "stateless module":   # (state.stateless_config: the root module's class and settings)
        return stateless_text(x[1])
    if x[0] == "ndarray":   # (arrays.array_key)
        what = f"numpy array {x[1]}{list(x[2])}"
        if len(x) > 4:
            what += " object at {:#x}".format(x[4][1]) if isinstance(x[4], tuple) else " (values read in the step)"
        return what
    if x[0] == "instance":
        return f"a {x[1].__name__} object"
    if x[0] == "optimizer holding nothing":
        return f"a {x[1].__name__} holding no parameters"
    return f"{x[1].__name__} object" + (f" at {x[2]:#x}" if len(x) > 2 and isinstance(x[2], int) else "")


def _describe_part(p) -> str:
    """One attribute's part of an instance key (guards.instance_key), as a reason shows it."""
    if p is None:
        return "(no such attribute)"
    if _is_tensor_meta(p[0]):
        return f"tensor {_short(p[0].dtype)}{list(p[0].shape)}"
    if p[0] in ("module", "optimizer"):
        return f"{p[1].__name__} at {p[2]:#x}"
    if p[0] == "stateless module":
        return stateless_text(p[1])
    if isinstance(p[0], tuple) and p[0][:1] == ("instance",):
        return f"a {p[0][1].__name__} object"
    if p[0] == "read":
        return f"a {p[1].__name__}"
    return _short(p[1]) if p[0] == "value" else _short(p)


def leaf_names(params: list[str], args, kwargs) -> list[str]:
    """A readable name per flattened input leaf: ``arg 0 (x)``, ``arg 1 (batch)['ids']``."""
    out = []
    from .argtree import flatten_with_path
    for path, _ in flatten_with_path(args, kwargs)[0]:
        if not path:
            out.append("input")
            continue
        head = path[0].idx if hasattr(path[0], "idx") else 0
        rest = path[1:]
        if head == 0 and rest:
            i = rest[0].idx
            label = f"arg {i}" + (f" ({params[i]})" if i < len(params) else "")
            rest = rest[1:]
        elif rest and getattr(rest[0], "key", None) == fetches.FETCH_KW and len(rest) > 1:
            label = fetches.input_label(rest[1].idx)
            rest = rest[2:]
        elif rest:
            label = f"kwarg {rest[0].key!r}" if hasattr(rest[0], "key") else "kwarg"
            rest = rest[1:]
        else:
            label = "input"
        out.append(label + "".join(str(k) for k in rest))
    return out


def _identity(v) -> bool:
    """A key part that is an object's identity (a new object never matches an old graph)."""
    return isinstance(v, tuple) and v[:1] == ("object",)


def nearest_key(keys, key):
    """Of the captured graphs' ``keys`` (oldest first), the one a new ``key`` is explained
    against: fewest differing parts; on a tie, the one where more of them are new objects (a
    value flipping back and forth matches some graph, a new object none); then the newest. A
    loop that resets ``loss_ema = None`` and makes a tqdm bar each epoch recaptured "loss_ema
    '<live>' -> None" against the newest graph, never naming the bar."""
    def score(k):
        diff = ident = 0
        for a, b in zip(k, key):
            if a == b:
                continue
            if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and not _identity(a):
                pairs = [(x, y) for x, y in zip(a, b) if x != y]
                diff += len(pairs)
                ident += sum(1 for x, y in pairs if _identity(x) and _identity(y))
            else:
                diff += 1
        return diff, -ident
    return min(reversed(list(keys)), key=score)
