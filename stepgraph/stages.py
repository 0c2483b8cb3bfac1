"""The capture pipeline's stage artifacts (pipeline.py): a :class:`Plan` says what a capture is
for, ``trace`` and ``clean`` fill a :class:`Traced`, ``lower`` gives a :class:`Lowered`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .backends import Backend, Runner
from .capture.guards import Signature
from .capture.pybefore import PyBefore
from .capture.sigkey import SignatureKey
from .capture.trace import TraceResult
from .passes import GraphSummary


@dataclass
class Plan:
    """What this capture is for: the call's signature, where it runs, and why it captures."""
    sig: Signature
    device: str
    backend: Backend
    reason: str | None    # the recapture reason (None for the first capture)
    started: float = 0.0  # perf_counter at the start of the capture proper (stats.capture_seconds)
    refusal: Exception | None = None  # decided before prepare: the call runs eagerly, then raises it


@dataclass
class Traced:
    """The traced graph and the facts about it that lowering and replay need (``clean``'s output)."""
    trace: TraceResult
    frozen: SignatureKey            # the key with nothing read live, taken before the call
    ddp_records: list               # DDP modules seen while tracing
    fsdp_record: object = None      # fsdp.FSDPTrace: what the trace did to FSDP2's Python state
    py_before: tuple = ()           # Python values the step reads, before the call
    sizes_before: list = field(default_factory=list)  # sizes of containers the step reads, before
    hidden_before: list = field(default_factory=list)  # containers in user objects it reads (outputs.py)
    graph: torch.fx.GraphModule | None = None   # cleaned
    checks: list = field(default_factory=list)  # tracked.Check: Python numbers the graph used
    guard_plan: object = None                   # passes.guards.GuardPlan
    bindings: list = field(default_factory=list)  # .grad bindings if the graph raises midway
    summary: GraphSummary | None = None
    n_user: int = 0                             # tensor outputs the user gets
    notes: list = field(default_factory=list)   # what runs only at capture (for explain())
    generators: list = field(default_factory=list)  # host random generators the step reads, with their states
    library_state: list = field(default_factory=list)  # plain attributes of library objects it reads (libstate.py)
    training_before: list = field(default_factory=list)  # (module, .training) before the call
    before: PyBefore | None = None              # its defaultdicts and tensors before the call (pybefore.py)


@dataclass
class Lowered:
    run: Runner
    backend: Backend            # replay when auto fell back
    device_scalars: object      # passes.device_scalars.DeviceScalars or None
    moved: tuple = ()           # passes.moved_arguments.MovedArgument: CPU arguments moved per call
    prologue: object = None     # passes.host_prologue.Prologue: CPU work run before the graph per call


class _Done:
    """The call's result, once it has run to its end (eager or traced): a failure after that
    point returns it instead of running the step again."""
    result: tuple | None = None
