"""Collectives the step calls directly (``dist.all_reduce(t)``), traced as functional collectives.

c10d's own ops (``c10d.allreduce_``) complete through ``Work`` objects a trace does not see:
replaying them would not synchronise the ranks. While a step is traced, the torch.distributed
functions PyTorch itself remaps for Dynamo (``_functional_collectives.traceable_collective_remaps``:
all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_gather) and broadcast go through
their in-place functional forms instead: a ``_c10d_functional`` op, ``wait_tensor`` and a copy
into the user's tensor, which ``make_fx`` records, the replay backend re-runs (gloo) and a CUDA
graph captures (NCCL). The same process group runs the same reduction, so the values equal
eager's bit for bit (DINO's ``update_center``, a hand-written gradient all-reduce).

What is not remapped reaches c10d and is refused at the user's line (``direct_collective``):
``async_op=True`` (the Work handle escapes into user code), a reduction the functional ops lack
(PREMUL_SUM), an uneven ``all_gather``, and a function bound by name before the step
(``from torch.distributed import all_reduce``): the patch replaces the module attributes.

A step that ran a remapped collective needs its ranks to capture together, as a DDP step does:
the process group is recorded on the registry (``collective_groups``) and ``distributed.agree``
meets the ranks before each later capture.
"""
from __future__ import annotations

import contextlib

from ..passes.analysis import host_staged
from .patching import patched

_FIX = ("call the collective through the torch.distributed module with async_op=False "
        "(dist.all_reduce(t), dist.all_gather_into_tensor(out, t), dist.reduce_scatter_tensor(out, t), "
        "dist.broadcast(t, src)), which stepgraph traces as functional collectives, or use "
        "torch.distributed._functional_collectives directly; DistributedDataParallel models need "
        "nothing: their gradient all-reduce is captured")


def _op_name(op) -> str | None:
    from torch.distributed._functional_collectives import REDUCE_OP_TO_STR
    return REDUCE_OP_TO_STR.get(getattr(op, "op", op))   # (a ReduceOp object holds its RedOpType)


def _remapped(seen: list) -> dict:
    """Replacements for the torch.distributed functions; each falls back to the original (and
    so to the refusal at the user's line) where the functional form would not be the same."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as fcol
    orig = {name: getattr(dist, name) for name in
            ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "broadcast")}

    def group_of(group, tensor=None, what=""):
        group = group if group is not None else dist.group.WORLD
        staged = host_staged(group) if tensor is not None and tensor.device.type == "cuda" else None
        if staged is not None:
            # gloo stages CUDA tensors through the host: its functional form's wait killed the
            # process while tracing (MoCo v2 on a gloo group, H200: SIGSEGV), and no CUDA graph
            # could hold it anyway. Refused here, before it runs; the call runs eagerly.
            from ..errors import CaptureError, user_frame
            raise CaptureError(
                f"the step calls dist.{what} on CUDA tensors over a {staged} process "
                "group, which stepgraph cannot trace (it copies them to the host and waits)",
                op=f"torch.distributed.{what}", where=user_frame(),
                fix="create the process group with the NCCL backend for CUDA tensors "
                    "(dist.init_process_group('nccl'), as torchrun scripts do)")
        if all(g is not group for g in seen):
            seen.append(group)
        return group

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = _op_name(op)
        if async_op or name is None:
            return orig["all_reduce"](tensor, op, group, async_op)
        fcol.all_reduce_inplace(tensor, name, group_of(group, tensor, "all_reduce"))
        return None

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if async_op:
            return orig["all_gather_into_tensor"](output_tensor, input_tensor, group, async_op)
        fcol.all_gather_tensor_inplace(output_tensor, input_tensor, group_of(group, input_tensor, "all_gather_into_tensor"))
        return None

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = _op_name(op)
        if async_op or name is None:
            return orig["reduce_scatter_tensor"](output, input, op, group, async_op)
        fcol.reduce_scatter_tensor_inplace(output, input, name, group_of(group, input, "reduce_scatter_tensor"))
        return None

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        even = all(t.shape == tensor.shape for t in tensor_list)
        if async_op or not even or tensor.dim() == 0:
            return orig["all_gather"](tensor_list, tensor, group, async_op)
        fcol.all_gather_inplace(tensor_list, tensor, group_of(group, tensor, "all_gather"))
        return None

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        if async_op:
            return orig["broadcast"](tensor, src, group, async_op, group_src)
        g = group_of(group, tensor, "broadcast")
        root = group_src if group_src is not None else dist.get_group_rank(g, src)
        tensor.copy_(fcol.broadcast(tensor, root, g))
        return None

    out = {"all_reduce": all_reduce, "all_gather_into_tensor": all_gather_into_tensor,
           "reduce_scatter_tensor": reduce_scatter_tensor, "all_gather": all_gather, "broadcast": broadcast}
    for name, fn in out.items():
        fn.__wrapped__ = orig[name]
        fn.__doc__ = orig[name].__doc__
    return out


@contextlib.contextmanager
def remapped(reg):
    """Around one trace: torch.distributed's collectives as functional collectives (module doc);
    the process groups they used are added to ``reg.collective_groups``."""
    seen: list = []
    with _patching(reg, _remapped, seen):
        yield


@contextlib.contextmanager
def _patching(reg, replacements_for, seen: list):
    """torch.distributed's functions replaced by ``replacements_for(seen)`` while inside (when a
    process group exists); the groups they used (``seen``) are added to ``reg.collective_groups``."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    from torch.distributed import distributed_c10d as c10d
    replacements = replacements_for(seen)
    try:
        with patched(dist, replacements), patched(c10d, replacements):
            yield
    finally:
        for g in seen:
            if all(g is not h for h in reg.collective_groups):
                reg.collective_groups.append(g)


@contextlib.contextmanager
def watching(reg):
    """Around the eager warm-up: the process groups of the collectives the step calls, so that
    the ranks agree before its first capture too (``distributed.agree``)."""
    seen: list = []
    with _patching(reg, _noting, seen):
        yield


def _noting(seen: list) -> dict:
    """The torch.distributed functions, each noting the group it is given in ``seen``."""
    import torch.distributed as dist

    def noting(name, f):
        at = _GROUP_ARG[name]

        def call(*args, **kwargs):
            group = kwargs.get("group", args[at] if len(args) > at else None)
            seen.append(group if group is not None else dist.group.WORLD)
            return f(*args, **kwargs)
        return call
    return {name: noting(name, getattr(dist, name)) for name in _GROUP_ARG}


# (position of ``group`` in each function's signature)
_GROUP_ARG = {"all_reduce": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3, "all_gather": 2,
              "broadcast": 2}


def refuse_direct_collectives(gm) -> None:
    """c10d ops left in the graph (a collective ``remapped`` could not route, reached some other
    way than ``direct_collective`` saw): refused, naming the step function."""
    from ..errors import CaptureError
    ops = sorted({str(n.target) for n in gm.graph.nodes
                  if n.op == "call_function" and getattr(n.target, "namespace", "") == "c10d"})
    if ops:
        raise CaptureError(
            f"the step calls torch.distributed collectives directly ({', '.join(ops)}) in a form "
            "stepgraph does not trace: they complete through Work objects a captured graph cannot "
            "replay; this call ran eagerly to its end", op=ops[0], where="the step function", fix=_FIX)


def direct_collective(func, problems: list) -> None:
    """While tracing: a c10d op reached (``dist.all_reduce(t, async_op=True)``, or an all_reduce
    imported by name) is a problem at the user's line."""
    if getattr(func, "namespace", "") != "c10d" or any(p.op == str(func) for p in problems):
        return
    from .effects import Problem
    from ..errors import user_frame
    problems.append(Problem(
        f"the step calls a torch.distributed collective ({func}) in a form stepgraph does not "
        "trace (async_op=True, a reduction or uneven sizes the functional collectives lack, or a "
        "function imported by name): it completes through a Work object a captured graph cannot "
        "replay", user_frame(), _FIX, plain=True))
