"""``inductor``: the whole step — forward, backward and optimizer — fused by TorchInductor.

The cleaned aten graph gets its state constants lifted to inputs (parameters, buffers and
optimizer state become placeholders), then ``torch._inductor.compile_fx`` functionalizes it
(in-place state updates become writes back into those same tensors) and generates fused
kernels across the forward/backward/optimizer borders. On CUDA the compiled step is then
recorded into one CUDA graph by the ``cudagraph`` backend's recorder.

By default the compile runs in a child process (background.py) while the step runs the same
graph unfused; the fused runner takes over when the artifact is ready. With
``STEPGRAPH_INDUCTOR_BACKGROUND=0`` (and for DDP steps) it compiles in the capturing call.
Compiled artifacts go through Inductor's on-disk caches, keyed by the graph and its input
metadata, so a second process with the same step skips most of the compile.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch
from torch import fx

from ..passes.alpha import fold_alpha
from . import Backend, CompileRequest
from .background import BackgroundCompile, FusedWhenReady, can_background
from ..optimizers import capturable_while_tracing, make_capturable
from .cudagraph import record, record_after_first_call
from .refusals import refuse_uncapturable
from .replay import compile_replay, generate, without_grad
from .runner import Runner

log = logging.getLogger("stepgraph")


def lift_state(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A copy of ``gm`` whose tensor constants are trailing placeholders, plus those tensors."""
    g = fx.Graph()
    env: dict = {}
    out = g.graph_copy(gm.graph, env)
    g.output(out)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    lifted: dict[int, fx.Node] = {}
    state: list[torch.Tensor] = []
    for n in list(g.nodes):
        if n.op != "get_attr":
            continue
        t = getattr(gm, n.target)
        if id(t) not in lifted:
            if anchor is None:
                with g.inserting_before(next(iter(g.nodes))):
                    ph = g.placeholder(f"state_{len(state)}")
            else:
                with g.inserting_after(anchor):
                    ph = g.placeholder(f"state_{len(state)}")
            ph.meta = dict(n.meta)
            anchor = ph
            lifted[id(t)] = ph
            state.append(t)
        n.replace_all_uses_with(lifted[id(t)])
        g.erase_node(n)
    g.lint()
    return fx.GraphModule(torch.nn.Module(), g), state


# On torch 2.11 the GPT-6L whole step hit an assertion in the scheduler's loop reordering
# (scheduler.reorder_loops_by_dep_pair); compiling without it from the start avoids paying
# for a failed compile first. Retried once more with the same patches on an internal error.
_PATCHES = {"loop_ordering_after_fusion": False}
# On the GPU, horizontal fusion of independent kernels (the optimizer's per-parameter work, the
# backward's parallel branches): H200, median step ms default -> combo: MLP-512 0.248 -> 0.249,
# GPT-2L 0.345 -> 0.312, GPT-6L 5.663 -> 5.522; GPU parity tests pass with it.
_CUDA_PATCHES = {"combo_kernels": True}


def _patches(cuda: bool) -> dict:
    import json
    from .. import config
    extra = json.loads(config.get("inductor_patches") or "{}")
    return {**_PATCHES, **(_CUDA_PATCHES if cuda else {}), **extra}


def _compile(gm: fx.GraphModule, inputs: list, cuda: bool = False):
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    # A fake mode with a ShapeEnv, as the background worker has: without one, compile_fx's
    # own fake mode cannot run a host scalar's ``.item()`` (Adagrad's CPU step counter:
    # DataDependentOutputException), which the ShapeEnv turns into an unbacked symbol.
    # Only then: its fresh ShapeEnv does not know the symbols of other graphs' metadata
    # (a graph with live scalars failed with "KeyError: s26" under it).
    reads = any(n.op == "call_function" and n.target is torch.ops.aten._local_scalar_dense.default
                for n in gm.graph.nodes)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    try:
        with tracing(TracingContext(fake_mode)) if reads else contextlib.nullcontext():
            return compile_fx(gm, inputs, config_patches=_patches(cuda))
    finally:
        torch._C._set_grad_enabled(prev)


def _runner(compiled, state_in: list, cuda: bool, opts: CompileRequest, unfused=None):
    """The per-call runner of a compiled step: state tensors passed after the user inputs;
    ``unfused``: the step's unfused CUDA graph, kept if the fused one cannot be recorded."""
    def fn(*inputs):
        return list(compiled(*inputs, *state_in))

    return record_after_first_call(fn, opts, unfused) if cuda else without_grad(fn)


def compile_inductor(gm: fx.GraphModule, example_inputs, opts: CompileRequest):
    host_scalar_ops, rng_state_calls, on_fused = opts.host_scalar_ops, opts.rng_state_calls, opts.on_fused
    cuda = any(x.is_cuda for x in example_inputs) or any(
        isinstance(getattr(gm, n.target, None), torch.Tensor) and getattr(gm, n.target).is_cuda
        for n in gm.graph.nodes if n.op == "get_attr")
    if cuda or rng_state_calls:
        refuse_uncapturable(gm, host_scalar_ops, rng_state_calls)
    lifted, state = lift_state(gm)
    fold_alpha(lifted)  # works around Inductor's addmm pattern dropping alpha (passes/alpha.py)
    # Detached aliases: the same storage (Inductor's writes land in the user's tensors) without
    # requires_grad, so AOTAutograd builds an inference graph.
    state_in = [t.detach() for t in state]
    inputs = list(example_inputs) + state_in
    from .. import config
    if config.get("inductor_background"):
        why = can_background(lifted, inputs)
        if why is None:
            return _in_background(gm, lifted, inputs, state_in, example_inputs, cuda, on_fused, opts)
        log.info("stepgraph: Inductor compiles in-process (blocking): %s", why)
    t0 = time.perf_counter()
    try:
        compiled = _compile(lifted, inputs, cuda)
    except Exception as e:  # noqa: BLE001 - as when the background compile fails: the unfused graph
        error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        msg = ("stepgraph: Inductor could not compile the captured step; it runs its unfused graph "
               f"(same results as backend='replay'/'cudagraph', no fusion): {error}")
        warnings.warn(msg, stacklevel=5)
        log.warning(msg, exc_info=e)
        return _Unfused(_unfused(gm, example_inputs, cuda, opts), error)
    seconds = time.perf_counter() - t0
    run = _runner(compiled, state_in, cuda, opts)
    run.compile_seconds = seconds
    if not cuda and config.get("inductor_verify"):
        return _checked_at_first_call(gm, run, example_inputs, opts, seconds)
    return run


class _Compiled:
    """An in-process compile, done: the job a :class:`FusedWhenReady` switches to at once."""

    def __init__(self, seconds: float):
        self.ready_s, self.started, self.phases = seconds, time.perf_counter() - seconds, {}

    def done(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


def _checked_at_first_call(gm, fused, example_inputs, opts, seconds):
    """An in-process compile (inputs that are views, two inputs sharing storage) is checked at its
    first call as a background one is at its switch: lora_finetune's fused step on the CPU gave
    NaN from its first call (slices of one token buffer as inputs: compiled in-process,
    unchecked). CPU only: on CUDA the check would record a second, unfused graph."""
    from .verify import FusedCheck, random_draws
    check = FusedCheck.plan(gm, example_inputs, random_draws(gm), opts.name_of, list(opts.input_names),
                            opts.n_user_outputs, eager_random=bool(_patches(False).get("fallback_random")))
    on_fused = opts.on_fused   # (the compile's seconds are counted at the capture already)
    run = FusedWhenReady(_unfused(gm, example_inputs, False, opts), _Compiled(seconds), lambda job: fused,
                         None if on_fused is None else (lambda s, parity=None: on_fused(0.0, parity)), check,
                         where="in-process")
    run.compile_seconds = seconds
    return run


def _unfused(gm, example_inputs, cuda, opts):
    """The same graph without Inductor: one CUDA graph on the GPU, the replay backend on the CPU."""
    if cuda:
        _, fn = generate(gm)
        return record(fn, example_inputs, opts)
    return compile_replay(gm)


class _Unfused(Runner):
    """A step whose in-process Inductor compile failed: the unfused graph, said in explain()."""
    extras = ("error",)

    def __init__(self, run: Runner, error: str):
        self._run, self.error = run, error

    def __call__(self, inputs):
        return self._run(inputs)

    def stale(self) -> str | None:
        return self._run.stale()

    def describe(self) -> str:
        return f"Inductor compile failed, running the unfused graph: {self.error}"


def _parts_job(lifted, inputs, cuda):
    """A large graph's compile in parts side by side (partition.py), or None: one piece."""
    from .partition import PartsCompile, parts_for, split
    try:
        parts = split(lifted, parts_for(lifted))
        return None if parts is None else PartsCompile(lifted, parts, inputs, _patches(cuda))
    except Exception:  # noqa: BLE001 - the graph compiles in one piece, as before parts existed
        log.warning("stepgraph: cutting the step graph into parts failed; it compiles in one piece",
                    exc_info=True)
        return None


def _in_background(gm, lifted, inputs, state_in, example_inputs, cuda, on_fused, opts):
    """Start the compile of ``lifted`` in a child process; run ``gm`` unfused until it is done."""
    from .. import config
    from .verify import FusedCheck, random_draws
    job = _parts_job(lifted, inputs, cuda)
    job = job or BackgroundCompile(lifted, inputs, _patches(cuda))
    unfused = _unfused(gm, example_inputs, cuda, opts)
    check = None
    if config.get("inductor_verify"):  # planned now: the graph's writes, named as explain() names them
        check = FusedCheck.plan(gm, example_inputs, random_draws(gm), opts.name_of, list(opts.input_names),
                                opts.n_user_outputs, eager_random=bool(_patches(cuda).get("fallback_random")))
    return FusedWhenReady(unfused, job, lambda j: _runner(j.load(), state_in, cuda, opts, unfused if cuda else None),
                          on_fused, check)


def prepare(reg) -> list[str]:
    """As for CUDA graphs on the GPU (capturable optimizers); the CPU uses ``trace_context``."""
    return make_capturable(reg)


# SDPA is traced with PyTorch's own kernel choice: cuDNN attention for bf16 on an H100/H200, as
# torch.compile runs it. Its Inductor fusion failed to record into a CUDA graph once (H100, torch
# 2.11, session 9), so the step was traced with cuDNN last in line (flash); on an H200 with torch
# 2.11 it records, and GPT-2 124M's attention takes 4.6 ms of kernel time per step instead of 6.6
# (scripts/probe_cudnn_attention.py, profile_inductor.py --kernels). Should a recording fail
# again, the step keeps its unfused CUDA graph, warned (cudagraph.record_after_first_call).
@contextlib.contextmanager
def trace_context(reg):
    """While tracing for Inductor: optimizers on their capturable path (optimizers.py)."""
    with capturable_while_tracing(reg):
        yield


def _segmented(gm, example_inputs, request: CompileRequest):
    from .inductor_segments import compile_inductor_segmented
    return compile_inductor_segmented(gm, example_inputs, request)


BACKEND = Backend("inductor", compile_inductor,
                  "the whole step fused by TorchInductor (C++ on CPU); on CUDA inside one CUDA graph",
                  ("cpu", "cuda"), prepare=prepare, trace_context=trace_context, segmented=_segmented)
