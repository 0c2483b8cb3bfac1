"""Partial capture: graph chosen modules (forward and backward) inside a step that stays eager.

``m.forward`` is patched, so ``nn.Module.__call__`` and ``m``'s hooks run around the graphed forward. Call 1 is
eager; call 2 traces forward+backward with ``make_fx`` on fake tensors (no RNG drawn, no buffer touched), splits
the joint graph into forward (outputs + saved) and backward (saved + grad outputs -> grads of inputs and params)
and replays both through one ``autograd.Function`` (parameter grads accumulate through autograd as usual).
CPU: generated aten code (eager's ops; a gradient summed across the module's boundary may group
its terms otherwise: tests/test_footguns.py (zb)); CUDA: two CUDA graphs per signature in one shared memory pool.

The pieces are the whole-step path's: the key is ``sigkey.PartialKey`` (partial_key.py), the runners are the
backends' (partial_graphs.py), ``stats`` is ``captured.Stats`` with each call's ``Branch``, and ``explain()`` is in
explain.py. Hooks on submodules run after each replayed forward with real tensors, or keep the module eager
(partial_hooks.py); tracing and the forward/backward split: partial_trace.py.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import warnings

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from . import config
from .captured import Branch, Stats
from .errors import CaptureError, StepGraphError, library_file, user_frame
from .partial_graphs import PartialEntry
from .partial_hooks import undeferrable, watch_returns
from .partial_key import diff, module_state, signature
from .partial_trace import partition, trace_joint

log = logging.getLogger("stepgraph")
_NO_OUTPUT = object()
# What a fake-tensor trace raises where the forward needs a tensor's value on the host (a branch
# on it, ``.item()``, a shape that depends on data).
_DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)


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


def _warn(msg: str) -> None:
    """Warn at the user's line that called the module (outside torch's and stepgraph's frames)."""
    level, f = 2, sys._getframe(1)
    while f is not None and library_file(f.f_code.co_filename):
        f, level = f.f_back, level + 1
    warnings.warn(msg, stacklevel=level if f is not None else 2)
    log.warning(msg)


class GraphedModule(nn.Module):
    """A module whose forward and backward replay as graphs; see :func:`graph_module`."""

    def __init__(self, module, backend="auto", max_captures=8):
        super().__init__()
        self.module = module
        self.name = type(module).__name__
        self.disabled = bool(config.get("disable"))
        self.backend = config.get("backend") or backend
        self.max_captures = config.get("max_captures") or max_captures
        if self.backend not in ("auto", "replay", "cudagraph") or self.max_captures < 1:
            raise StepGraphError(f"graph_module: backend must be auto, replay or cudagraph (got {self.backend!r}) "
                                 f"and max_captures >= 1 (got {self.max_captures})")
        self._lock = threading.RLock()
        self._orig = module.forward
        self._own_forward = module.__dict__.get("forward")   # an instance-level forward, put back by remove()
        self.children_graphed: dict = {}   # name -> GraphedModule: graphed in its place (_descend)
        self.reset()
        # In the module's __dict__ directly: nn.Module.__setattr__ would register this wrapper as its submodule.
        module.__dict__["_stepgraph_partial"] = self
        module.__dict__["forward"] = self._graphed_forward

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)   # the module's __call__: its own hooks run every call

    def remove(self) -> nn.Module:
        """Undo the patch (``module`` runs eagerly again) and return ``module``."""
        for child in self.children_graphed.values():
            child.remove()
        self.children_graphed = {}
        own = self.module.__dict__
        own.pop("forward", None)
        own.pop("_stepgraph_partial", None)
        if self._own_forward is not None:
            own["forward"] = self._own_forward
        return self.module

    def reset(self) -> None:
        """Drop every graph and start again from warm-up."""
        with self._lock:
            self.entries: dict = {}      # PartialKey -> PartialEntry
            self.order: list = []        # the entries alive, oldest first (max_captures counts them)
            self.eager_keys: dict = {}   # PartialKey -> why calls with it stay eager
            self.last_key = None
            self.warm_done = self.calls = 0
            self.warned_cap = False
            self.stats = Stats()

    def explain(self) -> str:
        """What was captured: graphs, ops, saved activations, inputs, recapture reasons, guards."""
        from .explain import explain_partial
        return explain_partial(self)

    # ---- the call policy ---------------------------------------------------------------
    def _graphed_forward(self, *args, **kwargs):
        if self.disabled or _tracing():
            return self._orig(*args, **kwargs)
        with self._lock:
            self.calls += 1
            state = module_state(self.module)
            sig = signature(self.module, state, args, kwargs)
            if sig.key in self.eager_keys:   # hooks inside it that must see the eager forward
                return self._eager(Branch.EAGER, args, kwargs)
            entry = self.entries.get(sig.key)
            reason = entry.stale() if entry is not None else None
            if reason is not None:
                del self.entries[entry.key]
                self.order.remove(entry)
            elif entry is not None:
                self.stats.replays += 1
                self.stats.took(Branch.REPLAY)
                self.last_key = sig.key
                return entry(sig.leaves)
            elif not self.order and self.warm_done < 1:
                out = self._eager(Branch.WARMUP, args, kwargs)
                self.warm_done += 1   # only a warm-up that returned counts
                return out
            elif len(self.entries) >= self.max_captures:
                if not self.warned_cap:
                    self.warned_cap = True
                    _warn(f"stepgraph.graph_module({self.name}) reached max_captures={self.max_captures}; new "
                          f"signatures run eagerly (this one: {diff(self.order[-1].key, sig.key, sig.names, state)})")
                return self._eager(Branch.EAGER, args, kwargs)
            self.stats.took(Branch.CAPTURE)
            return self._capture(sig, state, reason)

    def _eager(self, branch, args, kwargs):
        self.stats.took(branch)
        self.stats.eager_calls += 1
        return self._orig(*args, **kwargs)

    def _capture(self, sig, state, reason):
        if reason is None and self.order:
            prev = self.last_key if self.last_key in self.entries else self.order[-1].key
            reason = diff(prev, sig.key, sig.names, state)
        t0 = time.perf_counter()
        devs = {t.device.type for t in [sig.leaves[i] for i in sig.tensor_pos] + [t for _, t, _ in state]}
        backend = self.backend if self.backend != "auto" else ("cudagraph" if "cuda" in devs else "replay")
        refused = undeferrable(self.module)
        if refused:
            return self._keep_eager(sig, f"backward hooks inside it ({', '.join(refused[:4])}) would see traced gradients")
        before = _tensor_attributes(self.module)
        objects = _object_states(sig.leaves)
        try:
            entry, box = _build(self, sig, state, backend, devs)
        except CaptureError as e:
            _restore_tensor_attributes(self.module, before)
            _restore_objects(objects)
            children = _graphable_children(self.module)
            if e.__cause__ is None or not children:   # (StepGraphError: the caller's misuse)
                raise
            return _descend(self, sig, e, children)
        stored = _restore_tensor_attributes(self.module, before)
        if stored:   # (neural style's ContentLoss: ``self.loss = F.mse_loss(...)`` in forward)
            return self._keep_eager(sig, f"its forward stores tensors on module attributes ({', '.join(stored[:4])}), "
                                         "which a replay would not set (they would hold the trace's placeholders)", hooks=False)
        if box["tensor_hooks"]:
            return self._keep_eager(sig, f"its forward registers tensor hooks (at {box['tensor_hooks'][0]}), which "
                                         "the traced backward would call with placeholder gradients")
        if entry.hook_calls:   # this call runs eagerly: its hooks must only observe to run after replays
            changed = []
            a, kw = pytree.tree_unflatten(sig.leaves, sig.spec)
            with watch_returns(self.module, changed):
                out = self._orig(*a, **kw)
            if changed:
                return self._keep_eager(sig, f"hooks inside it return new values ({', '.join(changed[:4])})", out)
        entry.seconds, entry.at_call = time.perf_counter() - t0, self.calls
        self.entries[sig.key], self.last_key = entry, sig.key
        self.order.append(entry)
        self.stats.captures += 1
        self.stats.capture_seconds += entry.seconds
        if reason is not None:
            self.stats.recaptures.append(reason)
            log.info("stepgraph: recapture graph_module(%s): %s", self.name, reason)
        return out if entry.hook_calls else entry(sig.leaves)

    def _keep_eager(self, sig, why, out=_NO_OUTPUT, hooks=True):
        """Calls with this signature run the module eagerly (its hooks as usual), warned once."""
        self.eager_keys[sig.key] = why
        _warn(f"stepgraph.graph_module({self.name}) runs eagerly for this signature: {why}" + (
              "; graphed, they would run only while tracing, on placeholder tensors. Hooks that only look "
              "(return None) on forward passes run after every replay; register others on the graphed "
              "module itself, or graph a submodule without them" if hooks else
              "; return such tensors from forward instead, or graph a submodule without them"))
        if out is _NO_OUTPUT:
            self.stats.eager_calls += 1
            a, kw = pytree.tree_unflatten(sig.leaves, sig.spec)
            out = self._orig(*a, **kw)
        return out


def _descend(self: GraphedModule, sig, err: CaptureError, children: list):
    """A forward that cannot be traced (it reads a tensor's value on the host; it calls
    ``.to()`` on a submodule, as SwitchTransformers' router does) runs eagerly for this
    signature, and the submodules it calls are graphed in its place (what the refusal's fix
    asked the user to do): its Python runs as eager's, the children replay their own graphs."""
    new = [name for name, child in children if name not in self.children_graphed]
    for name, child in children:
        self.children_graphed.setdefault(name, graph_module(child, backend=self.backend,
                                                            max_captures=self.max_captures))
    names = ", ".join(self.children_graphed)
    cause = ("it reads a tensor value on the host" if isinstance(err.__cause__, _DATA_DEPENDENT) else
             f"it cannot be traced ({type(err.__cause__).__name__}: {(str(err.__cause__).splitlines() or [''])[0][:120]})")
    self.eager_keys[sig.key] = f"{cause} at {err.where}; submodules graphed in its place: {names}"
    if new:
        _warn(f"stepgraph.graph_module({self.name}) runs its own forward eagerly for this signature: "
              f"{cause} ({err.where}), which a graph cannot hold; graphed the submodules it calls "
              f"instead ({', '.join(new)}). Graph a module below that line yourself to silence this")
    self.stats.eager_calls += 1
    a, kw = pytree.tree_unflatten(sig.leaves, sig.spec)
    return self._orig(*a, **kw)


def _graphable_children(module) -> list:
    """The submodules to graph in a module's place: its children that hold parameters, looking
    through the containers a forward indexes without calling (ModuleList, ModuleDict)."""
    out = []
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += [(f"{name}.{n}", c) for n, c in _graphable_children(child)]
        elif any(True for _ in child.parameters()):
            out.append((name, child))
    return out


def _object_states(leaves, depth: int = 3) -> list:
    """What a failed trace may have changed in the plain objects passed to the forward: their
    attribute dicts and lists, ``depth`` levels down (transformers' ``DynamicCache``: its layers'
    keys and values, appended to with the trace's fake tensors before the trace failed; the
    forward run eagerly next saw twice the keys). Modules and tensors are not entered."""
    out, seen, todo = [], set(), [(v, 0) for v in leaves]
    while todo:
        v, d = todo.pop()
        if id(v) in seen or d > depth or isinstance(v, (torch.Tensor, nn.Module, type)):
            continue
        seen.add(id(v))
        if type(v) is list:
            out.append((v, list(v)))
            todo += [(x, d + 1) for x in v]
        elif type(v) is dict:
            out.append((v, dict(v)))
            todo += [(x, d + 1) for x in v.values()]
        elif isinstance(getattr(v, "__dict__", None), dict) and not callable(v):
            out.append((v, dict(vars(v))))
            todo += [(x, d + 1) for x in vars(v).values()]
    return out


def _restore_objects(states: list) -> None:
    for obj, was in states:
        if type(obj) is list:
            obj[:] = was
        else:
            target = obj if type(obj) is dict else vars(obj)
            target.clear()
            target.update(was)


def _tensor_attributes(module) -> dict:
    """Each submodule's plain attributes that hold tensors (not parameters or buffers)."""
    return {(name, k): v for name, m in module.named_modules() for k, v in vars(m).items()
            if isinstance(v, torch.Tensor)}


def _restore_tensor_attributes(module, before: dict) -> list:
    """After the fake trace: put back what a forward stored on its module (a FakeTensor otherwise,
    found by no one: ``cl.loss.item()`` gave the symbol ``zuf0``), and name those attributes."""
    changed = []
    for name, m in module.named_modules():
        for k, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and before.get((name, k)) is not v:
                changed.append(f"{name + '.' if name else ''}{k}")
                if (name, k) in before:
                    setattr(m, k, before[(name, k)])
                else:
                    delattr(m, k)
    return changed


def _build(wrapper: GraphedModule, sig, state, backend, devs):
    """Trace, split and hand the pair to a backend: ``(PartialEntry, the trace's facts)``."""
    try:
        if backend == "cudagraph" and "cuda" not in devs:
            raise StepGraphError("graph_module: backend='cudagraph' needs CUDA tensors")
        joint, box = trace_joint(wrapper.module, wrapper._orig, sig, state)
        fw_gm, bw_gm, n_saved = partition(joint, box["n_out"], box["tangents"])
        return PartialEntry(wrapper.name, sig, fw_gm, bw_gm, n_saved, box, state, backend), box
    except Exception as e:   # data-dependent Python, host reads, ops fake tensors cannot run
        wrapper.stats.failed_captures += 1
        if isinstance(e, StepGraphError):
            raise
        raise CaptureError(f"graph_module({wrapper.name}): the forward/backward could not be traced as a graph: "
                           f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}", op=type(e).__name__,
                           where=_failing_line(e), fix="keep .item() and data-dependent Python outside the "
                           "graphed module, or graph a smaller submodule") from e


def _failing_line(e: BaseException) -> str:
    """The user's line the trace failed on (the module's ``if h.sum().item() > 0``), from the
    exception's own frames; else the line that called the module."""
    import traceback
    where = user_frame(traceback.extract_tb(e.__traceback__))
    return where if where != "<unknown>" else user_frame()


__all__ = ["graph_module", "GraphedModule"]
