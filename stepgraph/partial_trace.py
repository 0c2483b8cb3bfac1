"""Partial capture's tracing: one joint forward+backward trace of a module on fake tensors,
split into a forward graph (outputs + saved activations) and a backward graph."""
from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx

from .capture.compiled import inline_compiled
from .partial_hooks import deferred
from .passes import cleanup


@contextlib.contextmanager
def _swap(module, mapping):
    """Put the trace's tensors in place of the module's parameters and buffers (tied ones too)."""
    undo = [(d, k, v) for m in module.modules() for d in (m._parameters, m._buffers)
            for k, v in d.items() if v is not None and id(v) in mapping]
    for d, k, v in undo:
        d[k] = mapping[id(v)]
    try:
        yield
    finally:
        for d, k, v in undo:
            d[k] = v


def trace_joint(module, forward, sig, state):
    """Joint forward+backward trace on fake tensors: (graph, facts). State becomes constants."""
    grad_on = torch.is_grad_enabled()
    reals, users = [t for _, t, _ in state], [sig.leaves[i] for i in sig.tensor_pos]
    rg = [grad_on and k == "param" and t.requires_grad for _, t, k in state] + [grad_on and t.requires_grad for t in users]
    box: dict = {"tangents": [], "hook_calls": [], "tensor_hooks": []}

    def joint(*flat):
        ins = [t.detach().requires_grad_(r) if r else t.detach() for t, r in zip(flat, rg)]
        it = iter(ins[len(reals):])
        a, kw = pytree.tree_unflatten([next(it) if isinstance(v, torch.Tensor) else v for v in sig.leaves], sig.spec)
        hooked = []   # submodules' forward hooks: recorded, run after each replay (partial_hooks.py)
        with torch.set_grad_enabled(grad_on), _swap(module, {id(r): f for r, f in zip(reals, ins)}), \
                deferred(module, box["hook_calls"], hooked, box["tensor_hooks"]):
            out = forward(*a, **kw)
        out_leaves, box["out_spec"] = pytree.tree_flatten(out)
        outs = [v for v in out_leaves if isinstance(v, torch.Tensor)]
        box["n_user"] = len(outs)
        outs += hooked   # detached: forward outputs without gradients
        box["out_leaves"] = [("tensor", None) if isinstance(v, torch.Tensor) else ("const", v) for v in out_leaves]
        box["diff_out"], box["wrt"], box["n_out"] = diff, wrt, _ = ([i for i, o in enumerate(outs) if o.requires_grad],
                                                                  [j for j, t in enumerate(ins) if t.requires_grad], len(outs))
        if not (grad_on and diff and wrt):
            return outs
        tangents = [torch.empty_like(outs[i], memory_format=torch.contiguous_format) for i in diff]
        box["tangents"] = [get_proxy_slot(t, get_proxy_mode().tracer).proxy.node for t in tangents]
        return outs + list(torch.autograd.grad([outs[i] for i in diff], [ins[j] for j in wrt], tangents,
                                               allow_unused=True))

    with inline_compiled():   # torch.compile'd submodules: traced as eager code (capture/compiled.py)
        gm = make_fx(joint, tracing_mode="fake", _allow_non_fake_inputs=True)(*reals, *users)
    g, tangents = gm.graph, []
    for i, (ph, t) in enumerate(zip([n for n in g.nodes if n.op == "placeholder"], reals)):   # state -> constants
        (gm.register_parameter if isinstance(t, nn.Parameter) else gm.register_buffer)(f"_sg_state{i}", t)
        with g.inserting_before(ph):
            _replace(g, ph, g.get_attr(f"_sg_state{i}"))
    for k, node in enumerate(box["tangents"]):   # empty_like nodes -> placeholders after the inputs
        phs = [n for n in g.nodes if n.op == "placeholder"]
        with (g.inserting_after(phs[-1]) if phs else g.inserting_before(next(iter(g.nodes)))):
            tangents.append(_replace(g, node, g.placeholder(f"tangent_{k}")))
    return cleanup(gm), {**box, "tangents": tangents}


def _meta(new, old):
    new.meta = dict(old.meta)
    return new


def _replace(g, old, new):
    old.replace_all_uses_with(_meta(new, old))
    g.erase_node(old)
    return new


def partition(gm, n_out, tangents):
    """Forward = nodes independent of the grad outputs; saved = forward values backward reads."""
    nodes, T = list(gm.graph.nodes), set(tangents)
    outs = list(nodes[-1].args[0])
    for n in nodes:
        if n.op == "call_function" and any(a in T for a in n.all_input_nodes):
            T.add(n)
    saved = list(dict.fromkeys(a for a in [a for n in nodes if n in T for a in n.all_input_nodes] + outs[n_out:]
                               if isinstance(a, fx.Node) and a not in T and a.op != "get_attr"))
    fw, env = fx.Graph(), {}
    for n in [n for n in nodes if n.op != "output" and n not in T]:
        env[n] = fw.node_copy(n, lambda x: env[x])
    fw.output([env[o] if isinstance(o, fx.Node) else o for o in outs[:n_out]] + [env[s] for s in saved])
    fw_gm = cleanup(fx.GraphModule(gm, fw))
    if not tangents:
        return fw_gm, None, 0
    bw, benv = fx.Graph(), {}
    for n in saved + tangents:
        benv[n] = _meta(bw.placeholder(n.name if n in T else f"saved_{n.name}"), n)
    for n in [n for n in nodes if n in T and n.op != "placeholder"]:
        benv.update({a: bw.node_copy(a) for a in n.all_input_nodes if a.op == "get_attr" and a not in benv})
        benv[n] = bw.node_copy(n, lambda x: benv[x])
    bw.output([benv[o] if isinstance(o, fx.Node) else o for o in outs[n_out:]])
    return fw_gm, cleanup(fx.GraphModule(gm, bw)), len(saved)
