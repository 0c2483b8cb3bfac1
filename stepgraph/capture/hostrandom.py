"""Host inputs a trace cannot see: random numbers the step draws with Python's ``random`` or
``numpy.random``, and batches it takes from an iterator with ``next()``.

Such a draw is no aten op: the trace sees only what it produced (a replay-buffer batch built
from ``np.random.randint`` indices, ``random.sample(memory, n)`` transitions, an ``if
random.random() < eps`` branch) and a replay runs no Python, so it would reuse this call's draw
at every step: silently wrong (sfujim/TD3's ``policy.train`` samples its batch this way). The
draw is recorded as a problem and the capture refused, naming the user's line; the call itself
ran for real, so state is what eager leaves. ``batch = next(train_loader)`` in the step is the
same: the iterator advances only at capture (lucidrains' ``cycle(DataLoader)`` loops).
"""
from __future__ import annotations

import builtins
import contextlib
import os
import random
import sys
import traceback

import torch
import torch.utils._pytree as pytree

from ..errors import library_frame, user_frame
from .effects import Problem
from .tracked import _plain_use

_PY = ("random", "randint", "randrange", "choice", "choices", "sample", "shuffle", "uniform", "gauss",
       "normalvariate", "lognormvariate", "expovariate", "betavariate", "gammavariate", "triangular",
       "vonmisesvariate", "paretovariate", "weibullvariate", "getrandbits", "randbytes")
_NP = ("rand", "randn", "randint", "random", "random_sample", "ranf", "sample", "choice", "permutation",
       "shuffle", "normal", "uniform", "standard_normal", "binomial", "poisson", "beta", "gamma",
       "exponential", "multinomial", "dirichlet", "laplace", "logistic", "lognormal", "geometric",
       "integers", "random_integers", "bytes")


def _modules():
    out = [("random", random, _PY)]
    try:
        import numpy.random as npr
        out.append(("numpy.random", npr, _NP))
    except ImportError:
        pass
    return out


def _generator_types() -> tuple:
    out = [random.Random]
    try:
        import numpy.random as npr
        out += [npr.Generator, npr.RandomState]
    except ImportError:
        pass
    return tuple(out)


def _generator_state(g) -> bytes:
    import pickle
    if isinstance(g, random.Random):
        return pickle.dumps(g.getstate())
    if hasattr(g, "bit_generator"):   # numpy.random.Generator
        return pickle.dumps(g.bit_generator.state)
    return pickle.dumps(g.get_state(legacy=False))   # numpy.random.RandomState


def generator_states(py, args) -> list:
    """Before the trace: each random generator object the step's code reads (``rng =
    np.random.default_rng(seed)``, a ``RandomState``, a ``random.Random``; a global, a closure
    cell, an attribute such as ``self.rng``), with its state. Their methods are C code no patch
    reaches; a draw shows as a changed state (``generator_draws``)."""
    kinds, out, seen = _generator_types(), [], set()
    for s in py.sources:
        g = s.read_or(args)
        if isinstance(g, kinds) and id(g) not in seen:
            seen.add(id(g))
            out.append((s, g, _generator_state(g)))
    return out


def generator_draws(before: list) -> list:
    """After the trace: a problem for each generator of ``generator_states`` that drew."""
    return [Problem(
        f"the step draws host random numbers from {s.describe()} (a {type(g).__module__}.{type(g).__name__}): "
        "a replay runs no Python code, so it would reuse this call's draw at every step (the same "
        "batch, the same branch)", s.where,
        "draw them in the loop outside the step and pass the result (the batch, the indices, the "
        "decision) as arguments; or draw with torch inside the step (torch.randint / torch.rand / "
        "torch.randperm), which the graph replays", plain=True)
        for s, g, state in before if _generator_state(g) != state]


# Iterators over a container's items: ``next()`` on one over the step's own values (DETR's
# ``next(iter(outputs.values())).device``) is a look-up, not a batch taken from a loader.
_CONTAINER_ITERATORS = tuple({type(iter(c)) for c in ({}, {}.keys(), {}.values(), {}.items(), [], (), set(),
                                                       frozenset(), reversed([]))})


def _data_from_iterator(it, value, named) -> bool:
    """``next()`` handed back tensors that are not named state (a batch, not a parameter) nor,
    from an iterator over a container, values the step computed. (A DataLoader over a
    TensorDataset stacks its batch while traced too: only a container's iterator is let through
    on that ground -- a first fix that let every traced value through replayed the capture's
    batch, silently.)"""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, has_proxy_slot
    try:
        leaves = pytree.tree_leaves(value)[:256]
    except Exception:  # noqa: BLE001 - an object pytree cannot walk: not data
        return False
    mode = get_proxy_mode()
    own = isinstance(it, _CONTAINER_ITERATORS) and mode is not None
    return any(isinstance(t, torch.Tensor) and not named(t) and not (own and has_proxy_slot(t, mode.tracer))
               for t in leaves)


def _once(problems: list, marker: str, make, where: str) -> None:
    """Add ``make()`` unless a problem of this kind (``marker`` in its text) is already there for
    ``where``: one problem per call site, however often it runs."""
    if all(p.where != where or marker not in p.op for p in problems):
        problems.append(make())


def _draw_states() -> tuple:
    """(torch's CPU generator's state, (``random``'s, numpy's global one)), comparable."""
    from torch.utils._python_dispatch import _disable_current_modes
    try:   # (inside torch.func's transforms, DP-SGD's per-sample grads, a tensor may have no storage)
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch._C._DisableFuncTorch():
            cpu = bytes(torch.default_generator.get_state().numpy())
    except Exception:  # noqa: BLE001 - unknown: counted as a draw (fetches.plan then refuses)
        cpu = object()
    host = [random.getstate()]
    np = sys.modules.get("numpy")
    if np is not None:
        st = np.random.get_state(legacy=False)["state"]
        host.append((st["pos"], st["key"].tobytes()))
    return cpu, tuple(host)


def _copy(batch):
    """A batch as ``next()`` returned it, before the step writes into it (timm's in-place mixup)."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch._C._DisableFuncTorch():
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)


def _next_watch(problems: list, named, seen=None):
    orig = builtins.next
    start = _draw_states() if seen is not None else None
    inside = [False]   # (_draw_states' own context managers call next())

    def watched(*a):
        if inside[0]:
            return orig(*a)
        from .pyvalues import _user_code
        caller = sys._getframe(1).f_code
        # Only the user's own next() can take a batch. Library calls (contextlib's __enter__,
        # pytree) are ~10 per traced op: reading the generators' states for each of them was 40%
        # of a GPT's trace (12 layers, 2 micro-batches: 34k calls, 4.5 of 11.3 s on the CPU).
        user = _user_code(caller) and not caller.co_filename.startswith(_HERE)
        before = None
        if user and seen is not None:
            inside[0] = True
            try:
                before = _draw_states()
            finally:
                inside[0] = False
        from .dataorder import taking_next
        with taking_next():   # (an iterator's reads are its batch's: dataorder.note_read)
            out = orig(*a)
        if user and _data_from_iterator(a[0], out, named):
            where = user_frame(traceback.extract_stack())
            if seen is not None:   # (fetches.py: taken before the step from the next call on)
                from .fetches import SeenNext
                inside[0] = True
                try:
                    now = _draw_states()
                    seen.append(SeenNext(a[0], where, before[0] != start[0], now[0] != before[0],
                                         _copy(out), now[1] != before[1]))
                finally:
                    inside[0] = False
            _once(problems, "next(", lambda: Problem(
                f"the step takes its data with next({type(a[0]).__name__}): a replay runs no Python "
                "code, so the iterator would not advance and every replay would train on this "
                "call's batch", where,
                "take the batch in the loop outside the step (batch = next(loader)) and pass it "
                "as an argument: step(batch)", plain=True), where)
        return out
    return orig, watched


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # stepgraph's own code


SEEDING = ("seed", "setstate", "set_state")


def _seen_draw(seen: list, label, name, a, k, where, out, start_cpu, lib: str = "") -> None:
    """Record a draw for fetches.plan: a draw it can take by itself (constant arguments, a number
    or a float array), or else the data call of the step's it is made in (datacalls.py: that
    whole call is taken, the draws it made before recorded with it)."""
    from . import datacalls
    from .dataorder import call_key
    from .fetches import SeenCall, SeenDraw, takeable
    outer, frame = datacalls.draw_frames()   # (the step's call this draw runs in; it, if it drew)
    if outer is not None and datacalls.recorded(outer):
        return
    if frame is not None and not takeable(a, k, out):
        site = datacalls.site_of(frame)
        if site is not None:   # (a helper's draws inside it, recorded before, are the call's)
            seen[:] = [s for s in seen if not (isinstance(s, SeenDraw) and s.frame is frame)]
            seen.append(SeenCall(site, site.where, _draw_states()[0] != start_cpu, call_key(frame)))
            return
    seen.append(SeenDraw(label, name, a, k, where, out, outer, lib))


def _seeding(seen: list, label: str, name: str, orig):
    def seeding(*a, **k):
        from .fetches import SeenDraw
        seen.append(SeenDraw(label, name, a, k, user_frame(traceback.extract_stack()), None))
        return orig(*a, **k)
    seeding.__wrapped__ = orig
    return seeding


@contextlib.contextmanager
def host_random_watch(problems: list, named=lambda t: False, seen=None):
    """While the step is traced: each module-level draw of ``random`` / ``numpy.random``, and
    each ``next()`` in user code that returns tensors ``named`` does not know, adds a problem
    (once per call site). Draws made from inside another draw are not counted twice."""
    from .dataorder import watching
    saved, inside = [], [False]
    start_cpu = _draw_states()[0] if seen is not None else None
    orig_next, watched = _next_watch(problems, named, seen)
    saved.append((builtins, "next", orig_next))
    builtins.next = watched

    def wrap(label, name, orig):
        def draw(*a, **k):
            if inside[0]:
                return orig(*a, **k)
            inside[0] = True
            try:
                stack = traceback.extract_stack()
                where, lib = user_frame(stack), library_frame(stack)
                # (a library's own draw, e.g. Wav2Vec2's SpecAugment masks with numpy: the user
                # cannot move it, only switch that feature off or call that code outside)
                fix = (f"switch off the model option that draws there ({lib}) while training under "
                       "stepgraph: e.g. Wav2Vec2/HuBERT's SpecAugment mask_time_prob=0.0 and "
                       "mask_feature_prob=0.0, BigBird's block-sparse attention attention_type="
                       "'original_full'; or graph the parts without it, stepgraph.graph_module(...), "
                       "the step staying eager" if lib else
                       "draw them in the loop outside the step and pass the result (the batch, the "
                       "indices, the decision) as arguments; or draw with torch inside the step "
                       "(torch.randint / torch.rand / torch.randperm), which the graph replays; a "
                       "coin that picks a branch: torch.where(torch.rand(()) < p, a, b)")
                _once(problems, "host random", lambda: Problem(
                    f"the step draws host random numbers with {label}.{name}(): a replay runs no "
                    "Python code, so it would reuse this call's draw at every step (the same batch, "
                    "the same branch)", where, fix, lib, plain=True), where)
                # (TRL's ``np.random.permutation(args.local_batch_size)``: a tracked number, which
                # numpy's C code does not take for an int; its value decides the draw: checked)
                a, k = pytree.tree_map(_plain_use, (a, k))
                out = orig(*a, **k)
                if seen is not None:   # (fetches.py: drawn before the step from the next call on)
                    _seen_draw(seen, label, name, a, k, where, out, start_cpu, lib)
                return out
            finally:
                inside[0] = False
        draw.__wrapped__ = orig
        return draw
    saved += patch_draws(wrap, (lambda label, name, orig: _seeding(seen, label, name, orig)) if seen is not None else None)
    try:
        with watching(seen, problems):   # (reads and torch draws of data calls: dataorder.py)
            yield
    finally:
        for mod, name, orig in reversed(saved):
            setattr(mod, name, orig)


def patch_draws(make, seeding=None) -> list:
    """Each draw function of ``random`` / ``numpy.random`` replaced by ``make(label, name, orig)``
    (the seeding ones by ``seeding(...)``, when given), in its module and wherever it was
    imported; returns what to put back, ``(module, name, original)``."""
    saved, wrapped = [], {}
    for label, mod, names in _modules():
        for name in names + (SEEDING if seeding is not None else ()):
            orig = getattr(mod, name, None)
            if orig is None or not callable(orig):
                continue
            saved.append((mod, name, orig))
            new = wrapped.setdefault(id(orig), (orig, (seeding if name in SEEDING else make)(label, name, orig)))[1]
            setattr(mod, name, new)
    return saved + _imported_draws(wrapped)


def _imported_draws(wrapped: dict) -> list:
    """``from random import random`` (x-transformers' layer dropout, denoising-diffusion-pytorch's
    self-conditioning coin; ``from math import cos``: hostreads.math_patches) binds the module's
    function in the importer's namespace, where the patch on ``random`` never reaches: its draw
    was baked, silently. Each module global holding one of the patched functions gets the patch too (a scan of sys.modules: 18 ms with transformers
    loaded, where gc.get_referrers took 150); returns what to put back, as ``(module, name, original)``."""
    out = []
    for m in list(sys.modules.values()):
        d = getattr(m, "__dict__", None)
        if type(d) is not dict:
            continue
        for k, v in list(d.items()) if any(id(v) in wrapped for v in d.values()) else ():
            w = wrapped.get(id(v))
            if w is not None and w[0] is v:
                out.append((m, k, v))
                d[k] = w[1]
    return out


def refuse_draw_checks(fetches, checks: list, max_captures: int) -> None:
    """A drawn number a graph holds by value (numpy math on mixup's weight, a cutmix box), or
    more coins than ``max_captures`` graphs cover (bentrevett's coin at every decoder step):
    each call would miss and capture again. Refused at the first capture, as torch draws read on
    the host are (randomreads.py); a coin or two stays guarded (a graph each side)."""
    from ..errors import CaptureError
    from .fetches import draw_labels
    from .numchecks import roots_of
    labels = draw_labels(fetches)
    on = [c for c in checks if any(r.label in labels for r in roots_of(c.expr))] if labels else []
    values = [c for c in on if not c.decided]
    if values or 2 ** len(on) > max_captures:
        c = (values or on)[0]
        k = int(next(r.label for r in roots_of(c.expr) if r.label in labels).split("#")[1].split(" ")[0])
        f = fetches[k]
        why = ("uses its value where no graph can read it live" if values else
               f"branches on {len(on)} draws: up to {2 ** len(on)} graphs")
        from .libraries import library_draw_fix
        raise CaptureError(
            f"the step draws host random numbers with {f.describe()} and {why}: each call would "
            f"capture again", op=f"{f.fn[0]}.{f.fn[1]}()", where=c.where or f.where,
            fix=library_draw_fix(f.lib) if f.lib else "draw them in the loop outside the step and pass the result (the decision, the value) as "
                "arguments; or draw with torch inside the step (torch.rand / torch.randint), which the graph "
                "replays; a coin that picks a branch: torch.where(torch.rand(()) < p, a, b)")
