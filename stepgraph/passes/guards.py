"""Place host-read guards as early as the graph allows, and make a guard miss undoable.

A guard (``hostreads.host_guard``) is recorded where the step read the value, often after
ops that do not lead to it (``loss.item()`` logged after the backward and the optimizer
step). Here the guards and what they depend on move to the front when that changes no
result: no op moved ahead writes what an op it passes reads, or reads what such an op
writes, and the random stream keeps its order. The nodes before the last guard form the
**prefix**: what a replay runs before it knows whether the graph holds for this call. On a
miss the prefix's writes to state and inputs (BatchNorm running stats, ``.grad`` accumulated
by a backward before the read) are copied back from copies taken at the start of the call,
and the random generator is rewound, so the call can run again as eager would.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from ..markers import host_guard
from .analysis import _base, _written_args

_RNG = "<rng>"


@dataclass
class GuardPlan:
    """What :func:`place_guards` did, for ``explain()``."""
    guards: list = field(default_factory=list)   # (site, what, value)
    prefix_ops: int = 0         # ops a replay runs before its last guard
    total_ops: int = 0
    saved: list = field(default_factory=list)    # names of state/input tensors copied each call
    saved_bytes: int = 0
    reordered: bool = False


def _root(n):
    """The tensor ``n`` aliases (analysis._base); a state tensor (get_attr, which a trace
    repeats per use) by its attribute name."""
    n = _base(n)
    return ("attr", n.target) if n.op == "get_attr" else n


def _effects(n: fx.Node) -> tuple[set, set]:
    """(roots read, roots written) of one node; the random generator counts as one root."""
    if n.op != "call_function":
        return set(), set()
    t = n.target
    reads = {_root(a) for a in n.all_input_nodes}
    writes: set = set()
    if isinstance(t, torch._ops.OpOverload):
        writes = {_root(a) for a in _written_args(n)}
        if torch.Tag.nondeterministic_seeded in t.tags:
            reads.add(_RNG)
            writes.add(_RNG)
    else:
        from ..markers import RNG_STATE_FUNCS
        if t in RNG_STATE_FUNCS:
            reads.add(_RNG)
            writes.add(_RNG)
    return reads, writes


def _ancestors(nodes) -> set:
    seen, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def place_guards(gm: fx.GraphModule, device: str, name_of=lambda t: None) -> GuardPlan | None:
    g = gm.graph
    nodes = list(g.nodes)
    guards = [n for n in nodes if n.op == "call_function" and n.target is host_guard]
    if not guards:
        return None
    plan = GuardPlan(guards=[(n.args[2], n.args[3], n.args[1]) for n in guards])
    anc = _ancestors(guards)
    early = anc | set(guards)
    # Moving `early` ahead of the other nodes is safe when no other node before a moved one
    # writes what it touches or reads what it writes.
    other_reads, other_writes, ok = set(), set(), True
    for n in nodes:
        r, w = _effects(n)
        if n in early:
            if (r | w) & other_writes or w & other_reads:
                ok = False
                break
        else:
            other_reads |= r
            other_writes |= w
    if ok:
        head = [n for n in nodes if n.op in ("placeholder", "get_attr")]
        order = head + [n for n in nodes if n in early and n not in head] + \
            [n for n in nodes if n not in early and n not in head]
        plan.reordered = order != nodes
        anchor = nodes[0]
        for n in order:
            if n.op == "placeholder":
                anchor = n
                continue
            if n.op == "output":
                continue
            anchor.append(n)  # fx moves a node already in the graph
            anchor = n
    nodes = list(g.nodes)
    last = max(nodes.index(n) for n in guards)
    prefix = nodes[:last]
    plan.total_ops = sum(1 for n in nodes if n.op == "call_function")
    plan.prefix_ops = sum(1 for n in prefix if n.op == "call_function")
    attr_node = {}
    for n in nodes:
        if n.op == "get_attr":
            attr_node.setdefault(n.target, n)
    first = next(n for n in nodes if n.op not in ("placeholder", "get_attr"))
    copies: dict = {}   # root -> (tensor node, its copy at the start of the call)
    rng_node = None
    for n in prefix + [nodes[last]]:
        if n.op == "call_function" and n.target is host_guard:
            # Undo what ran before this guard: each root written so far, the random stream.
            n.args = n.args[:4] + (tuple(copies.values()), rng_node)
            continue
        _, w = _effects(n)
        if _RNG in w and rng_node is None:
            # (a CUDA step draws on the CPU too: MoCo's torch.randperm(n).cuda(). Each sibling
            # tried and missed drew a permutation that was never given back: every later call
            # shuffled otherwise than eager, 0.29 relative on the H200, silently)
            gens = (torch.cuda.default_generators[torch.cuda.current_device()], torch.default_generator) \
                if device == "cuda" else (torch.default_generator,)
            with g.inserting_before(first):
                rng_node = g.call_function(_generator_state(gens), ())
        for x in w:
            if x in copies or not (isinstance(x, tuple) or (isinstance(x, fx.Node) and x.op == "placeholder")):
                continue
            node = attr_node[x[1]] if isinstance(x, tuple) else x
            with g.inserting_after(node):
                copies[x] = (node, g.call_function(torch.ops.aten.clone.default, (node,)))
            t = getattr(gm, node.target) if node.op == "get_attr" else node.meta.get("val")
            if isinstance(t, torch.Tensor):
                plan.saved_bytes += t.numel() * t.element_size()
            plan.saved.append((name_of(t) if node.op == "get_attr" else None) or node.name)
    g.lint()
    gm.recompile()
    return plan


def _generator_state(gens):
    """A graph node's function: ((generator, its state now), ...), what a guard miss rewinds to."""
    def generator_state():
        return tuple((gen, gen.get_state()) for gen in gens)
    generator_state.stepgraph_impure = True
    return generator_state
