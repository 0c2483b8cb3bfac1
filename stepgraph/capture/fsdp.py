"""FSDP2 (``torch.distributed.fsdp.fully_shard``) inside a captured step.

FSDP2's hooks run inside the trace as in eager (pre-forward all-gather, post-forward reshard,
pre-backward all-gather, post-backward reduce-scatter, the root's end-of-backward callback), so
the graph holds every op they issue. Two things they do would not replay, and are rerouted
while stepgraph traces:

* Collectives. FSDP2 all-gathers and reduce-scatters through c10d ``Work`` objects, which a
  trace does not see. Each parameter group's ``AllGather`` / ``ReduceScatter`` (the objects
  ``set_custom_all_gather`` installs) is swapped for one issuing the traceable functional
  collectives (``_c10d_functional.all_gather_into_tensor`` / ``reduce_scatter_tensor`` +
  ``wait_tensor``) into the same buffers: the same c10d kernels, so numerics equal eager's.
* Storage frees. FSDP2 frees an unsharded parameter's storage after use and allocates it again
  before the next all-gather (``UntypedStorage.resize_``, outside the dispatcher). While tracing,
  its ``alloc_storage`` / ``free_storage`` call ``inductor.resize_storage_bytes_`` instead: an op
  the graph records. After the trace, ``passes/unsharded.py`` turns each such storage into graph
  temporaries (one per all-gather interval) where it can prove that safe, so no resize is left
  for a CUDA graph to refuse; a storage it leaves keeps its resizes (replay backend).

FSDP2's Python flags that decide which ops its hooks run (``set_requires_gradient_sync``,
``set_reshard_after_backward``, ...) are part of the step's signature (``key``): changing one
recaptures. What is not captured is refused before the call is traced (``refusal``).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

from ..errors import CaptureError

_SIMPLE = (bool, int, float, str, type(None))


def fsdp_modules(modules) -> list:
    """``(name, module)`` of every ``fully_shard``ed module under ``modules`` (name, Module) pairs."""
    # Not imported means nothing is sharded; steps without FSDP2 never pay for importing it.
    FSDPModule = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if FSDPModule is None:
        return []
    return [(f"{root}.{sub}" if sub else root, m) for root, mod in modules
            for sub, m in mod.named_modules() if isinstance(m, FSDPModule)]


def _state_groups(st) -> list:
    """A state's parameter groups: a list on torch 2.13 (``_fsdp_param_groups``), one group or None
    on torch 2.11 (``_fsdp_param_group``; the H100's torch had no list)."""
    if hasattr(st, "_fsdp_param_groups"):
        return list(st._fsdp_param_groups)
    g = getattr(st, "_fsdp_param_group", None)
    return [] if g is None else [g]


def _groups(m) -> list:
    return _state_groups(m._get_fsdp_state())


def key(fsdp) -> tuple:
    """FSDP2's Python settings that choose what its hooks do, per module: any change recaptures."""
    out = []
    for _, m in fsdp:
        st = m._get_fsdp_state()
        flags = [(k, v) for k, v in vars(st._state_ctx).items() if isinstance(v, _SIMPLE)]
        flags.append(len(st._states_to_forward_prefetch) + 1000 * len(st._states_to_backward_prefetch))
        for g in _state_groups(st):
            flags += [(k, v) for k, v in vars(g).items() if isinstance(v, _SIMPLE)]
            flags += [g.post_forward_mesh_info is None, g._all_reduce_hook is None,
                      type(g._all_gather_comm).__name__, type(g._reduce_scatter_comm).__name__]
            # The graph assumes FSDP2 at rest (parameters sharded, their unsharded storages empty:
            # passes/unsharded.py); an eager ``model.unshard()`` before a call is another state.
            flags.append(tuple(p.sharded_state.name for p in g.fsdp_params))
        out.append(tuple(flags))
    return tuple(out)


def _refuse(name: str, what: str, fix: str) -> CaptureError:
    return CaptureError(
        f"{name} is sharded with FSDP2 (torch.distributed.fsdp.fully_shard) and uses {what}, which "
        "stepgraph does not capture yet\n  this call ran eagerly to its end: your model and "
        "optimizer hold the result of this step", op=f"FSDP2 {name}", where="the step function",
        fix=f"{fix}, or keep this step eager: stepgraph.compile(step, on_capture_error='eager') "
            "runs it eagerly from here on with one warning")


def refusal(reg, device: str, backend: str) -> CaptureError | None:
    """Before tracing: a ``CaptureError`` for an FSDP2 setup the capture does not cover; else None."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.tensor import DTensor
    from .. import config
    for name, m in reg.fsdp:
        st = m._get_fsdp_state()
        if st._is_root is None:
            return _refuse(name, "no lazy initialisation yet (its first call is the capture)",
                           "let the first call run eagerly (the default warmup=1)")
        if device == "cuda" and not config.get("fsdp2_cuda"):
            # On by default: one H100 (torch 2.11, NCCL, world 1, GPT-6L d=384) ran the step as
            # one CUDA graph at 0.09x eager FSDP2's time, 1.05x its memory, bitwise equal
            # (tests/test_cuda_fsdp2.py, 2026-11-23).
            return _refuse(name, "CUDA with STEPGRAPH_FSDP2_CUDA=0", "unset STEPGRAPH_FSDP2_CUDA, or keep "
                           "this step eager (on_capture_error='eager')")
        for g in _state_groups(st):
            what = None
            if type(g.mesh_info) is not FSDPMeshInfo:
                what, fix = "a 2-D mesh (HSDP)", "shard over a 1-D mesh"
            elif type(g._all_gather_comm) is not DefaultAllGather or type(g._reduce_scatter_comm) is not DefaultReduceScatter:
                what, fix = "a custom all-gather or reduce-scatter", "use FSDP2's default collectives"
            elif g._all_reduce_hook is not None:
                what, fix = "an all-reduce hook (set_all_reduce_hook)", "remove the hook"
            elif g.offload_policy.__class__.__name__ != "OffloadPolicy":
                what, fix = "CPU offloading", "drop the offload policy"
            elif g.gradient_divide_factor is not None or g.force_sum_reduction_for_comms:
                what, fix = "a custom gradient divide factor", "keep FSDP2's default averaging"
            elif g.post_forward_mesh_info is not None and g.post_forward_mesh_info.shard_mesh_size \
                    != g.mesh_info.shard_mesh_size:
                what, fix = "reshard_after_forward=<int>", "use reshard_after_forward=True or False"
            elif any(hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather") for p in g.fsdp_params):
                what, fix = "all-gather extensions (fsdp_pre_all_gather, e.g. float8)", "use plain parameters"
            elif any(p.sharded_param.grad is not None and not isinstance(p.sharded_param.grad, DTensor)
                     for p in g.fsdp_params):
                what, fix = "plain-tensor gradients", "leave gradients to FSDP2"
            elif not g.reduce_grads or _unsharded_grads([(name, m)]):
                what, fix = ("gradient accumulation without sync across calls "
                             "(set_requires_gradient_sync(False))"), "sync every call"
            elif any(p.sharded_param.grad is not None for p in g.fsdp_params):
                what, fix = ("gradients held between calls (zero_grad before backward, or accumulation "
                             "across calls)"), "call opt.zero_grad() at the end of the step"
            if what is not None:
                return _refuse(name, what, fix)
    return None


class _FunctionalAllGather:
    """FSDP2's ``AllGather`` interface over the traceable all-gather (module doc)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        out = torch.ops._c10d_functional.all_gather_into_tensor(input_tensor, group.size(), group.group_name)
        output_tensor.copy_(torch.ops._c10d_functional.wait_tensor(out))
        return None  # no Work: the wait is in the graph


class _FunctionalReduceScatter:
    """FSDP2's ``ReduceScatter`` interface over the traceable reduce-scatter (module doc)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist
        names = {dist.ReduceOp.AVG: "avg", dist.ReduceOp.SUM: "sum"}
        if op not in names:  # (PREMUL_SUM comes only with a divide factor, refused before tracing)
            raise CaptureError(f"FSDP2 reduce-scatter with {op}", op="FSDP2 reduce-scatter",
                               fix="keep FSDP2's default gradient averaging")
        out = torch.ops._c10d_functional.reduce_scatter_tensor(input_tensor, names[op], group.size(),
                                                                group.group_name)
        output_tensor.copy_(torch.ops._c10d_functional.wait_tensor(out))
        return None


def _alloc_storage(tensor: torch.Tensor) -> None:  # FSDP2's alloc_storage, as a recorded op
    size = tensor.numel() * tensor.itemsize
    if tensor.untyped_storage().size() != size:
        torch.ops.inductor.resize_storage_bytes_(tensor, size)


def _free_storage(tensor: torch.Tensor) -> None:  # FSDP2's free_storage, as a recorded op
    if tensor.untyped_storage().size() != 0:
        torch.ops.inductor.resize_storage_bytes_(tensor, 0)


@dataclass
class FSDPTrace:
    """What one trace did to FSDP2's Python state that a replay would not redo."""
    fsdp: list
    key_before: tuple
    problems: list = field(default_factory=list)

    def finish(self) -> None:
        if key(self.fsdp) != self.key_before:
            self.problems.append("the step changes FSDP2 settings (e.g. set_requires_gradient_sync) and "
                                 "leaves them changed: a replay would not change them")
        if _unsharded_grads(self.fsdp):
            self.problems.append("the step leaves unreduced FSDP2 gradients (a backward under "
                                 "set_requires_gradient_sync(False) at its end)")
        elif any(p.sharded_param.grad is not None for _, m in self.fsdp for g in _groups(m) for p in g.fsdp_params):
            # (a replay would not rebind the DTensor .grad it creates)
            self.problems.append("the step leaves FSDP2 gradients set (no opt.zero_grad() after opt.step())")

    def raise_problems(self) -> None:
        """After the call ran to its end (the trace runs the step for real)."""
        if self.problems:
            raise CaptureError(self.problems[0] + "; this call ran to its end as eager FSDP2 would",
                               op="FSDP2", where="the step function",
                               fix="end the step with gradients reduced and FSDP2's settings as they "
                                   "were at its start, or keep it eager (on_capture_error='eager')")


def _unsharded_grads(fsdp) -> bool:
    return any(p.unsharded_accumulated_grad is not None or
               (hasattr(p, "_unsharded_param") and p._unsharded_param.grad is not None)
               for _, m in fsdp for g in _groups(m) for p in g.fsdp_params)


def _at_rest(fsdp) -> bool:
    """FSDP2 between steps (idle, parameters sharded): a rollback of tensors then undoes the rest."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    return all(m._get_fsdp_state()._training_state == TrainingState.IDLE and
               all(g._training_state == TrainingState.IDLE and g._sharded_state == ShardedState.SHARDED
                   for g in _groups(m)) for _, m in fsdp)


@contextlib.contextmanager
def tracing(reg, rollback=None):
    """Around one trace: FSDP2's collectives and storage frees as graph ops (module doc). A trace
    that stops midway leaves FSDP2's hooks mid-step (parameters unsharded, its state machine in
    forward or backward), which the rollback cannot put back: the error then propagates with a
    note instead of an eager rerun. Stopped between FSDP2's hooks, the rollback undoes it."""
    fsdp = reg.fsdp
    if not fsdp:
        yield None
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    saved = [(mod, name, getattr(mod, name)) for mod, name in
             ((_fsdp_param, "alloc_storage"), (_fsdp_param, "free_storage"), (_fsdp_param_group, "alloc_storage"))]
    groups = {id(g): g for _, m in fsdp for g in _groups(m)}.values()
    comms = [(g, g._all_gather_comm, g._reduce_scatter_comm) for g in groups]
    rec = FSDPTrace(fsdp, key(fsdp))
    try:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = _alloc_storage
        _fsdp_param.free_storage = _free_storage
        for g, _, _ in comms:
            g._all_gather_comm, g._reduce_scatter_comm = _FunctionalAllGather(), _FunctionalReduceScatter()
        yield rec
    except BaseException:
        if rollback is not None and rollback.lost is None and not _at_rest(fsdp):
            rollback.lost = "FSDP2's hooks stopped mid-step; their Python state cannot be put back"
        raise
    finally:
        for mod, name, f in saved:
            setattr(mod, name, f)
        for g, ag, rs in comms:
            g._all_gather_comm, g._reduce_scatter_comm = ag, rs
    rec.finish()


def process_group(reg):
    """The process group the step's FSDP2 modules shard over (for rank agreement), or None."""
    for _, m in reg.fsdp:
        for g in _groups(m):
            return g.mesh_info.shard_process_group
    return None
