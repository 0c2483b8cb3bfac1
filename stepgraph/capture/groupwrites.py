"""What the step leaves in its optimizers' param groups, written again after each replay.

A replay runs no Python, so a param-group entry the step's call sets is written again after
it: a number from tracked arithmetic (``group['counter'] += 1``: trackplan.swap_out), a live
hyper-parameter the step assigned (trackplan.hyper_effects), and -- here -- any other plain
value the call left there (a bool, a string, a number): an optimizer library's own code that
stores a literal, out of the scan's sight (pytorch_optimizer's Lookahead resets
``group['counter'] = 0`` every k steps: the replayed reset left 2, and every later call took
the slow-weights branch; ScheduleFree's ``optimizer.train()`` in the step sets
``group['train_mode'] = True``: left False by a replay, the next ``eval()`` skipped its swap).
The graph that wrote it was captured on that path, so the value is what this path leaves, as
every other constant of the graph is."""
from __future__ import annotations

import torch

from .numchecks import Op, Root
from .trackplan import NumberEffect, hyper_effects, swap_out
from .tracked import _PROXIES, plain

_PLAIN = (bool, int, float, str, type(None))


def held_ids(reg) -> set:
    """Ids of the device tensors stepgraph holds hyper-parameters in (state.device_hypers)."""
    return {id(x) for _, _, t in reg.device_hypers for x in (t if isinstance(t, tuple) else (t,))}


def user_tensor(reg, v) -> bool:
    """A tensor the user put in a param group (``g['lr'] = torch.tensor(lr)``), not one of the
    device hyper-parameters stepgraph made."""
    return isinstance(v, torch.Tensor) and id(v) not in held_ids(reg)


def live_floats(reg, live_hypers):
    """The live hyper-parameters ``(optimizer index, group index, key)`` a trace reads live: not
    one holding a tensor of the user's now (the graph reads that tensor; read live as a number,
    a replay handed the tensor where the graph took a float, and raised half-way)."""
    out, seen = [], set()
    for oi, gi, k in live_hypers:
        group = reg.optimizers[oi][1].param_groups[gi]
        # (one substitution per group entry: accelerate's AcceleratedOptimizer and the optimizer it
        # wraps share their groups; the second put its live value over the first's, and putting them
        # back wrote the capture's lr after each replay, over the scheduler's: an lr frozen, silently)
        if (id(group), k) not in seen and not user_tensor(reg, group.get(k)):
            seen.add((id(group), k))
            out.append((oi, gi, k))
    return out


def snapshot(reg) -> list:
    """``(group, its entries)`` of every param group of the registry's optimizers, now."""
    return [(g, dict(g)) for _, opt in reg.optimizers for g in getattr(opt, "param_groups", ())]


def _target(e: NumberEffect):
    """``(id of the dict, key)`` an effect writes, or None."""
    if e.root.kind == "slot":
        slot = e.root.ref[0]
        return id(slot.owner), slot.key
    src = e.source
    if src is not None and len(src.path) == 1 and src.path[0][0] == "item" and src.kind == "object":
        return id(src.root), src.path[0][1]
    return None


def number_effects(swapped, args, track, reg, saved_hypers, scheduled, before, slot_effects=None) -> list:
    """The trace's number effects (swap_out, hyper_effects), then a write of each plain
    param-group value the call changed that none of those writes (nor a scheduler stepped in
    the step, which runs again after each replay). An optimizer's own number set to a float the
    graph computes (GSAM's ``rho_t`` from the lr its scheduler set) goes to ``slot_effects``,
    written after each replay; a plain one is written again as it is."""
    from .hostscalar import _tracer
    from .pyvalues import Source
    from .rebound import float_effect
    cs = track.const_stores if track else ()
    untracked: list = []
    effects = swap_out(swapped, args, cs, untracked) + hyper_effects(reg, saved_hypers, scheduled, cs, args)
    for r, old, new in untracked:
        e = float_effect(r.ref[0], new, _tracer())
        if e is not None and slot_effects is not None:
            slot_effects.append(e)   # (a float the graph computes: written after each replay)
        elif type(new) in (int, float):
            # (a plain number: computed from values the graph is keyed by, the same at each replay
            # of it -- written again, as a plain param-group value is below)
            effects.append(NumberEffect(r, r.ref[0].owner, new))
    for e in effects:   # (``g['betas'] = (b1, 0.999)``, b1 from the call's ``it``: per member; as one
        if isinstance(e.expr, tuple) and any(type(x) in _PROXIES for x in e.expr):   # constant, the
            e.write(tuple(map(plain, e.expr)), args)                                 # capture's betas
            e.expr = Op(_tuple, tuple(x._e if type(x) in _PROXIES and getattr(x, "_e", None) is not None
                                      else plain(x) for x in e.expr))                # stayed, silently)
    done = {_target(e) for e in effects} | {(id(g), k) for g, k, *_ in saved_hypers if isinstance(g, dict)}
    names = {id(g): f"{n}.param_groups[{gi}]" for n, opt in reg.optimizers
             for gi, g in enumerate(getattr(opt, "param_groups", ()))}
    for group, old in before:
        for k, v in group.items():
            if k == "params" or type(v) not in _PLAIN or (id(group), k) in done:
                continue
            was = old.get(k, _PLAIN)
            if was is v or type(was) is type(v) and was == v:
                continue
            if any(g is group and key == k for g, key, _ in scheduled):
                continue
            src = Source("object", group, names.get(id(group), "param_groups[?]"), (("item", k),))
            effects.append(NumberEffect(Root("source", src, src.describe()), None, v))
    return effects


def _tuple(*xs) -> tuple:
    return xs
