"""DistributedDataParallel inside a captured step, and rank agreement on captures.

DDP's C++ Reducer all-reduces gradients through ``Work`` objects and autograd-engine
callbacks that a trace cannot see (replaying its trace gave diverging ranks). So while
stepgraph traces, each DDP module

* runs its wrapped module directly (DDP's buffer broadcast, when DDP would do it, becomes a
  functional broadcast), and
* all-reduces gradients from post-accumulate-grad hooks, bucket by bucket, with
  ``torch.distributed._functional_collectives``: plain aten ops
  (``_c10d_functional.all_reduce`` + ``wait_tensor``) that ``make_fx`` records, the replay
  backend re-runs (gloo, CPU) and a CUDA graph captures (NCCL).

Numerics follow the Reducer: ``grad * (1 / world_size)``, then a sum across ranks, copied
back into ``p.grad`` -- equal to eager DDP's bit for bit. Synchronisation is decided at
forward time as DDP does (``no_sync()`` around a forward skips the all-reduce of its
backward), so accumulation inside the step works.

Ranks must capture the same graph at the same call: before every capture (and every eager
fallback) of a step holding a DDP module, the ranks meet in the process group's store and
compare what they are about to capture (``agree``). A rank that replays while another
recaptures never reaches that meeting: the capturing rank raises after ``STEPGRAPH_DIST_TIMEOUT``
seconds naming the missing ranks and leaves an abort mark in the store; every rank's monitor
thread then aborts its NCCL communicator, so the replaying rank's next call raises (gloo has
no abort for an op in flight: there it fails when its peer's process ends, or at the group's
timeout).
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import config
from ..errors import CaptureError, GuardMiss

_STEP_KEYS: dict = {}  # step name -> per-process count of step functions with that name


def _refuse_unsupported(ddp, name: str) -> None:
    what = None
    if ddp.find_unused_parameters:
        what, fix = "find_unused_parameters=True", "construct DDP with find_unused_parameters=False"
    elif ddp._comm_hooks:
        what, fix = "a DDP communication hook (register_comm_hook)", "remove the comm hook"
    elif getattr(ddp, "mixed_precision", None) is not None:
        what, fix = "DDP's mixed_precision", "use torch.autocast inside the step instead"
    elif ddp._use_python_reducer:
        what, fix = "DDP's python reducer (compiled autograd)", "unset optimize_ddp='python_reducer'"
    if what is not None:
        raise CaptureError(f"the step's DistributedDataParallel model {name} uses {what}, which "
                           "stepgraph does not capture",
                           op="DistributedDataParallel", where="the step function",
                           fix=f"{fix}, or run the step eagerly (STEPGRAPH_DISABLE=1)")


@dataclass
class _Bucket:
    params: list
    ready: set = field(default_factory=set)


@dataclass
class _DDPTrace:
    """Per DDP module, during one trace: buckets and whether a backward is due to sync."""
    ddp: nn.Module
    name: str
    buckets: list
    armed: bool = False
    done: set = field(default_factory=set)   # ids of buckets all-reduced since the forward
    pending: list = field(default_factory=list)  # (all-reduce output, grads) not yet waited on
    problems: list = field(default_factory=list)

    def forward(self, *inputs, **kwargs):
        ddp = self.ddp
        from torch.distributed import _functional_collectives as fcol
        if ddp.require_forward_param_sync and ddp.broadcast_buffers and ddp.modules_buffers:
            # DDP keeps buffers (BatchNorm statistics) equal to rank 0's before each forward.
            src = getattr(ddp, "_authoritative_rank", 0)
            for b in ddp.modules_buffers:
                b.copy_(fcol.broadcast(b, src, ddp.process_group))
        if ddp.device_ids:
            # DDP moves inputs to its device; a CPU batch then shows up as CPU work in a CUDA
            # step, which the trace reports with the user's line and the fix.
            import torch.utils._pytree as pytree
            dev = torch.device(ddp.device_type, ddp.device_ids[0])
            inputs, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(dev), (inputs, kwargs))
        out = ddp.module(*inputs, **kwargs)
        sync = torch.is_grad_enabled() and ddp.require_backward_grad_sync
        ddp.require_forward_param_sync = sync
        if sync:
            for b in self.buckets:
                b.ready.clear()
            self.done.clear()
            self.armed = True
        return out

    def hook(self, bucket: _Bucket, p: torch.Tensor) -> None:
        if not self.armed or p.grad is None:
            return
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._all_reduce(bucket)

    def _all_reduce(self, bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params]
        pg = self.ddp.process_group
        world = torch.distributed.get_world_size(pg)
        # One elementwise scale then one collective per bucket: the Reducer's arithmetic. The
        # wait comes after the last bucket is issued, so collectives overlap the backward.
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(1.0 / world)
        self.pending.append((torch.ops._c10d_functional.all_reduce(flat, "sum", pg.group_name), grads))
        self.done.add(id(bucket))
        if len(self.done) == len(self.buckets):
            for flat, grads in self.pending:
                flat = torch.ops._c10d_functional.wait_tensor(flat)
                off = 0
                for g in grads:
                    g.copy_(flat[off:off + g.numel()].view_as(g))
                    off += g.numel()
            self.pending.clear()
            self.armed = False  # this backward is synchronised; the next needs a forward

    def finish(self) -> None:
        for flat, _ in self.pending:  # (only after a failed sync) leave no collective in flight
            torch.ops._c10d_functional.wait_tensor(flat)
        self.pending.clear()
        if self.armed:
            waiting = [p for b in self.buckets if id(b) not in self.done for p in b.params
                       if id(p) not in b.ready]
            if not self.done and not any(b.ready for b in self.buckets):
                self.problems.append(
                    f"{self.name} ran a forward that DDP would synchronise, but no backward through "
                    "it ran inside the step (gradients would never be all-reduced)")
            elif waiting:
                self.problems.append(
                    f"{self.name}: {len(waiting)} parameter(s) got no gradient in a synchronised "
                    "backward (DDP needs find_unused_parameters=True for that, which stepgraph "
                    "does not capture)")


def _buckets(ddp) -> list[_Bucket]:
    """Reverse registration order (about the order gradients become ready), by dtype, capped at
    DDP's bucket size: the Reducer's layout, so collectives overlap the rest of the backward."""
    cap = int(getattr(ddp, "bucket_bytes_cap", 25 * 1024 * 1024))
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    out, open_by_dtype = [], {}
    for p in reversed(params):
        b, size = open_by_dtype.get(p.dtype, (None, 0))
        if b is None or size + p.numel() * p.element_size() > cap:
            b, size = _Bucket([]), 0
            out.append(b)
        b.params.append(p)
        open_by_dtype[p.dtype] = (b, size + p.numel() * p.element_size())
    return out


@contextlib.contextmanager
def tracing(reg):
    """Around one trace: route each DDP module's forward and gradient sync through functional
    collectives (see the module doc). Yields the per-module trace records."""
    if not reg.ddp:
        yield []
        return
    records, handles = [], []
    for name, ddp in reg.ddp:
        _refuse_unsupported(ddp, name)
        rec = _DDPTrace(ddp, name, _buckets(ddp))
        records.append(rec)
        ddp.forward = rec.forward  # instance attribute: nn.Module.__call__ finds it first
        for b in rec.buckets:
            for p in b.params:
                handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, rec=rec, b=b: rec.hook(b, p)))
    try:
        yield records
    finally:
        for h in handles:
            h.remove()
        for rec in records:
            rec.ddp.__dict__.pop("forward", None)
    problems = []
    for rec in records:
        rec.finish()
        problems += rec.problems
    if problems:
        raise CaptureError(problems[0] + "; this call ran to its end as eager DDP would",
                           op="DistributedDataParallel", where="the step function",
                           fix="run forward and loss.backward() of the DDP model inside the step, "
                               "with every parameter used")


def world(reg) -> tuple[int, int, object] | None:
    """(rank, world size, process group) when the step holds a DDP or FSDP2 module or calls
    collectives itself, and a group exists."""
    if not (reg.ddp or reg.fsdp or reg.collective_groups) or not torch.distributed.is_initialized():
        return None
    from .fsdp import process_group
    pg = (reg.ddp[0][1].process_group if reg.ddp else process_group(reg) if reg.fsdp
          else reg.collective_groups[0])   # (dist.all_reduce in the step: collectives.py)
    return torch.distributed.get_rank(pg), torch.distributed.get_world_size(pg), pg


def describe_call(leaves, calls: int, what: str) -> str:
    """What this rank is about to do, in words every rank can compare (no device indices)."""
    parts = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}")
        else:
            parts.append(repr(x)[:40])
    return f"{what} at call {calls} with inputs ({', '.join(parts)})"


class agree:
    """Meet every rank in the default store before a capture; raise on every rank that got
    there if they disagree, and on a rank whose peers never come (they replayed instead)."""

    def __init__(self, step_name: str):
        n = _STEP_KEYS.get(step_name, 0)
        _STEP_KEYS[step_name] = n + 1
        self.prefix = f"stepgraph/{step_name}#{n}"
        self.meetings = 0
        self.aborted: str | None = None  # set by the monitor: another rank gave up on this step
        self._monitor = None

    def aborted_message(self) -> str:
        return (f"another rank gave up on this data-parallel step ({self.aborted}); this rank's "
                "process group was aborted, so its collectives cannot complete: stop this run, "
                "and give every rank the same shapes and state changes at the same call")

    def _watch(self, store, pg, rank: int) -> None:
        """A daemon thread polling the store for another rank's give-up (``abort`` key): a rank
        replaying while a peer recaptured is stuck in a collective the peer never joins, so the
        monitor aborts this rank's process group (NCCL kernels exit instead of waiting for the
        group's timeout) and the next call raises ``StepGraphError``."""
        import logging
        import threading
        import time
        key = f"{self.prefix}/abort"
        period = min(1.0, float(config.get("dist_timeout")) / 4)

        def loop():
            while self.aborted is None:
                time.sleep(period)
                try:
                    if not store.check([key]):
                        continue
                    self.aborted = store.get(key).decode()
                except Exception:  # noqa: BLE001 - the group was torn down: stop watching
                    return
                logging.getLogger("stepgraph").error(
                    "stepgraph: rank %d: %s; aborting this rank's process group", rank, self.aborted)
                try:
                    # NCCL: abort makes kernels stuck in a collective exit (measured: 5.2 s with a
                    # 4 s timeout). gloo: shutdown is the closest call; measured, it does not end
                    # an op already in flight, which then fails at the peer's exit or timeout.
                    if torch.distributed.get_backend(pg) == "nccl":
                        pg.abort()
                    else:
                        pg.shutdown()
                except Exception:  # noqa: BLE001 - then the group's own timeout ends it
                    pass
        self._monitor = threading.Thread(target=loop, name=f"stepgraph-monitor {self.prefix}", daemon=True)
        self._monitor.start()

    def __call__(self, reg, leaves, calls: int, what: str, why: str | None = None) -> None:
        """Before ``what`` ("capture" / "eager call") at call ``calls`` with input ``leaves``;
        ``why``: this rank's reason to capture (named in the error, not compared)."""
        w = world(reg)
        if w is None or w[1] == 1:
            return
        rank, size, pg = w
        description = describe_call(leaves, calls, what)
        from torch.distributed import distributed_c10d as c10d
        store = c10d._get_default_store()
        k = self.meetings
        self.meetings += 1
        keys = [f"{self.prefix}/{k}/{r}" for r in range(size)]
        store.set(keys[rank], description)
        timeout = float(config.get("dist_timeout"))
        if self._monitor is None:
            self._watch(store, pg, rank)
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - the store raises its own timeout types
            missing = [r for r in range(size) if not store.check([keys[r]])]
            store.set(f"{self.prefix}/abort", f"rank {rank} gave up waiting for rank(s) {missing} at capture "
                      f"#{k} of this step (they replayed while it recaptured)")
            read = why is not None and why.startswith(GuardMiss.PREFIX)
            raise CaptureError(
                f"rank {rank} is about to capture ({description}"
                + (f", because the {why}" if why else "") + f"), but rank(s) {missing} did not "
                f"reach capture #{k} of this step within {timeout:g} s: they replayed a graph "
                "instead, so the ranks disagree on whether to recapture (their collectives will "
                "fail or time out too); this call did not run",
                op="rank agreement", where="the step function",
                fix=("the value read on the host decides the step's graph and differs between ranks "
                     "(each rank's own loss or batch): make it the same on every rank before the step "
                     "decides on it (torch.distributed.all_reduce of the value, or of a skip flag), or "
                     "decide outside the step" if read else
                     "give every rank the same shapes, hyper-parameters and state changes at the "
                     "same call (e.g. DataLoader(drop_last=True))") + "; STEPGRAPH_DIST_TIMEOUT sets "
                    "the wait") from None
        seen = [store.get(key).decode() for key in keys]
        if len(set(seen)) > 1:
            lines = "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
            raise CaptureError(
                f"ranks disagree on capture #{k} of this step ({lines}); a graph whose collectives "
                "differ across ranks would hang or mix gradients, so no rank ran this call",
                op="rank agreement", where="the step function",
                fix="give every rank the same input shapes and the same hyper-parameter and state "
                    "changes at the same call (e.g. DataLoader(drop_last=True))")
