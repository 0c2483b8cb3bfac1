"""A param-group value read after an LR scheduler stepped inside the step: next call's value.

A scheduler stepped in the step is run again after each replay (libraries.record_scheduler_steps),
so the lr it sets exists only once the graph has run. The trace ran it on plain floats and put
the live lr (read at the graph's start) back where the value was unchanged: a step that then
read the group (``sched.step(); return loss, opt.param_groups[0]["lr"]``, or
``sched.get_last_lr()[0]``) replayed the call's starting lr -- MultiStepLR's milestone lr came one
call late, silently (probe s25_probe p12/p14); one the scheduler changed was a plain float,
baked into a tensor op (``loss * lr``). Now the scheduler leaves a ``HostFloat`` whose node is
marked: returned as it is, it is read from the group after the replay (output kind "live");
arithmetic on it returned is this capture's number, warned as any returned number a replay
cannot recompute; any other use the graph keeps (a tensor op, a value stored for a replay to
write, a branch) is refused at the scheduler's line.
"""
from __future__ import annotations

from .hostscalar import HostFloat, _plain, _tracked, group_reader

_MARK = "sg_next_lr"


def mark(sched, lives: list, where) -> None:
    """After ``sched.step()`` ran on plain floats: the values it drives ('lr', and any it
    changed: CyclicLR's momentum) become marked floats; ``_last_lr`` holds the same ones."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    mode = get_proxy_mode()
    if mode is None:
        return
    for g, key, _, plain in lives:
        new = g.get(key)
        if not isinstance(new, float) or _tracked(new) or (key != "lr" and new == plain):
            continue   # (untouched by the scheduler: stays live; a tracked number is replayed as one)
        node = mode.tracer.create_node("call_function", group_reader(g, key), (), {})
        node.meta[_MARK] = (g, key, f"{type(sched).__name__}.step()", where, [])
        g[key] = HostFloat(_plain(new), node)
    last = getattr(sched, "_last_lr", None)
    groups = getattr(sched.optimizer, "param_groups", ())
    if isinstance(last, list) and len(last) == len(groups):
        for i, g in enumerate(groups):
            if slot(g.get("lr")) is not None and _plain(last[i]) == _plain(g["lr"]):   # (no recorded ==)
                last[i] = g["lr"]
                g["lr"].node.meta[_MARK][4].append((last, i))   # (given the group's plain float back)


def slot(v):
    """(group, key) whose next value ``v`` is, or None."""
    return slot_of(v.node) if issubclass(type(v), HostFloat) else None


def slot_of(node):
    """(group, key) whose next value the graph node ``node`` reads, or None."""
    m = node.meta.get(_MARK)
    return None if m is None else m[:2]


def derived(v) -> bool:
    """``v`` is arithmetic on a marked value (``lr * 2`` returned): a number no replay can
    recompute, returned as this capture's value and warned (outputs.live_outputs)."""
    if not issubclass(type(v), HostFloat):
        return False
    todo, seen = [v.node], set()
    while todo:
        n = todo.pop()
        if n.meta.get(_MARK) is not None:
            return True
        if n not in seen and n.op == "call_function":
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def restore(group: dict, key, old) -> bool:
    """At the trace's end: a marked value in ``group[key]`` back to a plain float (the old
    object where the scheduler left the value)."""
    v = group.get(key)
    if slot(v) is None:
        return False
    group[key] = plain = old if type(old) is float and old == _plain(v) else _plain(v)
    for held, i in v.node.meta[_MARK][4]:   # (the same object: a returned _last_lr[0] is the group's lr)
        if held[i] is v:
            held[i] = plain
    return True


def used(gm) -> list:
    """Problems for marked values the graph still needs (reached from a write, a guard or an
    output): a replay would give them this call's starting value, not the scheduler's."""
    from ..passes.cleanup import _impure
    from .effects import Problem
    needed, todo = set(), [n for n in gm.graph.nodes if _impure(n)]
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    out = []
    for n in gm.graph.nodes:
        m = n.meta.get(_MARK)
        if m is not None and n in needed:
            _, key, what, where, _ = m
            out.append(Problem(
                f"the {key!r} that {what} set in this call is used later in the step (in a tensor op, "
                "a branch or a value kept in Python): a replay runs the scheduler after the "
                "graph, so the graph would use this call's starting value", where,
                f"read the {key} before the scheduler step, or return it as it is "
                "(return loss, opt.param_groups[0]['lr']) and use it outside the step", plain=True))
    return out
