"""What a capture produces: ``CapturedStep`` (one graph and how to replay it) and ``Stats``."""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.utils._pytree as pytree

from .backends.runner import Runner
from .capture.sigkey import SignatureKey
from .capture.trace import TraceResult
from .capture import argtree
from .capture.arrays import as_input
from .capture.libraries import scheduled_tensors
from .capture.numchecks import checks_hold, evaluate, roots_of, set_call
from .errors import GuardMiss, StepGraphError
from .passes import GraphSummary


class Branch(str, enum.Enum):
    """Which way the call policy (``StepFunction.__call__``) sent a call. (A str enum: its hash
    is str's, in C; a plain Enum's Python ``__hash__`` cost ~0.5 µs per replay in stats.)"""
    WARMUP = "warm-up"    # ran eagerly to create the state the capture is for
    CAPTURE = "capture"   # traced while it ran (eager's result if the capture failed)
    REPLAY = "replay"     # a captured graph ran instead of the step's Python
    EAGER = "eager"       # ran eagerly: disabled, eager-only after a failure, or past max_captures


@dataclass
class Stats:
    """Counters of what each call did. ``recaptures`` holds one reason line per recapture;
    ``branches`` counts calls per :class:`Branch`, ``last_branch`` is the latest call's."""
    eager_calls: int = 0
    new_state_warmups: int = 0     # of which warm-ups of a model/optimizer argument new to the step
    captures: int = 0
    replays: int = 0
    recaptures: list = field(default_factory=list)
    failed_captures: int = 0
    check_reports: list = field(default_factory=list)  # check mode: one line per checked replay
    capture_seconds: float = 0.0   # wall time of captures: trace + passes + backend compile
    compile_seconds: float = 0.0   # of which backend compilation (Inductor)
    guard_misses: dict = field(default_factory=dict)  # host-read site -> replays it sent back
    branches: dict = field(default_factory=dict)  # Branch -> calls
    last_branch: Branch | None = None
    fused_parity: list = field(default_factory=list)  # verify.ParityResult per switch to a fused graph

    def took(self, branch: Branch) -> None:
        self.branches[branch] = self.branches.get(branch, 0) + 1
        self.last_branch = branch


@dataclass(kw_only=True)
class CapturedStep:
    """One captured graph and everything needed to replay it and to explain it (keyword-built)."""
    key: SignatureKey
    graph: torch.fx.GraphModule
    run: Runner                # the backend's runner: flat inputs -> flat outputs
    trace: TraceResult
    summary: GraphSummary
    backend: str
    seconds: float
    captured_at_call: int
    n_user_outputs: int
    tensor_pos: list
    flat_args: bool          # the call was f(*tensors_or_scalars) with no containers or kwargs
    stale: Callable[[], str | None]  # run.stale, bound at capture: why held addresses moved
    distributed: bool = False  # the graph runs collectives (DDP gradient sync)
    python_effects: list = field(default_factory=list)  # (object, attribute, value) the step sets
    guard_plan: object = None  # passes.guards.GuardPlan when the step reads values on the host
    siblings: list = field(default_factory=list)  # graphs for the same key, other host-read values
    gave_up: bool = False      # its host reads keep changing past max_captures: run eagerly
    last_good: object = None   # the graph of this chain the last replay ran (tried first next time)
    device_scalars: object = None  # passes.device_scalars.DeviceScalars: live floats fed as a tensor
    checks: list = field(default_factory=list)  # tracked.Check: Python numbers the graph used
    last_reads: dict = field(default_factory=dict)  # id(Root("read")) -> the last replay's value
    to_device: tuple = ()      # passes.moved_arguments.MovedArgument: CPU arguments the step moves
    prologue: object = None    # passes.host_prologue.Prologue: the step's CPU work, before the graph
    arrays: bool = False       # some inputs are numpy arrays (capture/arrays.py)
    draws_used: int | None = None  # host draws taken before the call that its path makes (fetches.py)
    generators: tuple = ()     # (leaf index, the capture's CPU torch.Generator argument: its ops draw from it)

    def checks_hold(self, leaves, args) -> bool:
        return not self.checks or checks_hold(self.checks, leaves, args)

    def check_miss(self, leaves, args) -> str:
        memo: dict = {}
        return next((c.miss(leaves, args) for c in self.checks if not c.holds(leaves, args, memo)), "")

    def moved_numbers(self, leaves, args) -> set:
        """Labels of the numbers behind the value checks that miss now (not the decisions: a
        branch stays guarded): a recapture reads them live (UseLog.moving)."""
        memo: dict = {}
        return {r.label for c in self.checks if not c.decided and not c.holds(leaves, args, memo)
                for r in roots_of(c.expr) if r.kind != "read"}

    def number_effects(self, args, kwargs) -> None:
        """Numbers the step assigned from tracked arithmetic (``completed_steps += 1``): computed
        from the values before any is written, then written, as the step's Python did."""
        effects = self.trace.number_effects
        if not effects:
            return
        leaves = argtree.leaves(args, kwargs)
        memo: dict = dict(self.last_reads)   # host reads the effects use: this replay's values
        values = [e.value(leaves, args, memo) for e in effects]
        for e, v in zip(effects, values):
            e.write(v, args)

    def replay_args(self, args, kwargs):
        """Replay for a call whose quick key matched: same structure as the captured call."""
        leaves = list(args) if self.flat_args else argtree.leaves(args, kwargs)
        return self.replay(leaves, self.tensor_pos, args)

    def replay(self, leaves, tensor_pos, args=()) -> object:
        tr = self.trace
        # (``t0 = time.time()`` at the step's top: read now, as eager read it before its work)
        started = {id(r): r.ref() for r in tr.uses.start_clocks} if tr.uses is not None else {}
        set_call(leaves, args)   # (numbers of the call read live: uselog._reader)
        inputs = [leaves[i] for i in tensor_pos]
        if self.arrays:   # (numpy arrays: their memory as tensors, capture/arrays.py)
            inputs = [as_input(x) for x in inputs]
        for m in self.to_device:   # (x.to(device) in the step, as eager copies it)
            inputs[m.index] = inputs[m.index].to(m.device)
        inputs += [p.grad for p, _ in tr.grad_inputs]
        inputs += [s.read(()) for s in tr.source_inputs]   # loop variables holding tensors (pyeffects.py)
        handed = [(g, leaves[i]) for i, g in self.generators if leaves[i] is not g]
        for g, new in handed:   # (a new Generator this call: the graph's draws come from its state)
            g.set_state(new.get_state())
        # (MoCo's torch.randperm(n).cuda() is drawn here, before the graph: a sibling graph
        # whose guard misses gives the draw back, as the graph's own rewind cannot)
        drawn = torch.default_generator.get_state() if self.prologue is not None and self.prologue.draws else None
        if self.prologue is not None:   # (torch.randint(...).to(device): drawn now, as eager does)
            inputs += self.prologue(inputs)
        if self.device_scalars is not None:
            inputs.append(self.device_scalars.pack())
        lrs = scheduled_tensors(tr.scheduler_steps) if tr.scheduler_steps else ()
        try:
            outs = self.run(inputs)
        except GuardMiss:
            if drawn is not None:
                torch.default_generator.set_state(drawn)
            raise
        except RuntimeError as e:
            if not self.distributed:
                raise
            raise StepGraphError(
                "a collective of the replayed graph failed: another rank stopped, or it recaptured "
                "while this rank replayed (ranks must see the same shapes and state changes at "
                f"the same call; see the other ranks' errors): {str(e).splitlines()[0][:200]}") from e
        finally:
            set_call(None, None)   # (it holds the call's arguments: a model passed in must not outlive it)
            for g, new in handed:
                new.set_state(g.get_state())
        if self.device_scalars is not None and self.device_scalars.outputs:
            outs = self.device_scalars.fill_outputs(outs)
        if tr.to_host:   # (return loss.cpu() in a CUDA step: copied now, as eager's .cpu() did)
            outs = [o.cpu() if i in tr.to_host else o for i, o in enumerate(outs)]
        for obj, attr, value in self.python_effects:
            setattr(obj, attr, value)  # e.g. DDP's "sync buffers at the next forward" flag
        for e in tr.attr_sets:   # (torchmetrics' ``self._computed = None``: modstate.py)
            e.write()
        n = self.n_user_outputs
        for slot, value in zip(tr.escapes, outs[n:]):
            slot.set(value)
        n += len(tr.escapes)
        for i, value in zip(tr.input_grads, outs[n:]):
            if not leaves[i].requires_grad:   # (FGSM's ``x.requires_grad_()`` in the step: eager leaves it on)
                leaves[i].requires_grad_(True)
            leaves[i].grad = value
        for slot, value in tr.clear_slots:
            slot.set(value)
        self.last_reads = {**started, **{id(r): outs[i] for r, i in tr.read_roots}}
        with torch.no_grad():
            for t, before in lrs:   # (the scheduler computes this call's lr from the one before)
                t.copy_(before)
        for sched, a, k, _ in tr.scheduler_steps:   # LR schedulers stepped inside the step: run again,
            if any(_tracked(x) for x in (*a, *k.values())):   # with this call's epoch (transformer-xl's
                memo = dict(self.last_reads)                  # scheduler.step(train_step): it froze)
                a = [evaluate(x._e, leaves, args, memo) if _tracked(x) else x for x in a]
                k = {n: evaluate(x._e, leaves, args, memo) if _tracked(x) else x for n, x in k.items()}
            sched.step(*a, **k)
        for e in tr.source_effects:
            e.source.write(e.value(outs), args)   # total_loss = <this replay's tensor> (pyeffects.py)
        for e in tr.slot_effects:
            e.source.write(e.value(outs), args)   # state['exp_avg_lr_1'] = <this replay's float> (rebound.py)
        for e in tr.append_effects:
            e.source.read(()).append(e.value(outs))   # history.append(<this replay's value>)
        memo = dict(self.last_reads)
        for c in tr.call_effects:   # pbar.set_postfix(loss=<this replay's read>) (pycalls.py)
            c.run(outs, lambda e: evaluate(e, leaves, args, memo))
        result = [outs[v] if kind in ("tensor", "read") else outs[v].numpy() if kind == "numpy" else v() if kind == "live"
                  else evaluate(v, leaves, args, memo) if kind == "number" else v for kind, v in tr.out_leaves]
        return pytree.tree_unflatten(result, tr.out_spec)


def plain_floats(result):
    """The capturing call's result with tracing floats (live reads, hyper-parameters) as the
    plain floats eager returns: they hold graph nodes the user should not keep alive."""
    from .capture.hostscalar import HostFloat, _plain
    from .capture.steparrays import is_step_array, plain
    leaves, spec = pytree.tree_flatten(result)
    if not any(isinstance(v, HostFloat) or is_step_array(v) for v in leaves):
        return result
    return pytree.tree_unflatten([_plain(v) if isinstance(v, HostFloat) else plain(v) for v in leaves], spec)


def reason_kind(reason: str) -> str:
    """A recapture reason without its values: 'arg 0 (x) shape [4, 8] -> [5, 8]' -> 'arg (x) shape'."""
    import re
    head = reason.split(" -> ")[0].split(":")[0]
    return " ".join(w for w in re.sub(r"\[[^\]]*\]|'[^']*'|[-+]?\d[\w.+-]*", " ", head).split())[:80]


def log_recapture(step, reason: str, seconds: float) -> None:
    """The first recapture of each kind is shown by default (logging's last-resort handler prints
    WARNING to stderr): a varying batch shape must not be invisible. Later ones: INFO."""
    import logging
    from .capture.hints import recapture_hint
    kind = reason_kind(reason)
    level = logging.INFO if kind in step._recapture_kinds else logging.WARNING
    step._recapture_kinds.add(kind)
    hint = recapture_hint(reason)
    logging.getLogger("stepgraph").log(
        level, "stepgraph: %s recaptured (graph %d of max_captures=%d, %.2fs): %s%s%s", step.__name__,
        len(step._order), step.max_captures, seconds, reason,
        f"; if it keeps recapturing: {hint}" if hint else "",
        "" if level == logging.INFO else " [later recaptures of this kind are logged at INFO]")


STATE_WARMUPS = 2   # (an optimizer whose state keeps growing is captured after these)


def optimizer_states(reg) -> int:
    return sum(len(opt.state) for _, opt in reg.optimizers)


def warmed_up(step, result, why: str = "this call created optimizer state"):
    """The traced call created optimizer state: the first ``optimizer.step()`` after warm-up
    calls that did not step (gradient accumulation, MAE's ``update_grad=(i + 1) % accum == 0``).
    Its graph, keyed by the state before, would never replay (each later call missed it with
    "optimizer.state: entries 0 -> N"): this call was the state's warm-up, its traced result is
    the call's; the next call with that state captures."""
    step.stats.new_state_warmups += 1
    step.stats.eager_calls += 1
    step.stats.branches[Branch.CAPTURE] -= 1
    step.stats.took(Branch.WARMUP)
    step._last = step._last_quick = None   # (the state changed: the quick key is recomputed)
    logging.getLogger("stepgraph").info("stepgraph: %s: %s; this call counts as a warm-up", step.__name__, why)
    return plain_floats(result)


def _tracked(x) -> bool:
    """A tracked Python number (capture/tracked.py): its value is this call's, evaluated."""
    return getattr(type(x), "_sg_tracked", False) and getattr(x, "_e", None) is not None
