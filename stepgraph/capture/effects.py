"""What a trace must notice besides aten ops: host RNG state calls, host reads inside backward
hooks, optimizers stepped from hooks, and outputs the pytree cannot see into."""
from __future__ import annotations

import contextlib
import traceback
import weakref

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from dataclasses import dataclass

from torch.fx.experimental.proxy_tensor import get_proxy_slot, has_proxy_slot

from ..errors import library_frame, user_frame
from ..markers import RNG_STATE_FUNCS, zero_grad_marker
from ..optimizers import absorb_floats
from .state import StateRegistry
from .patching import patched
from .steparrays import is_step_array

_T = torch.Tensor
# Python-level reads of a tensor's value: each would bake this step's value into the graph.
_HOST_READS = {
    _T.item: ("Tensor.item()", "return the tensor itself from the step and call .item() outside it"),
    _T.tolist: ("Tensor.tolist()", "return the tensor from the step and convert it outside"),
    _T.numpy: ("Tensor.numpy()", "return the tensor from the step and convert it outside"),
    _T.__array__: ("numpy conversion of a tensor", "return the tensor and convert it outside the step"),
    _T.__repr__: ("print/repr of a tensor", "return the tensor from the step and print it outside"),
    _T.__str__: ("print/str of a tensor", "return the tensor from the step and print it outside"),
    _T.__format__: ("formatting a tensor (f-string/format)", "return the tensor and format it outside"),
    _T.__bool__: ("bool(tensor): Python control flow on a tensor value",
                  "use torch.where / masking instead of `if tensor:`, or move the branch outside"),
    _T.__int__: ("int(tensor)", "keep the value as a tensor, or compute it outside the step"),
    _T.__float__: ("float(tensor)", "keep the value as a tensor, or compute it outside the step"),
    _T.__index__: ("using a tensor as a Python index", "index with the tensor itself, or outside the step"),
}

@dataclass
class Problem:
    op: str
    where: str
    fix: str
    inside: str = ""
    plain: bool = False   # ``op`` is the whole sentence (not a host sync)

    def __post_init__(self):
        if self.inside and not self.plain:  # library code: a fix the user can apply in their own code
            from .libraries import library_fix
            self.fix = library_fix(self.inside, self.fix)

    def message(self) -> str:
        lib = f" (inside {self.inside})" if self.inside else ""
        if self.plain:
            return f"{self.op}{lib}"
        return f"host sync in the step: {self.op}{lib} cannot be captured in a graph"


def _is_traced(t) -> bool:
    mode = get_proxy_mode()
    return mode is not None and isinstance(t, torch.Tensor) and has_proxy_slot(t, mode.tracer)




class _RngStateRecorder:
    # (``torch.manual_seed(k)`` in the step, a reproducible draw per step: reseeded at each replay
    # as eager reseeds; before, replays drew on from the capture's seed)
    NAMES = [(torch, "get_rng_state"), (torch, "set_rng_state"),
             (torch.random, "get_rng_state"), (torch.random, "set_rng_state"),
             (torch, "manual_seed"), (torch.random, "manual_seed")]

    def __init__(self, cuda: bool, problems: list | None = None):
        self.names = list(self.NAMES)
        if cuda:
            self.names += [(torch.cuda, "get_rng_state"), (torch.cuda, "set_rng_state")]
        self.saved = []
        self.nodes: dict[int, object] = {}
        self.count = 0
        self.problems, self.drawn = problems, []   # (fresh seeds drawn in the step: check_seeds)

    def _wrap(self, orig, is_get):
        rec = self

        def wrapper(*args, **kwargs):
            live = _moving_seeds(args) if get_proxy_mode() is not None else {}
            rec.check_seeds()
            out = orig(*(live[id(x)][0] if id(x) in live else x for x in args), **kwargs)
            rec.expect = _seeds()
            mode = get_proxy_mode()
            if mode is not None:
                tracer = mode.tracer
                a = tuple(live[id(x)][1] if id(x) in live else rec.nodes.get(id(x), x) for x in args)
                node = tracer.create_node("call_function", orig, a, dict(kwargs))
                rec.count += 1
                if is_get:
                    rec.nodes[id(out)] = node
            return out
        return wrapper

    def __enter__(self):
        self.expect = _seeds()
        for mod, name in (torch, "seed"), (torch.random, "seed"):   # (where a fresh seed is drawn)
            self.saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, self._seed_wrap(getattr(mod, name)))
        for mod, name in self.names:
            orig = getattr(mod, name)
            orig = RNG_STATE_FUNCS.get(orig, orig)  # never wrap a wrapper
            self.saved.append((mod, name, getattr(mod, name)))
            w = self._wrap(orig, name.startswith("get"))
            RNG_STATE_FUNCS[w] = orig
            RNG_STATE_FUNCS[orig] = orig
            setattr(mod, name, w)
        return self

    def __exit__(self, *exc):
        for mod, name, f in reversed(self.saved):
            setattr(mod, name, f)
        self.check_seeds()
        if exc[0] is None and self.problems is not None and self.drawn:
            # HF Reformer's ``self.attention_seed = int(torch.seed() % sys.maxsize)`` in each
            # layer's forward (``cuda.default_generators[i].seed()`` on a GPU): a replay reseeded
            # with the capture's seed, the same dropout masks at every step, silently
            where, lib = self.drawn[0]
            self.problems.append(Problem(
                "the step draws a fresh random seed (torch.seed() / Generator.seed()): a replay would reseed "
                "with this capture's seed, the same random numbers at every step", where,
                "call torch.seed() outside the step, before the call (replays draw on from the generator "
                "as eager does)" if not lib else "capture the submodules around it instead of the whole "
                "step (model.part = stepgraph.graph_module(model.part)), or run the step eagerly",
                lib, plain=True))

    def check_seeds(self) -> None:
        """A generator's seed changed since the last one the step set: a fresh seed was drawn
        where no wrapper sees it (``Generator.seed()``, a C method)."""
        if _seeds() != self.expect and not self.drawn:
            self.drawn.append(_site())
        self.expect = _seeds()

    def _seed_wrap(self, orig):
        rec = self

        def seed():
            rec.drawn.append(_site())
            return orig()
        return seed


def _site() -> tuple:
    """(the user's line, the library line under it) of the call running now."""
    import traceback
    from ..errors import library_frame, user_frame
    stack = traceback.extract_stack()
    return user_frame(stack), library_frame(stack)


def _seeds() -> tuple:
    """The initial seed of the CPU generator and of each CUDA one already made: a fresh seed
    drawn in the step changes one of them (``manual_seed(k)`` with ``k`` noted is replayed)."""
    cuda = torch.cuda.default_generators if torch.cuda.is_available() and torch.cuda.is_initialized() else ()
    return (torch.initial_seed(),) + tuple(g.initial_seed() for g in cuda)


def _moving_seeds(args) -> dict:
    """``torch.manual_seed(1000 + it)`` with ``it`` moving at every call: id -> (its value, the
    graph node computing it from its roots at each replay), so the seed is read live instead of a
    graph per value (once its value check missed, like a moving factory's fill: livefactory.py)."""
    from .sinks import _STATE
    from .tracked import _PROXIES, plain
    log = getattr(_STATE, "log", None)
    out = {}
    for x in args:
        # (CPU steps only: a CUDA step that seeds runs on the replay backend; its difference from
        # eager on the H200 was the test's twin left in the non-capturable Adam, but the live seed
        # is not proven there yet: each seed stays a graph, as before)
        if type(x) in _PROXIES and log is not None and log.active and log.lift_tensor_ops and log.moving(x):
            node = log.lift(x, typed=False)
            if node is not None:
                out[id(x)] = (plain(x), node)
    return out


def _register_dataclasses(out, depth: int = 0) -> None:
    """Make plain dataclass outputs pytree nodes (torch's own registry), so each replay builds a
    fresh instance around its own tensors instead of handing back the capture call's object."""
    import dataclasses
    if depth > 4:
        return
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        cls = type(out)
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(cls)
        for f in dataclasses.fields(out):
            _register_dataclasses(getattr(out, f.name), depth + 1)
    elif isinstance(out, (list, tuple)):
        for x in out:
            _register_dataclasses(x, depth + 1)
    elif isinstance(out, dict):
        for x in out.values():
            _register_dataclasses(x, depth + 1)


# optimizer -> the user's line that last stepped it in a trace (a refusal about its state names it)
STEP_SITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def discover_stepping_optimizers(reg: StateRegistry, mode: TorchFunctionMode | None = None):
    """Add any optimizer that steps to the registry (e.g. per-parameter optimizers stepped from
    post-accumulate-grad hooks), so its counters and state are known. While tracing, also
    re-enter ``mode`` for a step that runs where it is not active: hooks run by the autograd
    engine do not see the caller's torch-function modes."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    entered: list = []

    def pre_hook(opt, args, kwargs):
        STEP_SITES[opt] = user_frame()   # (refusals about this optimizer's state name it: trace.py)
        if all(o is not opt for _, o in reg.optimizers):
            # (``reg.optimizers`` is a fresh list of the held ones: assign, not append)
            reg.optimizers = reg.optimizers + [(f"optimizer#{len(reg.optimizers)}", opt)]
        absorb_floats(reg, opt.param_groups)   # (a number the step assigned: filled as it steps)
        active = mode is not None and any(m is mode for m in torch.overrides._get_current_function_mode_stack())
        if mode is not None and not active:
            mode.__enter__()
            entered.append(opt)

    def post_hook(opt, args, kwargs):
        if entered and entered[-1] is opt:
            entered.pop()
            mode.__exit__(None, None, None)
    handles = [register_optimizer_step_pre_hook(pre_hook), register_optimizer_step_post_hook(post_hook)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        reg.refresh_names()


def _modes_see_values() -> bool:
    """Outside a backward, or in one run under the step's torch-function modes: what Python
    does with a read value there is seen (a hook with no mode on would bake it unseen)."""
    return torch._C._current_graph_task_id() == -1 or torch._C._len_torch_function_stack() > 0


@contextlib.contextmanager
def _host_read_patches(problems: list, tolist=None, step_arrays=None):
    """``.tolist()``, ``.numpy()`` and ``__array__`` read memory without any aten op: patch the
    methods themselves for the trace. A backward the engine runs without the step's modes
    (fnbackward.py puts them on) refuses them as ``.item()`` is. ``tolist(t)``: how to read a
    traced tensor's list instead (element by element, as host reads), or None to refuse.
    ``step_arrays`` (steparrays.StepArrays): ``.numpy()`` of a traced CPU tensor hands out a
    watched array, a graph output if the step only returns it; None to refuse."""

    def wrap(name, orig):
        def method(self, *a, **k):
            if name == "tolist" and tolist is not None and _is_traced(self) and not a and not k \
                    and not getattr(_host_read_patches, "inside", False) and _modes_see_values():
                got = tolist(self)
                if got is not NotImplemented:
                    return got
            if name == "numpy" and step_arrays is not None and _is_traced(self) and not a \
                    and k in ({}, {"force": False}) and self.device.type == "cpu" \
                    and not getattr(_host_read_patches, "inside", False) and _modes_see_values():
                with _disable_current_modes():
                    return step_arrays.make(self, orig(self))
            if _is_traced(self) and not getattr(_host_read_patches, "inside", False):
                stack = traceback.extract_stack()
                op, fix = _HOST_READS[orig]
                problems.append(Problem(op, user_frame(stack), fix, library_frame(stack)))
            _host_read_patches.inside = True
            try:
                with _disable_current_modes():
                    return orig(self, *a, **k)
            finally:
                _host_read_patches.inside = False
        return method
    names = ("tolist", "numpy", "__array__")
    with patched(torch.Tensor, {name: wrap(name, getattr(torch.Tensor, name)) for name in names}):
        yield


def _opaque_outputs(out_leaves) -> str | None:
    """A non-tensor output leaf that holds tensors the step computed (a dataclass, a cache)."""
    def holds(v, depth=0):
        if isinstance(v, torch.Tensor):
            return _is_traced(v)
        if depth > 3 or isinstance(v, (str, bytes, int, float, bool, type(None))):
            return False
        if isinstance(v, (list, tuple, set)):
            return any(holds(x, depth + 1) for x in list(v)[:256])
        if isinstance(v, dict):
            return any(holds(x, depth + 1) for x in list(v.values())[:256])
        d = getattr(v, "__dict__", None)
        return isinstance(d, dict) and any(holds(x, depth + 1) for x in list(d.values())[:256])
    for v in out_leaves:
        # (a model or optimizer returned as is -- davidmrau's MoE example ends ``return model`` --
        # is the same object at every replay; its tensors are state, attributes it stores are
        # written back by attrstores.py)
        if isinstance(v, (nn.Module, torch.optim.Optimizer)):
            continue
        if not isinstance(v, torch.Tensor) and not is_step_array(v) and holds(v):
            return type(v).__name__
    return None


@contextlib.contextmanager
def record_grad_bindings(reg: StateRegistry, out: list):
    """Record where each parameter's fresh ``.grad`` was bound (autograd's AccumulateGrad) and
    where ``zero_grad()`` ran, as graph nodes: a replay that raises mid-graph can then leave
    ``.grad`` exactly as the eager call would (bound after backward, cleared after zero_grad)."""
    register = getattr(torch.Tensor.register_post_accumulate_grad_hook, "__wrapped__",
                       torch.Tensor.register_post_accumulate_grad_hook)
    fresh = {id(p) for p in reg.grad_params if p.grad is None}

    def hook(p):
        mode = get_proxy_mode()
        g = p.grad
        if mode is not None and id(p) in fresh and g is not None and has_proxy_slot(g, mode.tracer):
            out.append(("bind", p, get_proxy_slot(g, mode.tracer).proxy.node))
    handles = [register(p, hook) for p in reg.grad_params]
    orig = torch.optim.Optimizer.zero_grad

    def zero_grad(self, *a, **k):
        mode = get_proxy_mode()
        if mode is not None:
            out.append(("zero", mode.tracer.create_node("call_function", zero_grad_marker, (), {})))
        return orig(self, *a, **k)
    torch.optim.Optimizer.zero_grad = zero_grad
    try:
        yield
    finally:
        torch.optim.Optimizer.zero_grad = orig
        for h in handles:
            h.remove()
