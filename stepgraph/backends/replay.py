"""``replay``: run the captured graph as one straight-line Python function.

fx's own generated code calls ``torch.ops.aten.x.y(...)`` through the OpOverload's Python
``__call__`` and fetches constants from ``self``. Here each op's C++ callable and each state
tensor is bound once as a global of the generated function, arguments are passed positionally
where fx had them, and every intermediate is dropped right after its last use — the leanest
Python a step can be, so the per-op cost is aten's own dispatch.
"""
from __future__ import annotations

import math

import torch
from torch import fx

from . import Backend, CompileRequest
from .runner import Runner
from ..errors import GuardMiss

_LITERALS = (int, bool, str, type(None))


class _Gen:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.globals: dict = {}
        self.const_ids: dict = {}

    def bind(self, obj, hint: str) -> str:
        key = id(obj)
        if key in self.const_ids:
            return self.const_ids[key]
        name = f"_{hint}{len(self.globals)}"
        self.globals[name] = obj
        self.const_ids[key] = name
        return name

    def arg(self, a) -> str:
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, float) and math.isfinite(a) and type(a) is float:
            return repr(a)
        if isinstance(a, _LITERALS) and type(a) in _LITERALS:
            return repr(a)
        return self.bind(a, "k")


def generate(gm: fx.GraphModule, fn_name: str = "step_graph", grad_bindings=()):
    """Return ``(python_source, callable)`` for the graph; the callable takes flat inputs.

    ``grad_bindings`` ((param, node) pairs, plus ``zero_grad`` marker nodes) make the function,
    if an op raises mid-graph, bind the parameters' fresh grads computed so far unless the
    step's ``zero_grad()`` had already run: ``.grad`` ends as the eager call leaves it.
    """
    from ..markers import zero_grad_marker
    binds = [(p, n.name) for kind, p, n in grad_bindings if kind == "bind"]
    keep = {name for _, name in binds}
    g = _Gen(gm)
    nodes = list(gm.graph.nodes)
    last_use: dict = {}
    for i, n in enumerate(nodes):
        for inp in n.all_input_nodes:
            last_use[inp] = i
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    lines = [f"def {fn_name}({', '.join(placeholders)}):"]
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            continue
        if n.op == "call_function" and n.target is zero_grad_marker:
            lines.append("    _zg = True" if binds else "    pass")
            continue
        if n.op == "get_attr":
            lines.append(f"    {n.name} = {g.bind(getattr(gm, n.target), 's')}")
        elif n.op == "call_function":
            t = n.target
            fn = t._op if isinstance(t, torch._ops.OpOverload) else t
            if t in _NEEDS_GRAD_MODE and n.meta.get("grad_enabled", True):   # (not under no_grad)
                fn = _in_grad_mode(fn)
            callee = g.bind(fn, "f")
            args = [g.arg(a) for a in n.args] + [f"{k}={g.arg(v)}" for k, v in n.kwargs.items()]
            lhs = f"{n.name} = " if n.users else ""
            lines.append(f"    {lhs}{callee}({', '.join(args)})")
        elif n.op == "output":
            lines.append(f"    return {g.arg(n.args[0])}")
            continue
        else:
            raise NotImplementedError(f"replay backend: node op {n.op}")
        dead = [inp.name for inp in n.all_input_nodes
                if last_use.get(inp) == i and inp.op != "placeholder" and inp.name not in keep]
        if n.users == {} and n.op == "call_function":
            pass
        if dead:
            lines.append(f"    del {', '.join(dict.fromkeys(dead))}")
    if binds:
        # Body inside try/except: on an exception, bind what eager's backward had bound.
        head, body = lines[0], lines[1:]
        # (not on a guard miss: that replay is undone and the call captured again, from the
        # state before it: RAdam's rectification flipping mid-optimizer left fresh grads bound)
        lines = [head, "    _zg = False", "    try:"] + ["    " + x for x in body] + [
            "    except _GuardMiss:", "        raise",
            "    except BaseException:", "        if not _zg:", "            _bind_grads(locals())",
            "        raise"]

        def _bind_grads(local_vars):
            for p, name in binds:
                v = local_vars.get(name)
                if v is not None and p.grad is None:
                    p.grad = v
        g.globals["_bind_grads"] = _bind_grads
        g.globals["_GuardMiss"] = GuardMiss
    src = "\n".join(lines) + "\n"
    ns = dict(g.globals)
    exec(compile(src, f"<stepgraph {fn_name}>", "exec"), ns)
    fn = ns[fn_name]
    fn.__stepgraph_source__ = src
    return src, fn


# Kernels whose forward keeps what their backward needs only when grad mode is on (the mkldnn
# LSTM/GRU forward returns its workspace only then; the replay runs with grad mode off).
_NEEDS_GRAD_MODE = {torch.ops.aten.mkldnn_rnn_layer.default}


def _in_grad_mode(op):
    def call(*a, **k):
        # Grad mode on for the kernel, autograd itself skipped: no history is recorded.
        with torch.enable_grad(), torch._C._AutoDispatchBelowAutograd():
            return op(*a, **k)
    call.__name__ = f"{getattr(op, '__name__', 'op')}_in_grad_mode"
    return call


class ReplayRunner(Runner):
    """``run(inputs) = fn(*inputs)`` with grad mode off (the graph already holds the backward:
    nothing it computes should record autograd history)."""

    def __init__(self, fn, source: str | None = None):
        self._fn = fn
        self.source = source

    def __call__(self, inputs):
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._fn(*inputs)
        finally:
            torch._C._set_grad_enabled(prev)


def without_grad(fn) -> ReplayRunner:
    return ReplayRunner(fn)


def compile_replay(gm: fx.GraphModule, example_inputs=None, request: CompileRequest = CompileRequest()):
    _, fn = generate(gm, grad_bindings=request.grad_bindings)
    return ReplayRunner(fn, fn.__stepgraph_source__)


BACKEND = Backend("replay", compile_replay,
                  "the traced aten graph as one generated Python function (CPU and CUDA, no CUDA graph)",
                  runs_host_reads=True)
