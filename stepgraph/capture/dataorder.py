"""Data calls found by what they read, and the two orders that taking them first must keep.

nanoGPT's step ends each micro-step with ``X, Y = get_batch('train')``: ``torch.randint`` picks
offsets, Python slices the token array (``np.memmap``) at them. llm.c's ``train_loader.next_batch()``
slices ``self.tokens`` at ``self.current_position`` and advances it. Neither draws with ``random``
or numpy, so hostrandom.py never saw a data call there; the step was refused at the numpy read
(schedules.py: a graph would keep the array's values). Such a read made by a function the step's
own code calls (``draw_frames``' ``own`` frame, its comprehensions included) with a repeatable
call site is recorded as a data call instead (``note_read``), its refusal kept as a problem that
stands unless the plan takes the call.

Taken before the step, the call moves two things ahead of the step's code that came before it in
eager, so two checks:
- random draws (``note_draw``, from the trace's dispatch mode): a call that draws on a device's
  default generator is not planned when the step drew on that generator before it (``moved_before``).
  On a GPU nanoGPT's dropout draws on CUDA and ``get_batch`` on the CPU: planned. On the CPU, with
  dropout, the forward's masks come first in eager: refused (``torch.randint`` in the loop, passed
  in, is the fix);
- the receiver (``snapshot`` / ``changed``): a step that changes the loader before calling it
  (``train_loader.reset()`` then ``next_batch()``, llm.c's ``--overfit_single_batch``) would get a
  batch read before its change. At hand-back (datacalls.handed_back) the receiver's attributes, or
  the globals the function reads, are compared with what they were right after the take; changed,
  the taken effects the step did not overwrite are put back (``merge``), the original call runs,
  and the step is refused from the next call on (datacalls.UNSAFE).
"""
from __future__ import annotations

import sys
import threading

import torch

from . import datacalls
from .datacalls import _HERE

_LOG = threading.local()   # while traced: draws [(outer frame, device)], seen list, problems


class watching:
    """hostrandom.host_random_watch's lists, for reads found outside it (schedules.py)."""

    def __init__(self, seen, problems):
        self.lists = (seen, problems)

    def __enter__(self):
        self.prev = getattr(_LOG, "lists", None), getattr(_LOG, "draws", None)
        _LOG.lists, _LOG.draws = self.lists, []
        return self

    def __exit__(self, *exc):
        seen, problems = self.lists
        if seen is not None:
            from dataclasses import replace
            from .effects import Problem
            from .fetches import SeenCall
            calls = [s.frame for s in seen if isinstance(s, SeenCall) and s.frame is not None]
            for k, s in enumerate(seen):
                if isinstance(s, SeenCall) and s.frame is not None and moved_before(_LOG.draws, s.frame, calls):
                    seen[k] = replace(s, cpu_moved=True)
                    problems.insert(0, Problem(
                        f"the step calls {s.site.describe()}, which reads its data on the host and draws "
                        "from a random generator the step drew from before the call (a CPU dropout, a torch.rand): "
                        "made before the step, its draws would come first, unlike eager's", s.where,
                        f"call {s.site.describe()} in the loop and pass its result to the step as "
                        "arguments", plain=True))
                    break
        _LOG.lists, _LOG.draws = self.prev


def note_draw(func, args, kwargs) -> None:
    """A seeded op ran in the trace: which call of the step's (if any) made it, on which device."""
    draws = getattr(_LOG, "draws", None)
    if draws is None or kwargs.get("generator") is not None:
        return   # (a generator of the user's own: not the default one a data call's draw moves)
    dev = kwargs.get("device")
    if dev is None:
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None) or torch.get_default_device()
    draws.append((call_key(datacalls.draw_frames()[0]), torch.device(dev).type))


def call_key(frame):
    """One call of the step's, without holding its frame (a finished frame keeps its locals: a
    helper's logits until the trace ends): the frame's id, code and the step's call instruction."""
    if frame is None:
        return None
    return id(frame), frame.f_code, frame.f_back.f_lasti if frame.f_back is not None else -1


def moved_before(draws: list, call, calls: list) -> bool:
    """The step (not a data call) drew on a generator the data ``call`` draws on, before it."""
    own = {d for c, d in draws if c == call}
    for c, d in draws:
        if c == call:
            return False   # (from here on: the call's own draws, then what came after it)
        if d in own and c not in calls:
            return True
    return False


class taking_next:
    """While ``next(iterator)`` runs in the step (hostrandom._next_watch): what the iterator reads
    is its batch's, taken before the step once planned (fetches.py). A generator reading a numpy
    array was refused from inside its own frame, which closed it: the eager rerun of the call then
    met StopIteration, a new epoch eager never started."""

    def __enter__(self):
        _LOG.in_next = getattr(_LOG, "in_next", 0) + 1

    def __exit__(self, *exc):
        _LOG.in_next -= 1


def note_read(problem) -> bool:
    """A read a graph cannot keep (``problem``) made by a data call of the step's, or by an
    iterator the step takes its batch from: recorded as a problem that stands unless the plan
    takes the call (or the ``next()``). False: neither."""
    lists = getattr(_LOG, "lists", None)
    if lists is None or lists[0] is None:
        return False
    if getattr(_LOG, "in_next", 0):
        lists[1].append(problem)
        return True
    from .fetches import SeenCall
    outer, own = datacalls.draw_frames()
    if outer is not None and datacalls.recorded(outer):
        return True
    site = datacalls.site_of(own) if own is not None else None
    if site is None:
        return False
    seen, problems = lists
    seen.append(SeenCall(site, site.where, False, call_key(own)))
    problems.append(problem)
    return True


def torch_cpu_rewinder(taken: list):
    """(setter, state) for ``fetches._set_host_states``: torch's CPU generator back to where a data
    call drew from it when it was taken -- if nothing drew since the take (``taken[0]``: its state
    after every call was taken), else left alone (the step's own draws came after). A call made
    again where the step makes it (its receiver or arguments changed) then draws as eager does."""
    def rewind(state):
        if taken and taken[0] is not None and torch.equal(torch.get_rng_state(), taken[0]):
            torch.set_rng_state(state)
    return rewind, torch.get_rng_state()


def _targets(site, bound) -> list:
    """(namespace dict, names) the call reads that the step could change before it."""
    if site.method:
        d = getattr(site.target.read(site.fn, bound), "__dict__", None)
        return [(d, None)] if isinstance(d, dict) else []
    f = datacalls.unwrapped(site.callable(bound))
    if getattr(f, "__self__", None) is not None:   # (a partial of a bound method: its receiver)
        d = getattr(f.__self__, "__dict__", None)
        return [(d, None)] if isinstance(d, dict) else []
    f = datacalls._function(f)
    g = getattr(f, "__globals__", None)
    return [(g, f.__code__.co_names)] if isinstance(g, dict) else []


def snapshot(site, bound) -> list:
    """What ``_targets`` hold now: [(dict, {name: value})]."""
    out = []
    for d, names in _targets(site, bound):
        keys = list(d) if names is None else [n for n in names if n in d]
        out.append((d, {k: d[k] for k in keys}, names))
    return out


def _same(a, b) -> bool:
    if datacalls._same((a,), (b,)):
        return True
    np = sys.modules.get("numpy")   # (the same memory: a global array and the view a trace hands the step, schedules.py)
    return np is not None and isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and \
        a.__array_interface__ == b.__array_interface__


def changed(snap: list, patched=None) -> str | None:
    """The first name whose value is not what ``snap`` holds (but ``patched``, the hand-back's
    own stand-in for the method), or None."""
    for d, vals, names in snap:
        keys = (set(vals) | (set(d) if names is None else {n for n in names if n in d})) - {patched}
        for k in sorted(keys, key=str):
            if k in d and _ours(d[k]):
                continue   # (stepgraph's own stand-in for a method, pycalls.py, datacalls.handed_back)
            if k not in vals or k not in d or not _same(d[k], vals[k]):
                return str(k)
    return None


def _ours(v) -> bool:
    code = getattr(v, "__code__", None)
    return code is not None and code.co_filename.startswith(_HERE)


def merge(before: list, after: list) -> None:
    """Put back what the take changed (``before`` -> ``after``) where the step has not written
    since (its own writes stay): the state eager had before the call, as far as it is known."""
    for (d, old, _), (_, new, _) in zip(before, after):
        for k in set(old) | set(new):
            if k in new and k in d and not _same(d[k], new[k]):
                continue   # (the step wrote it)
            if k in old:
                d[k] = old[k]
            elif k in d:
                del d[k]
