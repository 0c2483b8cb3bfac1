"""``cudagraph``: the whole step recorded into one ``torch.cuda.CUDAGraph``; a call is guard
check -> copy user inputs into static buffers (unless at that address) -> ``replay()`` -> outputs.

Parameters, buffers, optimizer state and persistent grads are never copied: the graph
holds their addresses, checked on every call by one C++ data-pointer comparison; when one
moved (``load_state_dict``, ``.to()``) the graph is dropped and the step recaptured.
"""
from __future__ import annotations

import logging
import warnings

import torch
from torch import fx

from .. import config
from ..optimizers import make_capturable
from ..errors import NeedsReplay
from . import Backend, CompileRequest
from .replay import generate, without_grad
from .refusals import refuse_uncapturable
from .runner import Runner

log = logging.getLogger("stepgraph")

_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
_SIDE: dict = {}


def side_stream() -> "torch.cuda.Stream":
    """The one side stream per device on which stepgraph traces and records graphs."""
    dev = torch.cuda.current_device()
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream(dev)
    return _SIDE[dev]


class capture_stream:
    """Trace (the capturing call's real run) on the capture side stream on CUDA.

    The same stream then records the CUDA graph: every stream gets its own cuBLAS workspace,
    so one side stream per device (not one per capture) keeps that memory paid once.
    """

    def __init__(self, device: str):
        self.on = device == "cuda" and config.get("trace_stream") == "side"

    def __enter__(self):
        if self.on:
            self.prev = torch.cuda.current_stream()
            self.side = side_stream()
            self.side.wait_stream(self.prev)
            self.ctx = torch.cuda.stream(self.side)
            self.ctx.__enter__()
            # Autograd warns that AccumulateGrad nodes made by the eager warm-up live on the
            # default stream; it syncs the two correctly, and the graph itself has no such node.
            setter = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
            self.restore = setter
            if setter is not None:
                setter(False)

    def __exit__(self, *exc):
        if self.on:
            if self.restore is not None:
                self.restore(True)
            self.ctx.__exit__(*exc)
            self.prev.wait_stream(self.side)


def compile_cudagraph(gm: fx.GraphModule, example_inputs, request: CompileRequest):
    refuse_uncapturable(gm, request.host_scalar_ops, request.rng_state_calls, example_inputs)
    _, fn = generate(gm)
    return record(fn, example_inputs, request)


def repair_generators() -> None:
    """After a capture that failed (an op that cannot be recorded), CUDA's generators are left
    in capture mode and every later random op raises "Offset increment outside graph capture"
    -- in the user's eager code too. An empty capture ends that mode properly."""
    try:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side_stream()):
            pass
        del g
    except Exception:  # noqa: BLE001 - best effort; the original error is what the user sees
        log.debug("stepgraph: generator repair after a failed capture failed", exc_info=True)


class recording:
    """``with recording(): <torch.cuda.graph capture>``: a failed capture becomes NeedsReplay
    (backend ``auto`` then runs the graph on ``replay``), with the generators repaired."""

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, NeedsReplay):
            return False
        repair_generators()
        raise NeedsReplay(f"recording the step into a CUDA graph failed: {type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}",
                          op="CUDA graph capture", where="the step",
                          fix="use backend='replay' (backend='auto' does so)") from exc


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def record(fn, example_inputs, request: CompileRequest = CompileRequest()) -> "CudaGraphRunner":
    """Record ``fn(*static_inputs)`` into one CUDA graph; return the per-call runner.

    ``fn`` must already have run once (lazy kernel loading and autotuning cannot happen inside
    a capture): see :func:`record_after_first_call`.
    """
    static = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
              for x in example_inputs]
    graph, outs = capture_graph(fn, static, request.pool)
    n_user = len(outs) if request.n_user_outputs is None else request.n_user_outputs
    runner = CudaGraphRunner(graph, static, outs, set(request.inputs_written), n_user, request.clone_outputs,
                             moved_state_check(request.state_tensors))
    runner.shared = share_pool(request)
    return runner


def share_pool(request: CompileRequest) -> list:
    """Count a graph recorded into the request's pool; the runner reads the count at each call."""
    graphs = request.pool_graphs if request.pool_graphs is not None else []
    graphs.append(True)
    return graphs


def persistent_copies(outs, n_user: int, shared: list) -> list:
    """The rebound slots and grads after ``n_user``: copies when another graph shares the pool
    (td3/cyclegan on an H100: a later variant's replay wrote over the grads bound to parameters)."""
    if len(shared) < 2:
        return outs[n_user:]
    return [o.clone() if isinstance(o, torch.Tensor) else o for o in outs[n_user:]]


class CudaGraphRunner(Runner):
    """One recorded CUDA graph: copy inputs whose address differs into the static buffers,
    replay, copy written inputs back, return (cloned) outputs."""
    extras = ("static_inputs", "static_outputs", "shared")

    shared: list = []   # share_pool: the graphs recorded into this one's pool

    def __init__(self, graph, static, outs, written, n_user, clone_outputs, moved):
        self.graph, self.static_inputs, self.static_outputs = graph, static, outs
        self._ptrs = [x.data_ptr() for x in static]
        self._written, self._n_user, self._clone, self._moved = written, n_user, clone_outputs, moved

    def __call__(self, inputs):
        static, ptrs, outs = self.static_inputs, self._ptrs, self.static_outputs
        copied = []
        for i, x in enumerate(inputs):
            if x.data_ptr() != ptrs[i]:
                static[i].copy_(x)
                copied.append(i)
        self.graph.replay()
        for i in copied:
            if i in self._written:
                inputs[i].copy_(static[i])
        if self._clone:
            return [o.clone() for o in outs[:self._n_user]] + persistent_copies(outs, self._n_user, self.shared)
        return outs

    def stale(self) -> str | None:
        return self._moved()


def capture_graph(fn, args, pool):
    """Record ``fn(*args)`` into a new CUDA graph on the side stream, with ``args`` themselves
    as its inputs; ``(graph, outputs)``. Grad mode is off: the graph holds the backward."""
    side = side_stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        # cuBLAS keeps one ~32 MiB workspace per stream: the caller's (from the eager calls) and
        # the capture stream's would both stay alive, which dominates a small model's memory.
        # Drop them before recording, as torch's cudagraph trees do: the caller's comes back on
        # its next eager matmul, and the capture allocates its own inside the graph's pool.
        _clear_cublas_workspaces()
        with recording(), torch.cuda.graph(graph, pool=pool, stream=side):
            outs = fn(*args)
    finally:
        torch._C._set_grad_enabled(prev)
    torch.cuda.current_stream().wait_stream(side)
    return graph, list(outs)


def moved_state_check(state_tensors):
    """``stale()``: a reason when state a graph holds by address has moved since capture."""
    state = list(state_tensors)
    state_ptrs = [t.data_ptr() for t in state]
    state_idx = list(range(len(state)))

    def stale() -> str | None:
        if _PTRS_EQUAL is not None:
            if _PTRS_EQUAL(state, state_ptrs, state_idx):
                return None
        elif all(t.data_ptr() == p for t, p in zip(state, state_ptrs)):
            return None
        for t, p in zip(state, state_ptrs):
            if t.data_ptr() != p:
                return "state tensor storage moved since capture (load_state_dict / .to() / .data =)"
        return None
    return stale


def record_after_first_call(fn, request: CompileRequest = CompileRequest(),
                            fallback: Runner | None = None) -> "RecordAfterFirstCall":
    """A runner that calls ``fn`` directly on its first call and records it for later calls.

    For compiled code (Inductor's), whose kernels load and autotune on their first run. That
    run is the real step of that call, on the user's tensors, instead of a warm-up on copies
    of every state tensor: no step runs twice and the state is never held twice (the copies
    raised the switch's peak memory by 1.12x on a 6-layer GPT). ``fallback``: the same step's
    unfused CUDA graph, run from then on if the recording fails (else ``fn`` runs unrecorded).
    """
    return RecordAfterFirstCall(fn, request, fallback)


class RecordAfterFirstCall(Runner):
    def __init__(self, fn, request: CompileRequest, fallback: Runner | None = None):
        self._fn, self._request, self._fallback = fn, request, fallback
        self._direct = without_grad(fn)
        self._recorded = None
        self._failed: str | None = None   # what explain() says after a recording that failed

    def __call__(self, inputs):
        if self._recorded is not None:
            return self._recorded(inputs)
        outs = self._direct(inputs)
        fallback, self._fallback = self._fallback, None
        try:
            self._recorded = record(self._fn, inputs, self._request)
        except Exception as e:  # noqa: BLE001 - this call's step is done; later ones run un-recorded
            then = ("its unfused CUDA graph from now on (same results, no fusion)" if fallback is not None
                    else "without one from now on (same results, one launch per kernel)")
            msg = (f"stepgraph: the compiled step could not be recorded into a CUDA graph; it runs {then}: "
                   f"{type(e).__name__}: {str(e).strip()[:300]}")
            warnings.warn(msg, stacklevel=2)
            log.warning(msg)
            self._recorded = fallback if fallback is not None else self._direct
            self._failed = f"could not be recorded into a CUDA graph ({type(e).__name__}), runs {then.split(' (')[0]}"
        return outs

    def describe(self) -> str | None:
        return None if self._failed is None else f"the fused step {self._failed}"

    def stale(self) -> str | None:
        return self._recorded.stale() if self._recorded is not None and self._recorded is not self._direct else None


def _segmented(gm, example_inputs, request: CompileRequest):
    from .segments import compile_segmented
    return compile_segmented(gm, example_inputs, request)


BACKEND = Backend("cudagraph", compile_cudagraph,
                  "the traced step recorded into one CUDA graph; replayed with one launch", ("cuda",),
                  prepare=make_capturable, segmented=_segmented)
