"""Batches the step takes with ``next(iterator)``: taken before the call, fed in as arguments.

NVlabs EDM's loop takes its batches inside the step (``images, labels = next(dataset_iterator)``,
once per accumulation round), as do trainers built on ``cycle(DataLoader)``. A replay runs no
Python, so the iterator would not advance and every replay would train on the capture's batch
(refused, hostrandom.py). Instead, the capture that meets such a ``next()`` records how the
step reaches each iterator (a global, a closure cell, an attribute: a pyvalues ``Source``) and
how many batches a call takes, and counts as a warm-up; from the next call on, those batches
are taken *before* the step runs, in the step's order, and handed to it as a hidden keyword
argument. Their tensors are then inputs like an argument's (a partial last batch is a new
signature, with its own graph), and the step's ``next()`` returns them (``handing_back``) in an
eager call, in the trace and in check mode alike. The iterator is read through its source at
each call: a new iterator per epoch is no new graph.

Not planned (the refusal stands): an iterator no source reaches (made inside the step); a
``next()`` that draws from a global random generator (an augmentation in ``__getitem__``) after
the step drew from one, or any but the first: taken first, the draws would come in another
order than eager's.
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import warnings
from collections import deque
from dataclasses import dataclass

FETCH_KW = "_stepgraph_batches"   # the hidden keyword argument that carries the call's batches


@dataclass(frozen=True)
class Fetch:
    """One ``next()`` of the step, in call order: the iterator's source and the user's line."""
    source: object   # pyvalues.Source
    where: str


@dataclass(frozen=True)
class SeenNext:
    """A ``next()`` the trace saw return data (hostrandom._next_watch)."""
    iterator: object
    where: str
    after_draws: bool   # a global random generator moved in the step before this next()
    draws: bool         # taking the batch moved one (a RandomSampler's seed, an augmentation)
    batch: object = None   # a copy of what it returned: the eager rerun after an undone trace gets it


def plan(seen: list, sources: list, args) -> list | None:
    """Fetches for the ``next()`` calls a trace saw, or None when one cannot be taken before
    the step (no source reaches its iterator, or a random draw would change order)."""
    # Taken first, a batch's draws move before the step's own: the same order as eager's only for
    # the first next() with no draw before it (a new DataLoader iterator's RandomSampler seed).
    if not seen or any(s.draws and (k or s.after_draws) for k, s in enumerate(seen)):
        return None
    out = []
    for s in seen:
        src = next((x for x in sources if not x.path and x.read_or(args) is s.iterator), None) \
            or next((x for x in sources if x.read_or(args) is s.iterator), None)
        if src is None:
            return None
        out.append(Fetch(src, s.where))
    for f in out:
        f.source.fetched = True   # (keyed by the iterator's type: a new one per epoch is no new graph)
    return out


@dataclass(frozen=True)
class _Held:
    """A source stand-in for an iterator a trace took batches from."""
    it: object

    def read(self, args=()):
        return self.it

    def read_or(self, args=(), default=None):
        return self.it

    def describe(self) -> str:
        return type(self.it).__name__


def given_back(seen: list, kwargs: dict) -> tuple[list | None, dict]:
    """A trace that took batches and was undone: the plan and kwargs with which the eager rerun
    of the call gets those batches again (the iterator cannot give them twice: a batch skipped)."""
    if not seen or FETCH_KW in kwargs:
        return None, kwargs
    return [Fetch(_Held(s.iterator), s.where) for s in seen], {**kwargs, FETCH_KW: [s.batch for s in seen]}


def take(fetches: list, args, kwargs: dict) -> dict:
    """The call's kwargs with its batches, taken now from each iterator in the step's order."""
    return {**kwargs, FETCH_KW: [builtins.next(f.source.read(args)) for f in fetches]}


@contextlib.contextmanager
def handing_back(fetches: list, batches: list, args, name: str):
    """While the step runs: its ``next()`` on a planned iterator returns the batch taken for it."""
    queues: dict = {}
    for f, b in zip(fetches, batches):
        queues.setdefault(id(f.source.read_or(args)), (f, deque()))[1].append(b)
    orig = builtins.next

    def handed(*a):
        q = queues.get(id(a[0])) if a else None
        if q is not None and q[1]:
            return q[1].popleft()
        return orig(*a)
    builtins.next = handed
    try:
        yield
    finally:
        builtins.next = orig
    left = [(f, len(q)) for f, q in queues.values() if q]
    if left:
        msg = (f"stepgraph: {name} took {left[0][1]} batch(es) fewer than before from "
               f"{left[0][0].source.describe()} ({left[0][0].where}): stepgraph had taken them before "
               "the call, so they were skipped; take the batch in the loop and pass it as an argument")
        warnings.warn(msg, stacklevel=4)
        logging.getLogger("stepgraph").warning(msg)


def call(fn, fetches: list | None, args, kwargs: dict, name: str = "step"):
    """``fn(*args, **kwargs)`` with the call's batches handed back to its ``next()``."""
    if FETCH_KW not in kwargs:
        return fn(*args, **kwargs)
    kw = dict(kwargs)
    batches = kw.pop(FETCH_KW)
    with handing_back(fetches or [], batches, args, name):
        return fn(*args, **kw)


def calling(fn, fetches: list | None, name: str):
    """``fn`` taking the hidden keyword argument (what the trace calls)."""
    if not fetches:
        return fn

    def run(*args, **kwargs):
        return call(fn, fetches, args, kwargs, name)
    return run


def describe(fetches: list | None) -> list[str]:
    """explain() lines."""
    if not fetches:
        return []
    names = ", ".join(dict.fromkeys(f"next({f.source.describe()}) at {f.where}" for f in fetches))
    return [f"batches taken before each call and fed in as inputs ({len(fetches)} per call): {names}"]
