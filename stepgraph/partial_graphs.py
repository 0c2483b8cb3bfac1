"""A ``graph_module`` signature's forward and backward graphs, and how they replay.

``PartialEntry`` holds the pair and their runners, made by the backends as for a whole step:
on the CPU the replay backend's generated code (``ReplayRunner``); on CUDA two graphs recorded
by ``cudagraph.record`` / ``cudagraph.capture_graph`` (so the cuBLAS-workspace release, the
side stream and the repair after a failed recording are the whole-step path's), whose
``stale()`` is ``cudagraph.moved_state_check``. ``_GraphFn`` replays the pair through one
``autograd.Function``: parameter grads accumulate as usual.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.function import once_differentiable

from .backends import CompileRequest
from .backends.replay import generate, without_grad
from .errors import StepGraphError
from .partial_hooks import run_deferred
from .passes import summarize

_POOLS: dict = {}   # CUDA device index -> graph memory pool shared by every graphed module, never freed


def _pool(device: torch.device):
    if device.index not in _POOLS:
        _POOLS[device.index] = torch.cuda.graph_pool_handle()
    return _POOLS[device.index]


class _GraphFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, *tensors):
        outs = e.fw(list(tensors[:e.n_user_in]))
        user, saved, ctx.entry = list(outs[:e.n_out]), outs[e.n_out:], e
        if e.cuda:   # static buffers: return copies; keep a token to check the replay order
            user = [o.clone() for o in user]
            e.serial += 1
            ctx.token, ctx.saved_static = e.serial, saved
        else:        # fresh tensors every call: autograd's saved-tensor checks apply; a size the data
            # decides (a boolean-mask selection's numel, a SymInt in the trace) is kept as a number
            ctx.numbers = [None if isinstance(s, torch.Tensor) else s for s in saved]
            ctx.save_for_backward(*[s for s in saved if isinstance(s, torch.Tensor)])
        ctx.mark_non_differentiable(*[user[i] for i in range(e.n_out) if i not in e.diff_set])
        return tuple(user)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        e = ctx.entry
        if e.cuda and e.serial != ctx.token:
            raise StepGraphError(
                f"stepgraph.graph_module({e.owner}): the backward of graphed call #{ctx.token} ran after call "
                f"#{e.serial}'s forward replayed the same CUDA graph and overwrote the saved activations of the "
                "earlier call (static buffers). Run each call's backward before the module's next forward with "
                "the same signature, graph each use of a shared module separately, or keep it eager.")
        saved = ctx.saved_static if e.cuda else _unpack(ctx)
        res = e.bw(list(saved) + [grads[i].contiguous() for i in e.diff_out])
        by_slot = {pos: (g.clone() if e.cuda and g is not None else g) for pos, g in zip(e.grad_slots, res)}
        return (None, *[by_slot.get(i) for i in range(e.n_user_in + len(e.diff_params))])


def _unpack(ctx) -> list:
    tensors = iter(ctx.saved_tensors)
    return [next(tensors) if n is None else n for n in ctx.numbers]


class PartialEntry:
    """One signature's graphs: forward (outputs + saved activations) and backward (saved + grad
    outputs -> grads of the inputs and parameters), their runners, and the output structure."""

    def __init__(self, owner, sig, fw_gm, bw_gm, n_saved, box, state, backend):
        self.owner, self.key, self.names = owner, sig.key, sig.names
        self.fw_gm, self.bw_gm, self.n_saved = fw_gm, bw_gm, n_saved
        self.backend, self.cuda, self.serial = backend, backend == "cudagraph", 0
        self.seconds, self.at_call = 0.0, 0
        self.out_spec, self.out_leaves, self.n_out = box["out_spec"], box["out_leaves"], box["n_out"]
        self.n_user, self.hook_calls = box["n_user"], box["hook_calls"]   # outputs n_user..n_out: for hooks
        self.diff_out, self.diff_set = box["diff_out"], set(box["diff_out"])
        self.tensor_pos, self.n_user_in = sig.tensor_pos, len(sig.tensor_pos)
        self.state = [t for _, t, _ in state]
        n, pw = len(state), [j for j in box["wrt"] if j < len(state)]   # apply(): user tensors, then params with grads
        self.diff_params = [state[j][1] for j in pw]
        self.grad_slots = [self.n_user_in + pw.index(j) if j < n else j - n for j in box["wrt"]]
        fw_fn = generate(fw_gm, "graphed_forward")[1]
        bw_fn = generate(bw_gm, "graphed_backward")[1] if bw_gm is not None else None
        if self.cuda:
            self.fw, self.bw = _record(self, fw_fn, bw_fn, [sig.leaves[i] for i in sig.tensor_pos])
        else:
            self.fw, self.bw = without_grad(fw_fn), bw_fn and without_grad(bw_fn)

    def stale(self) -> str | None:
        return self.fw.stale()

    def __call__(self, leaves):
        user = [leaves[i] for i in self.tensor_pos]
        if self.bw_gm is not None:
            outs = _GraphFn.apply(self, *user, *self.diff_params)
        else:   # grad mode off, or nothing requires grad: no autograd
            with torch.no_grad():
                outs = [o.clone() if self.cuda else o for o in self.fw(user)[:self.n_out]]
        if self.hook_calls:
            run_deferred(self.hook_calls, outs[self.n_user:])
        it = iter(outs[:self.n_user])
        return pytree.tree_unflatten([next(it) if k == "tensor" else v for k, v in self.out_leaves], self.out_spec)


def _warm_up(e: PartialEntry, fw_fn, bw_fn, example, dev) -> None:
    """Run both graphs once on copies, on the side stream (lazy kernels, cuBLAS handles), then
    restore the buffers they wrote and the RNG: the trace ran on fake tensors, so neither has
    run on real ones yet (``cudagraph.record`` records code that already ran)."""
    from .backends.cudagraph import side_stream
    side = side_stream()
    side.wait_stream(torch.cuda.current_stream())
    snap = [(t, t.clone()) for t in e.state if not isinstance(t, nn.Parameter)]
    rng = torch.cuda.get_rng_state(dev)
    with torch.no_grad(), torch.cuda.stream(side):
        outs = fw_fn(*[x.clone() for x in example])
        if bw_fn is not None:
            bw_fn(*outs[e.n_out:], *[torch.ones_like(outs[i]) for i in e.diff_out])
        del outs
    side.synchronize()
    for t, copy in snap:
        t.copy_(copy)
    torch.cuda.set_rng_state(rng, dev)


def _record(e: PartialEntry, fw_fn, bw_fn, example):
    """Both graphs recorded in the device's shared pool: ``(forward runner, backward runner)``.
    The backward graph reads the forward's static outputs (the saved activations) directly and
    copies only the grad outputs into its static buffers."""
    from .backends.cudagraph import CudaGraphRunner, capture_graph, record
    dev = next(t.device for t in e.state + example if t.is_cuda)
    pool = _pool(dev)
    _warm_up(e, fw_fn, bw_fn, example, dev)
    written = tuple(summarize(e.fw_gm, lambda t: None).inputs_written)
    fw = record(fw_fn, example, CompileRequest(pool=pool, inputs_written=written, clone_outputs=False,
                                               state_tensors=tuple(e.state)))
    if bw_fn is None:
        return fw, None
    saved = fw.static_outputs[e.n_out:]
    grads = [torch.zeros_like(fw.static_outputs[i], memory_format=torch.contiguous_format) for i in e.diff_out]
    graph, outs = capture_graph(bw_fn, saved + grads, pool)
    return fw, CudaGraphRunner(graph, saved + grads, outs, set(), len(outs), False, lambda: None)
