"""``check`` mode: for the first N replays, also run the step eagerly and compare.

Each checked call snapshots every state tensor (parameters, buffers, grads, optimizer state)
and the RNG, replays the graph, records the result, restores the snapshot, runs the step
eagerly, and compares the two outcomes tensor by tensor. The eager outcome is kept, so a
divergence never corrupts training; the first diverging tensor is reported (warning, log and
``stats.check_reports``).

    step = stepgraph.compile(train_step, check=3)      # or STEPGRAPH_CHECK=1 (3 replays)
"""
from __future__ import annotations

import logging
import warnings

import torch

from .capture import fetches
from .capture.rollback import snapshot

log = logging.getLogger("stepgraph")


def _state(reg) -> list[tuple[str, torch.Tensor]]:
    out = []
    for src, p in reg.params:
        out.append((src, p))
        if p.grad is not None:
            out.append((f"{src}.grad", p.grad))
    for mname, mod in reg.modules:
        for bname, b in mod.named_buffers():
            out.append((f"{mname}.{bname}", b))
    for oname, opt in reg.optimizers:
        for p, st in opt.state.items():
            for k, v in (st.items() if isinstance(st, dict) else ()):
                if isinstance(v, torch.Tensor):
                    out.append((f"{oname}.state[{reg.name_of(p) or '?'}]['{k}']", v))
    return out


def _snapshot(reg, schedulers=()):
    slots = [(s, s.get()) for s in reg.slots()]
    tensors = [(name, t, t.detach().clone()) for name, t in _state(reg)]
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    # The Python side too: the hyper-parameters of every group and the schedulers the step steps
    # (a replay steps them again after the graph; the eager shadow must not step them twice).
    groups = [(g, {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"})
              for _, opt in reg.optimizers for g in opt.param_groups]
    scheds = [(sc, sc.state_dict()) for sc in dict.fromkeys(schedulers)]
    return slots, tensors, rng, groups, scheds


def _restore(snap) -> None:
    slots, tensors, rng, groups, scheds = snap
    for sc, state in scheds:
        sc.load_state_dict(state)
    for g, saved in groups:
        for k, v in saved.items():
            if isinstance(v, torch.Tensor) and isinstance(g.get(k), torch.Tensor):
                with torch.no_grad():
                    g[k].copy_(v)   # (a device hyper-parameter the graph reads: same tensor)
            else:
                g[k] = v
    for slot, value in slots:
        slot.set(value)
    with torch.no_grad():
        for _, t, saved in tensors:
            t.copy_(saved)
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state_all(rng[1])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    if torch.equal(a, b):
        return 0.0
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def checked_call(stepfn, entry, replay, args, kwargs, rtol: float):
    """Replay with an eager shadow; returns the eager result (state as eager leaves it)."""
    reg = stepfn.registry
    tr = entry.trace   # loop variables the replay writes (pyeffects.py)
    before = _snapshot(reg, [sc for sc, *_ in tr.scheduler_steps])
    restore_vars = snapshot(list(tr.source_inputs) + [e.source for e in tr.source_effects], args)
    out_r = replay()
    after_r = {name: t.detach().clone() for name, t in _state(reg)}
    out_r = torch.utils._pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, out_r)
    _restore(before)
    restore_vars()
    out_e = fetches.call(stepfn.fn, stepfn.fetches, args, kwargs, stepfn.__name__)
    worst = (0.0, "")
    for name, t in _state(reg):
        r = after_r.get(name)
        e = float("inf") if r is None else _rel(r, t)
        if e > worst[0]:
            worst = (e, name)
    ro, eo = torch.utils._pytree.tree_leaves(out_r), torch.utils._pytree.tree_leaves(out_e)
    for i, (a, b) in enumerate(zip(ro, eo)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            e = _rel(a, b)
            if e > worst[0]:
                worst = (e, f"output {i}")
    n = len(stepfn.stats.check_reports) + 1
    if worst[0] > rtol:
        msg = (f"stepgraph check: {stepfn.__name__} replay {n} diverged from eager: first worst tensor "
               f"{worst[1]} (relative error {worst[0]:.3g} > {rtol:g}); eager's result was kept")
        warnings.warn(msg, stacklevel=3)
        log.warning(msg)
    else:
        msg = f"check {n}: replay equals eager (max relative error {worst[0]:.3g}{' at ' + worst[1] if worst[1] else ''})"
        log.info("stepgraph: %s: %s", stepfn.__name__, msg)
    stepfn.stats.check_reports.append(msg)
    return out_e
