"""Backends turn a cleaned whole-step graph into something fast to call.

Each backend is a ``Backend`` whose ``compile(gm, example_inputs, ...)`` returns a
:class:`Runner` (runner.py): called with the flat graph inputs (user tensors then persistent
grads), it returns the flat graph outputs, and declares its optional abilities (``stale()``,
``wait()``, ``describe()``, ...). The registry below is the single place that names backends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import StepGraphError
from .runner import Runner


@dataclass(frozen=True)
class CompileRequest:
    """What a backend's ``compile(gm, example_inputs, request)`` gets besides the graph."""
    pool: object = None               # CUDA graph memory pool shared by one step's graphs
    # One entry per graph recorded into ``pool``: with two or more, a replay of one may write over
    # another's outputs (its intermediates reuse what was free when it was recorded), so the rebound
    # slots and grads are handed out as copies too (CudaGraphRunner, SegmentedRunner).
    pool_graphs: list | None = None
    inputs_written: tuple = ()        # graph input positions the step writes in place
    clone_outputs: bool = True        # return copies, so results never live in a graph's pool
    n_user_outputs: int | None = None  # outputs before the rebound slots and grads
    state_tensors: tuple = ()         # tensors the graph holds by address (Runner.stale)
    host_scalar_ops: tuple = ()       # (op, site) of CPU 0-dim ops in a CUDA step (only replay runs them)
    rng_state_calls: int = 0          # host RNG get/set calls (checkpointing)
    grad_bindings: tuple = ()         # (kind, param, node): .grad bound if the graph raises midway
    on_fused: Callable | None = None  # (seconds, parity) -> None when a background compile switches
    name_of: Callable | None = None   # tensor -> its user-facing name (the switch's parity warning)
    input_names: tuple = ()           # a name per graph input (arguments, then persistent grads)


@dataclass(frozen=True)
class Backend:
    name: str
    compile: Callable
    doc: str
    device_types: tuple = ("cpu", "cuda")
    prepare: Callable | None = None   # (StateRegistry) -> list of changes, run before tracing
    trace_context: Callable | None = None  # (StateRegistry) -> context manager around the trace
    # (gm, example_inputs, CompileRequest) -> runner for a graph with host reads (segments between the
    # reads); None: such graphs run on ``replay`` (NeedsReplay; ``auto`` falls back, warned).
    segmented: Callable | None = None
    runs_host_reads: bool = False  # the plain ``compile`` runs host reads itself (replay)


def _registry() -> dict:
    from . import cudagraph, inductor, replay
    return {b.name: b for b in (replay.BACKEND, cudagraph.BACKEND, inductor.BACKEND)}


def pick(name: str, device_type: str) -> Backend:
    """Resolve ``backend=`` for a step whose tensors live on ``device_type``.

    ``auto``: ``cudagraph`` on CUDA, ``replay`` elsewhere.
    """
    reg = _registry()
    if name == "auto":
        name = "cudagraph" if device_type == "cuda" else "replay"
    if name not in reg:
        raise StepGraphError(f"unknown backend {name!r}; choose one of: auto, {', '.join(reg)}")
    b = reg[name]
    if device_type not in b.device_types:
        raise StepGraphError(f"backend {name!r} does not run on {device_type} tensors; "
                             f"use backend='auto' or one of {[k for k, v in reg.items() if device_type in v.device_types]}")
    return b


def names() -> list[str]:
    return ["auto", *_registry()]


__all__ = ["Backend", "CompileRequest", "Runner", "pick", "names", "torch"]
