"""Constant folding while tracing: CPU tensors the step builds from constants only.

``sizes = torch.tensor([crop.shape[-1] for crop in x])`` holds values the capture already fixes
(shapes are in the guard signature; Python numbers are guarded or read live before they reach
``torch.tensor``, so a ``lift_fresh_copy`` constant is a fixed value). DINO's MultiCropWrapper
then runs ``unique_consecutive`` and ``cumsum`` on it and slices its batch with the results.
Traced, that is CPU work in the graph: refused in a CUDA step (a CUDA graph runs it once), and
host-read guards on a CPU step. Folded, each such op runs once, here, outside the trace; its
results are plain tensors (constants of the graph where a traced op uses them), and reading
their values is reading a constant.

Python numbers given where an op takes tensors (``torch.div(h.size(1), 2 * w,
rounding_mode="trunc")`` then used as a view size: Longformer's ``_chunk``) are constants too:
a trace would bake them into the graph anyway. Only numbers of exactly int/float/bool: a live
float (``HostFloat``, a read value) is a subclass, and stays traced.

Not folded: a lift over a numpy argument's memory (an input: arrays.py), random or in-place
ops, ops with any input that is not such a constant, and results off the CPU (a copy to the GPU
is left to the host prologue, passes/host_prologue.py)."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from .unfilled import Unfilled

_LIFT = (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default)
_INDEX_OPS = frozenset((torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor,
                        torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default))


class Constants:
    def __init__(self, arrays):
        self.arrays = arrays      # ArrayUses: lifts over an argument array's memory are inputs
        self.known: dict = {}     # id -> a CPU tensor holding a constant value
        self.unfilled = Unfilled()   # CPU tensors an op fills behind the dispatcher (unfilled.py)

    def _is(self, t) -> bool:
        return self.known.get(id(t)) is t

    def note(self, func, args, out, kwargs=None) -> None:
        """After a traced op: a ``torch.tensor(...)`` constant on the CPU is a known constant; one
        a traced op wrote into is no longer (pytorch_optimizer DAdaptSGD's ``sk_sq =
        torch.tensor([0.0])``, then ``sk_sq.add_(s.pow(2).sum())``: its ``sqrt()`` was folded
        with the capture's sum, and every replay divided by it -- silently wrong)."""
        self.unfilled.after(func, out)
        if func in _LIFT and isinstance(out, torch.Tensor) and out.device.type == "cpu" \
                and not self.arrays.over(args[0]):
            self.known[id(out)] = out
        elif self.known and isinstance(func, torch._ops.OpOverload) and func._schema.is_mutable:
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    v = args[i] if i < len(args) else (kwargs or {}).get(a.name)
                    for t in pytree.tree_leaves(v):
                        if isinstance(t, torch.Tensor):
                            self.known.pop(id(t), None)
                            self.known.pop(id(t._base), None)

    def fold(self, func, args, kwargs):
        """The op's result computed outside the trace, or NotImplemented to trace it. (First at each
        op the trace dispatches: what it reads of a tensor filled behind the dispatcher is noted.)"""
        self.unfilled.before(func, args, kwargs)
        if not isinstance(func, torch._ops.OpOverload) or func._schema.is_mutable \
                or torch.Tag.nondeterministic_seeded in func.tags:
            return NotImplemented
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return NotImplemented
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not (all(self._is(t) for t in tensors) if tensors else _numbers_as_tensors(func, args, kwargs)):
            return NotImplemented
        with _disable_current_modes():
            out = func(*args, **kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if any(o.device.type != "cpu" for o in outs):
            return NotImplemented   # (computed twice then: a copy, no side effect)
        for o in outs:
            self.known[id(o)] = o
        return out

    def device_index(self, func, args, kwargs) -> bool:
        """In a CUDA step: a device tensor indexed by CPU constants (DLRM's ``Z[:, li, lj]``):
        not CPU work, the constants move to the device once (passes/moved_arguments.py)."""
        if func not in _INDEX_OPS:
            return False
        cpu = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
        return bool(cpu) and all(self._is(a) for a in cpu)

    def check_write(self, func, args, kwargs, problems: list) -> None:
        """An in-place op (not folded: it takes step values) writing into a folded result, a graph
        constant which every replay would write again: a problem at the user's line."""
        if self._written(func, args, kwargs):
            import traceback
            from ..errors import library_frame, user_frame
            from .effects import Problem
            stack = traceback.extract_stack()
            lib, where = library_frame(stack), user_frame(stack)
            # (in code the user does not own -- a collator called in the step, transformers'
            # DataCollatorForLanguageModeling -- the only fix the user has is to call it outside)
            fix = ("make that line's call outside the step and pass its result in: the write is in "
                   "code you do not own (a data collator belongs in the DataLoader's collate_fn)" if lib else
                   "make it out of place (base = base + ...), or build the tensor from a step value")
            problems.append(Problem(
                f"{func} writes in place into a tensor built from constants only (folded into a graph "
                "constant, which every replay would write again)", where, fix, lib, plain=True))

    def _written(self, func, args, kwargs) -> bool:
        schema = getattr(func, "_schema", None)
        if not self.known or schema is None or not schema.is_mutable:
            return False
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if any(isinstance(t, torch.Tensor) and self._is(t) and not self._lifted(t)
                   for t in pytree.tree_leaves(v)):
                return True
        return False

    def _lifted(self, t) -> bool:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, has_proxy_slot
        mode = get_proxy_mode()
        return mode is not None and has_proxy_slot(t, mode.tracer)


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _numbers_as_tensors(func, args, kwargs) -> bool:
    """Every argument a plain constant, and a plain number given for a Tensor parameter (a
    wrapped scalar: ``aten.div.Tensor_mode(6, 2)``), so not a factory (``torch.zeros(n)``, which
    the step may then fill in place)."""
    if not all(type(x) in _PLAIN for x in pytree.tree_leaves((args, kwargs))):
        return False
    given = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    return any(isinstance(a.type, torch.TensorType) and type(given.get(a.name)) in (int, float, bool)
               for a in func._schema.arguments)
