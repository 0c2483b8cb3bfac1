"""A ``graph_module`` call's signature: ``sigkey.PartialKey`` built from the module, its state
and the call's arguments (tensors as ``sigkey.TensorMeta``, as the whole-step signature keys
them), and the one-line reason two keys differ (``stats.recaptures``, warnings)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from .capture.sigkey import PartialKey, Signature, TensorMeta, ValueMeta
from .partial_hooks import hook_key


def module_state(module) -> list:
    """``(name, tensor, "param" | "buffer")`` of every parameter and buffer, each tensor once."""
    found: dict = {}
    for kind, named in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            found.setdefault(id(t), (name, t, kind))
    return list(found.values())


def _value_key(v):
    if isinstance(v, float):
        return repr(v)   # NaN-safe
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)   # unhashables by repr


def _leaf(v):
    if isinstance(v, torch.Tensor):
        # requires_grad as it is, leaf or not: the backward graph returns the input's gradient
        return TensorMeta(type(v), v.dtype, v.device, tuple(v.shape), v.stride(), v.requires_grad, "-")
    return ValueMeta(type(v).__name__, _value_key(v))


@dataclass
class PartialSignature(Signature):
    """``Signature`` (key, leaves, tensor positions) plus what tracing and the reasons need."""
    spec: object = None                        # pytree spec of (args, kwargs)
    names: list = field(default_factory=list)  # "args[0]", "kwargs['mask']", per leaf


def signature(module, state, args, kwargs) -> PartialSignature:
    flat, spec = pytree.tree_flatten_with_path((args, kwargs))
    leaves = [v for _, v in flat]
    key = PartialKey(
        spec=str(spec), inputs=tuple(_leaf(v) for v in leaves), grad_mode=torch.is_grad_enabled(),
        autocast=tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")),
        training=tuple(m.training for m in module.modules()),
        state=tuple((id(t), t.requires_grad, t.dtype, tuple(t.shape)) for _, t, _ in state),
        hooks=hook_key(module))
    return PartialSignature(
        key=key, leaves=leaves, tensor_pos=[i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)],
        spec=spec, names=[("args" if p[0].idx == 0 else "kwargs") + pytree.keystr(p[1:]) for p, _ in flat])


# the fields a tensor's reason names, first difference first
_TENSOR_FIELDS = ("type", "shape", "dtype", "device", "requires_grad", "stride")


def _leaf_diff(name: str, a, b) -> str:
    if type(a) is not type(b):
        kinds = ["tensor" if isinstance(x, TensorMeta) else "value" for x in (a, b)]
        return f"{name}: kind {kinds[0]} -> {kinds[1]}"
    fields = _TENSOR_FIELDS if isinstance(a, TensorMeta) else ValueMeta._fields
    f = next(f for f in fields if getattr(a, f) != getattr(b, f))
    return f"{name}: {f} {getattr(a, f)} -> {getattr(b, f)}"


def _mode(training: bool) -> str:
    return "train" if training else "eval"


def diff(old: PartialKey, new: PartialKey, names, state) -> str:
    """Every section that differs between two keys, as one line."""
    if old.spec != new.spec:
        return "argument structure changed (number/nesting of arguments or keywords)"
    out = [_leaf_diff(name, a, b) for name, a, b in zip(names, old.inputs, new.inputs) if a != b]
    if old.grad_mode != new.grad_mode:
        out.append(f"grad mode: {old.grad_mode} -> {new.grad_mode}")
    if old.autocast != new.autocast:
        out.append(f"autocast (cpu, cuda): {old.autocast} -> {new.autocast}")
    if old.training != new.training:
        own = old.training[0] != new.training[0]
        out.append("train/eval mode changed" + (f": {_mode(old.training[0])} -> {_mode(new.training[0])}"
                                                if own else " (in a submodule)"))
    if old.state != new.state:
        bad = [n for (n, _, _), a, b in zip(state, old.state, new.state) if a != b]
        out.append(f"parameter/buffer {bad[0]!r} replaced or changed requires_grad/dtype/shape" if bad
                   else "parameters/buffers added or removed")
    if old.hooks != new.hooks:
        out.append("hooks registered or removed inside the module")
    return "; ".join(out) or "new signature"
