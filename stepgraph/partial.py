"""Partial capture: graph chosen modules (forward and backward) inside a step that stays eager.

``m.forward`` is patched, so ``nn.Module.__call__`` and ``m``'s hooks run around the graphed forward. Call 1 is
eager; call 2 traces forward+backward with ``make_fx`` on fake tensors (no RNG drawn, no buffer touched), splits
the joint graph into forward (outputs + saved) and backward (saved + grad outputs -> grads of inputs and params)
and replays both through one ``autograd.Function`` (parameter grads accumulate through autograd as usual).
CPU: generated aten code (bitwise eager-equal); CUDA: two CUDA graphs per signature in one shared memory pool.
Hooks on submodules run after each replayed forward with real tensors, or keep the module eager (partial_hooks.py);
tracing and the forward/backward split: partial_trace.py.
"""
from __future__ import annotations

from typing import NamedTuple

import logging
import threading
import time
import warnings

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.function import once_differentiable
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import config
from .backends.replay import generate
from .errors import CaptureError, StepGraphError, user_frame
from .partial_hooks import hook_key, run_deferred, undeferrable, watch_returns
from .partial_trace import partition, trace_joint
from .passes import summarize
from .runtime import Stats

log = logging.getLogger("stepgraph")
_NO_OUTPUT = object()
_POOLS: dict = {}   # CUDA device index -> graph memory pool shared by every graphed module


def graph_module(module: nn.Module, *, backend: str = "auto", max_captures: int = 8) -> "GraphedModule":
    """Graph ``module``'s forward and backward (the step around stays eager); returns a wrapper nn.Module with
    ``.stats``/``.explain()``/``.reset()``/``.remove()``. ``module.forward`` is patched too (parents use the graphs)."""
    if not isinstance(module, nn.Module):
        raise StepGraphError(f"graph_module expects an nn.Module, got {type(module).__name__}")
    existing = module.__dict__.get("_stepgraph_partial")
    return existing if existing is not None else GraphedModule(module, backend, max_captures)


def _tracing() -> bool:
    """Inside someone's trace (stepgraph.compile, torch.compile, fake mode): stay eager."""
    fake = getattr(torch._C, "_TorchDispatchModeKey", None)
    return get_proxy_mode() is not None or torch.compiler.is_compiling() or \
        (fake is not None and torch._C._get_dispatch_mode(fake.FAKE) is not None)


def _state(module):
    found = {}
    for kind, it in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
        _ = [found.setdefault(id(t), (name, t, kind)) for name, t in it]
    return list(found.values())


def _value_key(v):
    try:
        return repr(v) if isinstance(v, float) else (hash(v), v)[1]   # repr: NaN-safe; unhashables by repr
    except TypeError:
        return repr(v)


class PartialKey(NamedTuple):
    """A graphed module call's guard key, read by field name (explain, the one-line reasons)."""
    spec: str          # argument structure
    inputs: tuple      # per leaf: ("tensor", shape, dtype, device, requires_grad, stride) | ("value", type, value)
    grad_mode: bool
    autocast: tuple    # (cpu, cuda) enabled
    training: tuple    # .training of every submodule, the module's own first
    state: tuple       # (id, requires_grad, dtype, shape) per parameter/buffer
    hooks: object      # capture.hooks.hook_key of the module


class _Sig:
    def __init__(self, module, state, args, kwargs):
        flat, self.spec = pytree.tree_flatten_with_path((args, kwargs))
        self.leaves = [v for _, v in flat]
        self.names = [("args" if p[0].idx == 0 else "kwargs") + pytree.keystr(p[1:]) for p, _ in flat]
        self.tensor_pos = [i for i, v in enumerate(self.leaves) if isinstance(v, torch.Tensor)]
        items = tuple(("tensor", tuple(v.shape), v.dtype, v.device, v.requires_grad, v.stride())
                      if isinstance(v, torch.Tensor) else ("value", type(v).__name__, _value_key(v))
                      for v in self.leaves)
        self.key = PartialKey(
            spec=str(self.spec), inputs=items, grad_mode=torch.is_grad_enabled(),
            autocast=tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")),
            training=tuple(m.training for m in module.modules()),
            state=tuple((id(t), t.requires_grad, t.dtype, tuple(t.shape)) for _, t, _ in state),
            hooks=hook_key(module))


def _diff(old: PartialKey, new: PartialKey, names, state) -> str:
    """Every guard that differs between two signatures, as one line."""
    if old.spec != new.spec:
        return "argument structure changed (number/nesting of arguments or keywords)"
    fields = {"tensor": ("kind", "shape", "dtype", "device", "requires_grad", "stride"), "value": ("kind", "type", "value")}
    out = [next(f"{name}: {f} {x} -> {y}" for f, x, y in zip(fields[a[0]], a, b) if x != y)
           for name, a, b in zip(names, old.inputs, new.inputs) if a != b]
    out += [f"{what}: {getattr(old, f)} -> {getattr(new, f)}" for f, what in
            (("grad_mode", "grad mode"), ("autocast", "autocast (cpu, cuda)")) if getattr(old, f) != getattr(new, f)]
    if old.training != new.training:
        out.append("train/eval mode changed" + (f": {'train' if old.training[0] else 'eval'} -> "
                                                f"{'train' if new.training[0] else 'eval'}"
                                                if old.training[0] != new.training[0] else " (in a submodule)"))
    if old.state != new.state:
        bad = [n for (n, _, _), a, b in zip(state, old.state, new.state) if a != b]
        out.append(f"parameter/buffer {bad[0]!r} replaced or changed requires_grad/dtype/shape" if bad
                   else "parameters/buffers added or removed")
    if old.hooks != new.hooks:
        out.append("hooks registered or removed inside the module")
    return "; ".join(out) or "new signature"


class _GraphFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, *tensors):
        outs = e.run_fw(list(tensors[:e.n_user_in]))
        user, saved, ctx.entry = list(outs[:e.n_out]), outs[e.n_out:], e
        if e.cuda:   # static buffers: return copies; keep a token to check the replay order
            user, e.serial = [o.clone() for o in user], e.serial + 1
            ctx.token, ctx.saved_static = e.serial, saved
        else:        # fresh tensors every call: autograd's saved-tensor checks apply
            ctx.save_for_backward(*saved)
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
        saved = ctx.saved_static if e.cuda else ctx.saved_tensors
        res = e.run_bw(list(saved) + [grads[i].contiguous() for i in e.diff_out])
        by_slot = {pos: (g.clone() if e.cuda and g is not None else g) for pos, g in zip(e.grad_slots, res)}
        return (None, *[by_slot.get(i) for i in range(e.n_user_in + len(e.diff_params))])


class _Entry:
    def __init__(self, owner, sig, fw_gm, bw_gm, box, state, backend, n_saved):
        self.owner, self.key, self.names, self.fw_gm, self.bw_gm = owner, sig.key, sig.names, fw_gm, bw_gm
        self.backend, self.cuda, self.serial, self.n_saved, self.stale = backend, backend == "cudagraph", 0, n_saved, lambda: None
        self.out_spec, self.out_leaves, self.n_out = box["out_spec"], box["out_leaves"], box["n_out"]
        self.n_user, self.hook_calls = box["n_user"], box["hook_calls"]   # outputs n_user..n_out: for hooks
        self.diff_out, self.diff_set = box["diff_out"], set(box["diff_out"])
        self.tensor_pos, self.n_user_in, self.state = sig.tensor_pos, len(sig.tensor_pos), [t for _, t, _ in state]
        n, pw = len(state), [j for j in box["wrt"] if j < len(state)]   # apply(): user tensors, then params with grads
        self.diff_params = [state[j][1] for j in pw]
        self.grad_slots = [self.n_user_in + pw.index(j) if j < n else j - n for j in box["wrt"]]
        fw_fn, bw_fn = generate(fw_gm, "graphed_forward")[1], bw_gm and generate(bw_gm, "graphed_backward")[1]
        if self.cuda:
            self._record(fw_fn, bw_fn, [sig.leaves[i] for i in sig.tensor_pos])
        else:
            self.run_fw, self.run_bw = (lambda inputs: fw_fn(*inputs)), (lambda inputs: bw_fn(*inputs))

    def __call__(self, leaves):
        user = [leaves[i] for i in self.tensor_pos]
        if self.bw_gm is not None:
            outs = _GraphFn.apply(self, *user, *self.diff_params)
        else:   # grad mode off, or nothing requires grad: no autograd
            with torch.no_grad():
                outs = [o.clone() if self.cuda else o for o in self.run_fw(user)[:self.n_out]]
        if self.hook_calls:
            run_deferred(self.hook_calls, outs[self.n_user:])
        it = iter(outs[:self.n_user])
        return pytree.tree_unflatten([next(it) if k == "tensor" else v for k, v in self.out_leaves], self.out_spec)

    def _record(self, fw_fn, bw_fn, example):
        from .backends.cudagraph import side_stream
        dev = next(t.device for t in self.state + example if t.is_cuda)
        pool = _POOLS.get(dev.index) or _POOLS.setdefault(dev.index, torch.cuda.graph_pool_handle())
        written = set(summarize(self.fw_gm, lambda t: None).inputs_written)
        fw_static, side = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
                           for x in example], side_stream()
        side.wait_stream(torch.cuda.current_stream())
        # Warm up on the side stream (cuBLAS workspace, lazy kernels), then undo its effects.
        snap, rng = [(t, t.clone()) for t in self.state if not isinstance(t, nn.Parameter)], torch.cuda.get_rng_state(dev)
        with torch.no_grad(), torch.cuda.stream(side):
            outs = fw_fn(*[x.clone() for x in fw_static])
            _ = bw_fn(*outs[self.n_out:], *[torch.ones_like(outs[i]) for i in self.diff_out]) if bw_fn else None
            del outs, _
        _ = [side.synchronize()] + [t.copy_(c) for t, c in snap] + [torch.cuda.set_rng_state(rng, dev)]
        fw_graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(fw_graph, pool=pool, stream=side):
            fw_outs = list(fw_fn(*fw_static))
        if bw_fn:
            g_static = [torch.zeros_like(fw_outs[i], memory_format=torch.contiguous_format) for i in self.diff_out]
            bw_graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(bw_graph, pool=pool, stream=side):
                bw_outs = list(bw_fn(*fw_outs[self.n_out:], *g_static))
        torch.cuda.current_stream().wait_stream(side)
        fw_ptrs, ptrs = [s.data_ptr() for s in fw_static], [t.data_ptr() for t in self.state]

        def run_fw(inputs):
            copied = [i for i, x in enumerate(inputs) if x.data_ptr() != fw_ptrs[i]]
            _ = [fw_static[i].copy_(inputs[i]) for i in copied]
            fw_graph.replay()
            _ = [inputs[i].copy_(fw_static[i]) for i in copied if i in written]   # in-place writes to inputs
            return fw_outs

        def run_bw(inputs):   # saved activations already are the forward's static outputs
            _ = [s.copy_(g) for s, g in zip(g_static, inputs[len(fw_outs) - self.n_out:])]
            bw_graph.replay()
            return bw_outs
        self.run_fw, self.run_bw = run_fw, run_bw
        self.stale = lambda: None if all(t.data_ptr() == p for t, p in zip(self.state, ptrs)) else \
            "a parameter/buffer's storage moved since capture (.to() / .data = / set_)"


class GraphedModule(nn.Module):
    """A module whose forward and backward replay as graphs; see :func:`graph_module`."""

    def __init__(self, module, backend="auto", max_captures=8):
        super().__init__()
        self.module = module
        self.__dict__.update(name=type(module).__name__, _lock=threading.RLock(), _orig=module.forward,
                             _own_forward=module.__dict__.get("forward"), disabled=bool(config.get("disable")),
                             backend=config.get("backend") or backend, max_captures=config.get("max_captures") or max_captures)
        if self.backend not in ("auto", "replay", "cudagraph") or self.max_captures < 1:
            raise StepGraphError(f"graph_module: backend must be auto, replay or cudagraph (got {self.backend!r}) "
                                 f"and max_captures >= 1 (got {self.max_captures})")
        self.reset()
        module.__dict__.update(_stepgraph_partial=self, forward=self._graphed_forward)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)   # the module's __call__: its own hooks run every call

    def remove(self) -> nn.Module:
        """Undo the patch (``module`` runs eagerly again) and return ``module``."""
        self.module.__dict__.pop("forward", None), self.module.__dict__.pop("_stepgraph_partial", None)
        self.module.__dict__.update({"forward": self._own_forward} if self._own_forward is not None else {})
        return self.module

    def reset(self) -> None:
        """Drop every graph and start again from warm-up."""
        with self._lock:
            self.__dict__.update(entries={}, order=[], warm_done=0, calls=0, warned_cap=False,
                                 eager_keys={}, last_key=None, stats=Stats())

    def _graphed_forward(self, *args, **kwargs):
        if self.disabled or _tracing():
            return self._orig(*args, **kwargs)
        with self._lock:
            self.calls, state = self.calls + 1, _state(self.module)
            sig = _Sig(self.module, state, args, kwargs)
            entry = self.entries.get(sig.key)
            if sig.key in self.eager_keys:   # hooks inside it that must see the eager forward
                self.stats.eager_calls += 1
                return self._orig(*args, **kwargs)
            reason = entry.stale() if entry is not None else None
            if reason is not None:
                del self.entries[entry.key], self.order[self.order.index(entry)]
            elif entry is not None:
                self.stats.replays, self.last_key = self.stats.replays + 1, sig.key
                return entry(sig.leaves)
            elif (not self.order and self.warm_done < 1) or len(self.entries) >= self.max_captures:
                if self.order and not self.warned_cap:
                    self.warned_cap = True
                    msg = (f"stepgraph.graph_module({self.name}) reached max_captures={self.max_captures}; new "
                           f"signatures run eagerly (this one: {_diff(self.order[-1].key, sig.key, sig.names, state)})")
                    warnings.warn(msg, stacklevel=3)
                    log.warning(msg)
                self.stats.eager_calls += 1
                out = self._orig(*args, **kwargs)
                self.warm_done += 1   # only a warm-up that returned counts
                return out
            return self._capture(sig, state, reason)

    def _capture(self, sig, state, reason):
        if reason is None and self.order:
            prev = self.last_key if self.last_key in self.entries else self.order[-1].key
            reason = _diff(prev, sig.key, sig.names, state)
        t0, devs = time.perf_counter(), {t.device.type for t in [sig.leaves[i] for i in sig.tensor_pos] + [t for _, t, _ in state]}
        backend = self.backend if self.backend != "auto" else ("cudagraph" if "cuda" in devs else "replay")
        refused = undeferrable(self.module)
        if refused:
            return self._keep_eager(sig, f"backward hooks inside it ({', '.join(refused[:4])}) would see traced gradients")
        try:
            if backend == "cudagraph" and "cuda" not in devs:
                raise StepGraphError("graph_module: backend='cudagraph' needs CUDA tensors")
            gm, box = trace_joint(self.module, self._orig, sig, state)
            fw_gm, bw_gm, n_saved = partition(gm, box["n_out"], box["tangents"])
            entry = _Entry(self.name, sig, fw_gm, bw_gm, box, state, backend, n_saved)
        except Exception as e:   # data-dependent Python, host reads, ops fake tensors cannot run
            self.stats.failed_captures += 1
            if isinstance(e, StepGraphError):
                raise
            raise CaptureError(f"graph_module({self.name}): the forward/backward could not be traced as a graph: "
                               f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}", op=type(e).__name__,
                               where=user_frame(), fix="keep .item() and data-dependent Python outside the "
                               "graphed module, or graph a smaller submodule") from e
        if box["tensor_hooks"]:
            return self._keep_eager(sig, f"its forward registers tensor hooks (at {box['tensor_hooks'][0]}), which "
                                         "the traced backward would call with placeholder gradients")
        if entry.hook_calls:   # this call runs eagerly: its hooks must only observe to run after replays
            changed, a, kw = [], *pytree.tree_unflatten(sig.leaves, sig.spec)
            with watch_returns(self.module, changed):
                out = self._orig(*a, **kw)
            if changed:
                return self._keep_eager(sig, f"hooks inside it return new values ({', '.join(changed[:4])})", out)
        entry.seconds, entry.at_call, self.entries[sig.key], self.last_key = time.perf_counter() - t0, self.calls, entry, sig.key
        self.order.append(entry)
        self.stats.captures, self.stats.capture_seconds = self.stats.captures + 1, self.stats.capture_seconds + entry.seconds
        if reason is not None:
            self.stats.recaptures.append(reason)
            log.info("stepgraph: recapture graph_module(%s): %s", self.name, reason)
        return out if entry.hook_calls else entry(sig.leaves)

    def _keep_eager(self, sig, why, out=_NO_OUTPUT):
        """Calls with this signature run the module eagerly (its hooks as usual), warned once."""
        self.eager_keys[sig.key] = why
        msg = (f"stepgraph.graph_module({self.name}) runs eagerly for this signature: {why}; graphed, they would "
               "run only while tracing, on placeholder tensors. Hooks that only look (return None) on forward "
               "passes run after every replay; register others on the graphed module itself, or graph a "
               "submodule without them")
        warnings.warn(msg, stacklevel=5)
        log.warning(msg)
        if out is _NO_OUTPUT:
            self.stats.eager_calls += 1
            a, kw = pytree.tree_unflatten(sig.leaves, sig.spec)
            out = self._orig(*a, **kw)
        return out

    def explain(self) -> str:
        """What was captured: graphs, ops, saved activations, inputs, recapture reasons, guards."""
        s = self.stats
        lines = [f"stepgraph.graph_module({self.name}): backend={self.backend}, {len(self.order)} graph(s), "
                 f"max_captures={self.max_captures}" + (" [DISABLED]" if self.disabled else ""),
                 f"  stats: eager_calls={s.eager_calls} captures={s.captures} replays={s.replays} "
                 f"failed_captures={s.failed_captures} capture_seconds={s.capture_seconds:.3f}"]
        lines += [f"  recapture: {r}" for r in s.recaptures]
        for i, e in enumerate(self.order):
            fw = summarize(e.fw_gm, lambda t: None)
            bw = (f"backward {summarize(e.bw_gm, lambda t: None).ops} aten ops, {e.n_saved} saved activations, "
                  f"grads for {len(e.grad_slots)} tensors") if e.bw_gm is not None else "no backward (forward only)"
            ins = [f"{n}: {str(x[2]).replace('torch.', '')}{list(x[1])}{' requires_grad' if x[4] else ''}"
                   for n, x in zip(e.names, e.key.inputs) if x[0] == "tensor"]
            lines += [f"  graph {i} (captured at call {e.at_call} in {e.seconds:.3f}s, backend {e.backend}): "
                      f"forward {fw.ops} aten ops ({fw.random_ops} random), {bw}",
                      f"    inputs: {', '.join(ins) or '-'}; grad mode {e.key.grad_mode}; {'train' if e.key.training[0] else 'eval'}"]
            if e.hook_calls:
                lines.append("    hooks called after each replayed forward, with its tensors: "
                             + ", ".join(dict.fromkeys(c.where for c in e.hook_calls)))
        lines += [f"  eager (not graphed) for a signature: {why}" for why in self.eager_keys.values()]
        lines.append("  guards: input shapes/dtypes/devices/strides/requires_grad, non-tensor argument values, "
                     "grad mode, autocast, train/eval of every submodule, parameter/buffer identity, hooks inside")
        return "\n".join(lines)


__all__ = ["graph_module", "GraphedModule"]
