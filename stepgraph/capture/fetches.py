"""Host inputs the step takes itself: batches from ``next(iterator)`` and host random draws.
Taken before the call, in the step's order, and fed in as arguments.

NVlabs EDM's loop takes its batches inside the step (``images, labels = next(dataset_iterator)``,
once per accumulation round); the PyTorch seq2seq tutorial's ``train()`` flips its teacher-forcing
coin with ``random.random()``; GAN loops draw their noise with ``np.random.normal``. A replay
runs no Python, so the iterator would not advance and every replay would reuse the capture's
batch and draws (refused, hostrandom.py). Instead, the capture that meets them records each one
in call order -- how the step reaches the iterator (a pyvalues ``Source``: a global, a closure
cell, an attribute), or the ``random``/``numpy.random`` function and its constant arguments --
and counts as a warm-up. From the next call on, they are taken *before* the step runs, in that
order, and handed to it as a hidden keyword argument (``FETCH_KW``): tensors are inputs like an
argument's (a partial last batch is a new signature, with its own graph), drawn numbers are tracked
like a numeric argument (a coin's ``< p`` picks one of two sibling graphs, a mixing weight is
read live), and the step's ``next()``/draw returns them (``handing_back``) in an eager call, in
the trace and in check mode alike. An iterator is read through its source at each call: a new
one per epoch is no new graph. A draw the step makes otherwise than recorded (another function,
other arguments) or leaves out rewinds ``random``/numpy to where eager would draw it.

A draw made inside a function the step calls (``memory.sample(batch_size)``: ``random.sample``
over a replay buffer, the batch built with ``torch.tensor``) takes that whole call first instead:
a *data call* (datacalls.py), its result fed in as inputs.

Not planned (the refusal stands): an iterator no source reaches (made inside the step); a draw
in the step's own code given something other than constants (``random.sample(buffer, n)``) or
giving other than a number or a float array (``np.random.randint(0, n, size=b)``: a replay
buffer's indices, read in Python to pick items); a ``next()`` that draws
from torch's generator after the step drew from it, or any but the first (taken first, its draws
would come before the step's own); one that draws from ``random``/numpy when the step draws too.
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import random
import sys
import threading
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch

from . import dataorder, datacalls
from .rollback import _host_rng

FETCH_KW = "_stepgraph_batches"   # the hidden keyword argument that carries the call's inputs
_TAKEN = threading.local()         # the last take(): host random states before each draw


@dataclass(frozen=True)
class Fetch:
    """One ``next()`` (``source`` set) or draw (``fn`` set) of the step, in call order."""
    where: str
    source: object = None   # pyvalues.Source of the iterator
    fn: tuple = ()          # ("random" | "numpy.random", function name)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    call: object = None     # datacalls.CallSite: a data call of the step's, taken whole
    lib: str = field(default="", compare=False)   # the draw's library line, if library code drew it

    def describe(self) -> str:
        if self.call is not None:
            return self.call.describe()
        if self.source is not None:
            return f"next({self.source.describe()})"
        return f"{self.fn[0]}.{self.fn[1]}({', '.join([repr(a) for a in self.args] + [f'{k}={v!r}' for k, v in self.kwargs.items()])})"

    def function(self):
        mod = random if self.fn[0] == "random" else sys.modules["numpy"].random
        return getattr(mod, self.fn[1])


@dataclass(frozen=True)
class SeenNext:
    """A ``next()`` the trace saw return data (hostrandom._next_watch)."""
    iterator: object
    where: str
    after_draws: bool   # torch's generator moved in the step before this next()
    draws: bool         # taking the batch moved it (a RandomSampler's seed, an augmentation)
    batch: object = None   # a copy of what it returned: the eager rerun after an undone trace gets it
    host_draws: bool = False   # taking the batch moved ``random``'s or numpy's generator


@dataclass(frozen=True)
class SeenCall:
    """A data call the trace saw a host draw in (hostrandom._seen_draw, datacalls.site_of)."""
    site: object
    where: str
    cpu_moved: bool   # a generator the call draws on moved in the step before it (dataorder.py)
    frame: object = field(default=None, compare=False, repr=False)   # the call's (dataorder.call_key)


@dataclass(frozen=True)
class SeenDraw:
    """A draw of ``random`` / ``numpy.random`` the trace saw (hostrandom.host_random_watch)."""
    module: str
    name: str
    args: tuple
    kwargs: dict
    where: str
    value: object
    frame: object = field(default=None, compare=False, repr=False)   # the data call it was drawn in
    lib: str = field(default="", compare=False)   # errors.library_frame: a library's draw


def _constant(x) -> bool:
    from .tracked import plain
    x = plain(x)
    if isinstance(x, (tuple, list)):
        return all(_constant(v) for v in x)
    return x is None or type(x) in (bool, int, float, str)


def _value_kind(v) -> bool:
    """A number, or a numpy array of floats (PyTorch-GAN's noise): taken first, an argument like
    a numpy array passed in (arrays.py). Not an integer array (``np.random.randint(0, n, size=b)``:
    a replay buffer's indices, read in Python to pick items: each call would capture again)."""
    if type(v) in (int, float, bool):
        return True
    np = sys.modules.get("numpy")
    return np is not None and type(v) is np.ndarray and v.dtype.kind == "f" and v.size > 0


def takeable(args, kwargs, value) -> bool:
    """A draw ``plan`` takes by itself: constant arguments, a number or a float array."""
    return _constant(args) and _constant(list(kwargs.values())) and _value_kind(value)


def _plain(x):
    from .tracked import plain
    return tuple(_plain(v) for v in x) if isinstance(x, (tuple, list)) else plain(x)


def plan(seen: list, sources: list, args) -> list | None:
    """Fetches for what a trace saw, or None when one cannot be taken before the step."""
    nexts = [s for s in seen if isinstance(s, SeenNext)]
    draws = [s for s in seen if isinstance(s, SeenDraw)]
    calls = [s for s in seen if isinstance(s, SeenCall)]
    # Taken first, a batch's draws move before the step's own: the same order as eager's only for
    # the first next() with no draw before it (a new DataLoader iterator's RandomSampler seed).
    if not seen or any(s.draws and (k or s.after_draws) for k, s in enumerate(nexts)) \
            or ((draws or calls) and any(s.host_draws for s in nexts)) \
            or any(s.cpu_moved or s.site.fn in datacalls.UNSAFE for s in calls) \
            or not all(takeable(d.args, d.kwargs, d.value) for d in draws):   # (a seeding, ``random.seed(k)``, has no value: never taken first)
        return None
    out = []
    for s in seen:
        if isinstance(s, SeenCall):
            out.append(Fetch(s.where, call=s.site))
            continue
        if isinstance(s, SeenDraw):
            out.append(Fetch(s.where, fn=(s.module, s.name), args=_plain(s.args),
                             kwargs={k: _plain(v) for k, v in s.kwargs.items()}, lib=s.lib))
            continue
        src = next((x for x in sources if not x.path and x.read_or(args) is s.iterator), None) \
            or next((x for x in sources if x.read_or(args) is s.iterator), None)
        if src is None:
            return None
        out.append(Fetch(s.where, source=src))
    for f in out:
        if f.source is not None:
            f.source.fetched = True   # (keyed by the iterator's type: a new one per epoch is no new graph)
    return out


MAX_REPLANS = 3   # (a draw that alternates between two forms would replan at every call)


def replan(old: list | None, replans: int, seen: list, sources: list, args) -> list | None:
    """The plan after a trace that saw inputs the plan did not take: the first plan, or an old
    plan of draws extended by the draws a longer path made past those it was handed (timm's
    mixup coin said no at the first call, mix at a later one). None: refused as before."""
    if old is None:
        return plan(seen, sources, args)
    used = consumed()
    if used is None or replans >= MAX_REPLANS or any(isinstance(s, (SeenNext, SeenCall)) for s in seen) \
            or any(f.call is not None for f in old):
        return None
    more = plan(seen, sources, args)
    if more is None:
        return None
    kept, k = [], 0
    for f in old:
        if f.fn:
            k += 1
            if k > used:
                continue
        kept.append(f)
    return kept + more


def input_label(k: int) -> str:
    """How messages name the ``k``-th input a call took (its leaf in the hidden argument)."""
    return f"the step's host input #{k} (taken before the call)"


def draw_labels(fetches: list | None) -> frozenset:
    """The labels of the drawn numbers: read live in tensor ops from their first capture."""
    return frozenset(input_label(k) for k, f in enumerate(fetches or ()) if f.fn)


def _set_host_states(states) -> None:
    """Back to ``rollback._host_rng()``'s snapshot (its setters are the unpatched ones)."""
    for set_state, state in states:
        set_state(state)


def take(fetches: list, args, kwargs: dict) -> dict:
    """The call's kwargs with its inputs, taken now in the step's order. Fewer than planned when
    an iterator ran out (``taken_all`` says so): that call runs eagerly, the step's own ``except
    StopIteration`` (minGPT's restart of its loader) handling it, the inputs taken handed back."""
    values, states, snaps, taken_cpu = [], [], [], []
    _TAKEN.unsafe = False
    if any(f.call is not None and f.call.fn in datacalls.UNSAFE for f in fetches):   # (dataorder.py)
        _TAKEN.unsafe, _TAKEN.last = (None, None), []
        return {**kwargs, FETCH_KW: []}
    for f in fetches:
        if f.source is not None:
            try:
                values.append(builtins.next(f.source.read(args)))
            except StopIteration:
                break
            continue
        states.append(_host_rng())   # (where eager would draw it, if the step does otherwise)
        if f.call is None:
            values.append(f.function()(*f.args, **f.kwargs))
            continue
        states[-1] += (dataorder.torch_cpu_rewinder(taken_cpu),)   # (its torch draws too: dataorder.py)
        bound = datacalls.bind(f.call.fn, args, kwargs)
        snaps.append((f.call, bound, dataorder.snapshot(f.call, bound)))
        value, touched = datacalls.run(f.call, bound)
        values.append(value)
        if touched and not _TAKEN.unsafe:
            _TAKEN.unsafe = (f, touched)
    _TAKEN.last = states   # (the call's: the trace hands back copies of ``values``, no identity)
    _TAKEN.snaps = [(before, dataorder.snapshot(site, bound)) for site, bound, before in snaps]
    taken_cpu.append(torch.get_rng_state() if snaps else None)
    if _TAKEN.unsafe and _TAKEN.unsafe[1] is not None:   # (not data: this call runs eagerly with it, and the step is refused from now on)
        f, touched = _TAKEN.unsafe
        datacalls.UNSAFE.add(f.call.fn)
        msg = (f"stepgraph: {f.describe()} ({f.where}) draws on the host and runs the model ({touched} "
               "on a parameter or a tensor that needs grad), so it cannot be taken before the step: "
               "this call ran with it taken first, and the step is refused from now on")
        warnings.warn(msg, stacklevel=3)
        logging.getLogger("stepgraph").warning(msg)
    return {**kwargs, FETCH_KW: values}


def taken_all(fetches: list, kwargs: dict) -> bool:
    return len(kwargs.get(FETCH_KW, ())) == len(fetches) and not getattr(_TAKEN, "unsafe", False)


def kept(fetches: list | None) -> list | None:
    """The plan after a take: dropped when a data call ran the model, or the step changed what
    one reads before calling it (refused from the next call on, datacalls.UNSAFE)."""
    return None if getattr(_TAKEN, "unsafe", False) else fetches



@contextlib.contextmanager
def handing_back(fetches: list, values: list, args, name: str, kwargs=None):
    """While the step runs: its ``next()`` on a planned iterator, its planned draws and its data
    calls return what was taken for them."""
    last = getattr(_TAKEN, "last", None)
    n_draws = sum(1 for f in fetches[:len(values)] if f.source is None)
    states = iter(last if last is not None and len(last) == n_draws else ())
    n_calls = sum(1 for f in fetches[:len(values)] if f.call is not None)
    snaps = getattr(_TAKEN, "snaps", None)
    snaps = iter(snaps if snaps is not None and len(snaps) == n_calls else ())
    queues: dict = {}
    draws: deque = deque()
    calls: list = []
    for f, v in zip(fetches, values):
        if f.source is not None:
            queues.setdefault(id(f.source.read_or(args)), (f, deque()))[1].append(v)
        elif f.call is not None:
            bound = datacalls.bind(f.call.fn, args, kwargs or {})
            calls.append((f.call, bound, f.call.values(bound), v, next(states, None), next(snaps, None)))
        else:
            draws.append((f, v, next(states, None)))
    saved = [(builtins, "next", builtins.next)]

    def handed(*a):
        q = queues.get(id(a[0])) if a else None
        if q is not None and q[1]:
            return q[1].popleft()
        return saved[0][2](*a)

    def drawing(fn, orig):
        def draw(*a, **k):
            if draws and draws[0][0].fn == fn and _plain(a) == draws[0][0].args \
                    and {x: _plain(y) for x, y in k.items()} == draws[0][0].kwargs:
                return draws.popleft()[1]
            rewind()   # (drawn otherwise than recorded, or not recorded: from where eager draws it)
            return orig(*a, **k)
        return draw

    def rewind():
        if draws and draws[0][2] is not None:
            _set_host_states(draws[0][2])
        draws.clear()

    def seeding(orig):
        def seed(*a, **k):
            draws.clear()   # (seeded in the step: what it draws next comes from the new state)
            return orig(*a, **k)
        return seed
    builtins.next = handed
    from .hostrandom import patch_draws   # (every draw function: one not planned rewinds too)
    saved += patch_draws(lambda label, attr, orig: drawing((label, attr), orig), lambda _l, _a, orig: seeding(orig)) \
        if draws else []
    n = len(draws)

    def called_otherwise(state):   # (a data call made otherwise than taken: from where eager draws)
        if state is not None:
            _set_host_states(state)
        draws.clear()
    try:
        with datacalls.handed_back(calls, called_otherwise):
            yield
    finally:
        for mod, attr, orig in reversed(saved):
            setattr(mod, attr, orig)
        _TAKEN.consumed = len(calls) + n - len(draws)   # (how many this path made: a replay makes as many)
        rewind()   # (draws the step did not make this call: not made)
    left = [(f, len(q)) for f, q in queues.values() if q]
    if left:
        msg = (f"stepgraph: {name} took {left[0][1]} batch(es) fewer than before from "
               f"{left[0][0].source.describe()} ({left[0][0].where}): stepgraph had taken them before "
               "the call, so they were skipped; take the batch in the loop and pass it as an argument")
        warnings.warn(msg, stacklevel=4)
        logging.getLogger("stepgraph").warning(msg)


def consumed() -> int | None:
    """How many of its taken draws the last call that handed them back made (the trace's path)."""
    return getattr(_TAKEN, "consumed", None)


def after_replay(used: int | None) -> None:
    """A replayed graph whose path made ``used`` of the call's taken draws (timm's mixup draws its
    weight only when its coin says mix): the others are given back, as eager never made them."""
    last = getattr(_TAKEN, "last", None)
    if used is not None and last is not None and used < len(last):
        _set_host_states(last[used])


def call(fn, fetches: list | None, args, kwargs: dict, name: str = "step"):
    """``fn(*args, **kwargs)`` with the call's inputs handed back to its ``next()`` and draws."""
    if FETCH_KW not in kwargs:
        return fn(*args, **kwargs)
    kw = dict(kwargs)
    values = kw.pop(FETCH_KW)
    with handing_back(fetches or [], values, args, name, kw):
        return fn(*args, **kw)


def calling(fn, fetches: list | None, name: str):
    """``fn`` taking the hidden keyword argument (what the trace calls)."""
    if not fetches:
        return fn

    def run(*args, **kwargs):
        return call(fn, fetches, args, kwargs, name)
    return run


@dataclass(frozen=True)
class _Held:
    """A source stand-in for an iterator a trace took batches from."""
    it: object

    def read(self, args=(), default=None):
        return self.it
    read_or = read

    def describe(self) -> str:
        return type(self.it).__name__


def given_back(seen: list, kwargs: dict) -> tuple[list | None, dict]:
    """A trace that took batches and was undone: the plan and kwargs with which the eager rerun
    of the call gets those batches again (the iterator cannot give them twice: a batch skipped).
    Its draws are not given back: the undo rewound ``random`` and numpy (rollback._host_rng)."""
    nexts = [s for s in seen if isinstance(s, SeenNext)]
    if not nexts or FETCH_KW in kwargs:
        return None, kwargs
    return [Fetch(s.where, source=_Held(s.iterator)) for s in nexts], {**kwargs, FETCH_KW: [s.batch for s in nexts]}


def describe(fetches: list | None) -> list[str]:
    """explain() lines."""
    if not fetches:
        return []
    names = ", ".join(dict.fromkeys(f"{f.describe()} at {f.where}" for f in fetches))
    return [f"taken before each call and fed in as inputs ({len(fetches)} per call): {names}"]
