"""How a Python value the step reads is keyed in the guard signature (pyvalues.py): scalars by
value, small containers of scalars (nested ones too) by value, numpy arrays by their bytes when
small, tensors and other objects by identity; ``_show`` says it back in a recapture reason."""
from __future__ import annotations

import collections
import contextlib
import contextvars
import types

import torch

from .sigkey import Ident

# The arguments of the step call running (runtime.StepFunction.__call__): a source rooted at
# an argument that a graph reads live at replay (``loss_compute.scale``) reads them.
CALL_ARGS: contextvars.ContextVar = contextvars.ContextVar("stepgraph_call_args", default=())

@contextlib.contextmanager
def calling(args):
    token = CALL_ARGS.set(args)
    try:
        yield
    finally:
        CALL_ARGS.reset(token)


_SKIP = object()       # a value not guarded (functions, classes, Python modules)
_MISSING = ("<missing>",)
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_MAX_ITEMS = 256       # containers of scalars up to this size are guarded by value
# (a deque as a list: keyed by identity only, the step's ``dq.append(i)`` went unseen)
_SEQUENCES = (list, tuple, collections.deque)


def guard_value(v):
    """What the guard compares for one value (hashable), or ``_SKIP``."""
    if isinstance(v, float):
        # (float's own methods: a live float the trace put in the source is keyed by its value,
        # not compared -- its ``!=`` records a decision and baked it, DANN's or wav2vec2's
        # closure constants each time a key was taken while tracing)
        v = float.__float__(v)
        return ("nan",) if float.__ne__(v, v) else v  # nan != nan: key it by name
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, torch.Tensor):
        return ("tensor", id(v))
    if type(v).__name__ == "ndarray" and type(v).__module__ == "numpy":
        # (its values may be baked into the graph and numpy keeps no version: small arrays are
        # keyed by their bytes, larger ones by identity -- and refused where read: schedules.py)
        from .arrays import array_key
        return array_key(v, read=True)
    if isinstance(v, (torch.device, torch.dtype, torch.Size, torch.layout, torch.memory_format)):
        return ("torch", str(v))
    if isinstance(v, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                      type, types.BuiltinMethodType)):
        return _SKIP
    if isinstance(v, _SEQUENCES) and len(v) <= _MAX_ITEMS and all(isinstance(x, _SCALARS) for x in v):
        return (type(v).__name__, tuple(("nan",) if isinstance(x, float) and x != x else x for x in v))
    if isinstance(v, dict) and len(v) <= _MAX_ITEMS and all(isinstance(x, _SCALARS) for x in v.values()):
        try:
            return ("dict", tuple(v.items()))
        except TypeError:
            pass
    if isinstance(v, (list, tuple)) and 0 < len(v) <= _MAX_ITEMS and _small_arrays(v):
        # (minimalRL PPO's rollout, ``self.data``: numpy observations that ``torch.tensor(list)``
        # turns into the batch: keyed by identity and length, a refilled list replayed the old one)
        from .arrays import array_key
        return (type(v).__name__, tuple(array_key(x, read=True) if type(x).__name__ == "ndarray" else
                                        guard_value(x) for x in v))
    if isinstance(v, (list, tuple, dict, set, frozenset)):
        # (GraphSAGE's adjacency, a dict of neighbour sets the loop resamples in place: its
        # members become index constants of the graph. Keyed by identity and length, the same
        # dict with other members replayed the old neighbours, silently.)
        nested = _nested_key(v, [_MAX_LEAVES])
        if nested is not None:
            return ("contents", len(v), nested)
    if isinstance(v, (list, dict, set)):
        # (not a deque: a replay buffer's, which a data call samples before the step, grows
        # between calls -- its length in the key was a recapture per call; a deque the step
        # changes is refused or its appends replayed: outputs._refuse_deque, pyeffects)
        return ("object", Ident(v), len(v))
    return ("object", Ident(v))   # (held: a rebound global's new object cannot take the old id)


_MAX_LEAVES = 4096     # nested containers of scalars up to this many items are keyed by value


def _nested_key(v, budget: list):
    """A nested container of scalars (a dict of sets of ints) as a hashable value, in its
    iteration order; None past ``budget`` items or at anything else."""
    if isinstance(v, _SCALARS):
        return ("nan",) if isinstance(v, float) and v != v else v
    if not isinstance(v, (list, tuple, dict, set, frozenset)):
        return None
    budget[0] -= len(v)
    if budget[0] < 0:
        return None
    items = v.items() if isinstance(v, dict) else v
    out = []
    for x in items:
        if isinstance(v, dict):
            k, x = x
            if not isinstance(k, _SCALARS):
                return None
            out.append(k)
        key = _nested_key(x, budget)
        if key is None:
            return None
        out.append(key)
    return (type(v).__name__, tuple(out))


def _small_arrays(v) -> bool:
    """Numbers and small numpy arrays only, with one array at least (keyed by value, bytes)."""
    arrays = [x for x in v if type(x).__name__ == "ndarray" and type(x).__module__ == "numpy"]
    return bool(arrays) and sum(a.nbytes for a in arrays) <= 65536 and \
        all(isinstance(x, _SCALARS) or any(x is a for a in arrays) for x in v)


def stateless_text(config) -> str:
    """A module holding no tensors, by its settings (state.stateless_config)."""
    name, cls, training, items = config[0]
    shown = ", ".join(f"{k}={v!r}" for k, v in items)
    return f"{cls.__name__}({shown}){'' if training else ' in eval mode'}"


def _show(g) -> str:
    if isinstance(g, tuple) and len(g) == 2 and g[0] in ("list", "tuple") and any(
            isinstance(x, tuple) and x[:1] == ("ndarray",) for x in g[1]):
        return f"a {g[0]} of {len(g[1])} holding numpy arrays, values #{hash(g) & 0xffff:04x}"
    if isinstance(g, tuple) and g[:1] == ("ndarray",) and len(g) == 5 and isinstance(g[4], bytes):
        import numpy as np   # (arrays.array_key of a small array: its values)
        vals = np.frombuffer(g[4], dtype=g[1]).reshape(g[2]) if g[2] else np.frombuffer(g[4], dtype=g[1])
        text = np.array2string(vals, threshold=6, edgeitems=2, separator=", ").replace("\n", "")
        return f"array {g[1]}{list(g[2])} {text[:40]}"
    if isinstance(g, tuple) and g[:1] == ("live tensor",):   # (pyeffects.tensor_key)
        return f"a tensor {str(g[1]).replace('torch.', '')}{list(g[3])}"
    if isinstance(g, tuple) and g[:1] == ("contents",):   # (a nested container, keyed by its members)
        return f"a {g[2][0]} of {g[1]} items, members #{hash(g) & 0xffff:04x}"
    if g == ("number",):
        return "a Python number"
    if isinstance(g, tuple) and g[:1] == ("stateless module",):   # (guards._module_key)
        return stateless_text(g[1])
    if g == "<live>" or isinstance(g, tuple) and g[:1] == ("<live>",):   # (Guards._marker)
        return "a float read live"
    if isinstance(g, tuple) and g and g[0] in ("tensor", "object"):
        return f"<{g[0]} at {g[1]:#x}>" + (f" of length {g[2]}" if len(g) > 2 else "")
    if isinstance(g, tuple) and len(g) == 2 and g[0] in ("list", "tuple", "dict", "deque"):
        s = repr(g[1])
    else:
        s = repr(g)
    return s if len(s) <= 48 else s[:45] + "..."


def item(v, k):
    """``v[k]`` without making it: a ``defaultdict`` meter's missing key read by stepgraph (to key
    the step) was inserted, so a branch eager never took left a phantom meter (a summary loop then
    divided by its zero count; found by a probe). A missing key is a KeyError here."""
    if isinstance(v, dict) and hasattr(type(v), "__missing__") and k not in v:
        raise KeyError(k)
    return v[k]


def default_probe(path, parent):
    """What a dict's missing item stands for while the step's code is scanned: a defaultdict's
    (``meters["acc1"]`` before the step's first call makes it) made by its factory and not
    inserted, so its chain is found and its methods scanned; None for a plain dict's
    (``self.info["loss"] = t`` before the first call stores it: a slot the step writes, found as
    one and replayed). ``_MISSING`` otherwise."""
    if not (path and path[-1][0] == "item") or not isinstance(parent, dict):
        return _MISSING
    if not hasattr(type(parent), "__missing__"):
        return None if isinstance(path[-1][1], str) and path[-1][1] not in parent else _MISSING
    if getattr(parent, "default_factory", None) is None:
        return _MISSING
    try:
        return parent.default_factory()
    except Exception:  # noqa: BLE001 - a factory that needs what the loop sets up: not found
        return _MISSING


def rebound_key(s, v):
    """The key of a source the step rebinds (``Source.key_for``), or None for the usual one."""
    if s.same_tensors and type(v) in (list, tuple) and all(isinstance(t, torch.Tensor) for t in v):   # (pybefore.overwritten)
        return ("same tensors", type(v), tuple(Ident(t) for t in v))
    if s.overwritten and (v is None or isinstance(v, torch.Tensor)):
        return ("overwritten",)   # (no input of the graph: None or any tensor, torchmetrics' reset() sets None)
    if s.overwritten and type(v) in (list, tuple) and all(isinstance(t, torch.Tensor) for t in v):
        return ("overwritten", type(v), tuple((t.dtype, tuple(t.shape), t.device.type) for t in v))
    return None
