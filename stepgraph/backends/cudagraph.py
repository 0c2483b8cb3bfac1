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
from ..errors import CaptureError, NeedsHostScalars, NeedsReplay
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


def make_capturable(reg) -> list[str]:
    """Switch CUDA optimizers to their capturable form; return what changed (for explain).

    Step counters move to the device, ``capturable=True``, and a float ``lr`` becomes a
    0-dim device tensor that LR schedulers update in place (``fill_``), so a schedule never
    forces a recapture. The numerics are PyTorch's own capturable path with a float lr: Adam's
    and AdamW's foreach form divide by the lr as by a float (_divide_as_by_a_float).
    """
    changed = []
    for oname, opt in reg.optimizers:
        for gi, group in enumerate(opt.param_groups):
            params = [p for p in group["params"] if p.is_cuda]
            if not params:
                continue
            dev = params[0].device
            fused = bool(group.get("fused"))
            if "capturable" in group and not group["capturable"] and not fused:
                group["capturable"] = True
                changed.append(f"{oname}.param_groups[{gi}]['capturable'] = True")
            # Only these read a tensor lr on the device in every form; others would .item() it.
            # (torch's own classes: microsoft/LoRA's optimizer is also named AdamW, and its Python
            # step arithmetic takes the lr as a float)
            tensor_lr_ok = fused or type(opt) in (torch.optim.Adam, torch.optim.AdamW)
            if tensor_lr_ok and isinstance(group.get("lr"), float):
                # float64 for the foreach form, whose division by it is then written as PyTorch's
                # division by a float (_divide_as_by_a_float): bitwise with a float lr
                group["lr"] = torch.tensor(group["lr"], device=dev, dtype=torch.float32 if fused else torch.float64)
                # A loop that assigns a float lr every iteration (nanoGPT's get_lr idiom) then
                # fills this tensor in place (capture/effects.absorb_floats): no recapture.
                reg.device_hypers.append((group, "lr", group["lr"]))
                changed.append(f"{oname}.param_groups[{gi}]['lr'] -> 0-dim tensor on {dev}")
            if not (group.get("capturable") or fused):
                continue  # e.g. Adagrad: no capturable form; its counters stay host scalars
            if isinstance(group.get("lr"), torch.Tensor) and group["lr"].dtype == torch.float64 \
                    and not getattr(opt, "_stepgraph_lr_division", False):
                opt._stepgraph_lr_division = True
                opt.register_step_pre_hook(_divide_as_by_a_float)
                opt.register_step_post_hook(_divide_plainly)
            for p in params:
                st = opt.state.get(p) or {}
                for k, s in list(st.items()):
                    # step counters, and NAdam's mu_product: capturable forms want them on the device
                    if isinstance(s, torch.Tensor) and s.dim() == 0 and s.device != p.device:
                        st[k] = s.to(device=p.device, dtype=torch.float32 if k == "step" else s.dtype)
    return changed


_FOREACH_DIV_ = torch._foreach_div_


def _divide_as_by_a_float(opt, args, kwargs) -> None:
    """While ``opt`` steps (eager or traced): its foreach division by a float64 lr it holds on
    the device is written as the multiply by the reciprocal that PyTorch's CUDA foreach division
    by a Python float does (``scalar_reciprocal``: ``1 / lr`` in double, then the kernel's
    float). Capturable Adam/AdamW's ``_foreach_div_(bias_correction1, lr)`` then rounds as with
    the float lr a loop assigns every iteration: bitwise on an H200, where a float32 lr tensor's
    true division moved 1e-9 a step from it (EDM's Adam: 1.6e-3 from eager after 8 steps)."""
    held = {id(g["lr"]) for g in opt.param_groups
            if isinstance(g["lr"], torch.Tensor) and g["lr"].dtype == torch.float64}
    if not held:
        return

    def div_(tensors, other):
        if isinstance(other, torch.Tensor) and id(other) in held and tensors:
            dt = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
            return torch._foreach_mul_(tensors, torch.reciprocal(other).to(dt))
        return _FOREACH_DIV_(tensors, other)
    torch._foreach_div_ = div_


def _divide_plainly(opt, args, kwargs) -> None:
    torch._foreach_div_ = _FOREACH_DIV_


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


def make_hyper_tensor(reg, oi: int, gi: int, key: str) -> str | None:
    """After a float ``betas[0]`` changed between calls (OneCycleLR cycles beta1): hold it as a
    0-dim device tensor that later float assignments fill in place (``effects.absorb_floats``), so the
    schedule recaptures once, not every step. Only PyTorch's capturable Adam/AdamW read such a
    tensor inside a graph, and only in their single-tensor form (the foreach form reads tensor
    betas on the host, torch 2.11), which this switches to. (Their ``lr`` is a device tensor
    already: ``make_capturable``.) Returns what changed, or None (each new value recaptures)."""
    name, opt = reg.optimizers[oi]
    group = opt.param_groups[gi]
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or group.get("fused") or not group.get("capturable"):
        return None
    dev = next((p.device for p in group["params"] if p.is_cuda), None)
    if dev is None or key != "betas" or any(k == key and g is group for g, k, _ in reg.device_hypers):
        return None  # (already held: this change is something else, beta2)
    v = group[key]
    group[key] = (torch.tensor(float(v[0]), device=dev), *v[1:])
    group["foreach"] = False
    reg.device_hypers.append((group, key, group[key]))
    return (f"{name}.param_groups[{gi}]['{key}'] is now held on the device and filled in place "
            "(with foreach=False: PyTorch's foreach Adam reads tensor betas on the host)")


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


def record_after_first_call(fn, request: CompileRequest = CompileRequest()) -> "RecordAfterFirstCall":
    """A runner that calls ``fn`` directly on its first call and records it for later calls.

    For compiled code (Inductor's), whose kernels load and autotune on their first run. That
    run is the real step of that call, on the user's tensors, instead of a warm-up on copies
    of every state tensor: no step runs twice and the state is never held twice (the copies
    raised the switch's peak memory by 1.12x on a 6-layer GPT).
    """
    return RecordAfterFirstCall(fn, request)


class RecordAfterFirstCall(Runner):
    def __init__(self, fn, request: CompileRequest):
        self._fn, self._request = fn, request
        self._direct = without_grad(fn)
        self._recorded = None

    def __call__(self, inputs):
        if self._recorded is not None:
            return self._recorded(inputs)
        outs = self._direct(inputs)
        try:
            self._recorded = record(self._fn, inputs, self._request)
        except Exception as e:  # noqa: BLE001 - this call's step is done; later ones run un-recorded
            msg = (f"stepgraph: the compiled step could not be recorded into a CUDA graph; it runs "
                   f"without one from now on (same results, one launch per kernel): "
                   f"{type(e).__name__}: {str(e).strip()[:300]}")
            warnings.warn(msg, stacklevel=2)
            log.warning(msg)
            self._recorded = self._direct  # (holds nothing by address: stale() is None)
        return outs

    def stale(self) -> str | None:
        return self._recorded.stale() if self._recorded is not None else None


def _segmented(gm, example_inputs, request: CompileRequest):
    from .segments import compile_segmented
    return compile_segmented(gm, example_inputs, request)


BACKEND = Backend("cudagraph", compile_cudagraph,
                  "the traced step recorded into one CUDA graph; replayed with one launch", ("cuda",),
                  prepare=make_capturable, segmented=_segmented)
