"""The replay side of ``StepFunction``'s call policy (a mixin of it): replay the graph found
for a call's key or one of its siblings, fall back on a host-read guard miss (the graph undid
its writes), give up on a value that keeps changing past ``max_captures``, remember the quick
key for the next call, drop a stale graph with its siblings, and run a call eagerly (the inputs
taken before it handed back)."""
from __future__ import annotations

import re

import logging
import warnings

from .captured import Branch
from .check import checked_call
from .errors import GuardMiss
from .capture import fetches
from .capture.hints import COUNTER_HINT, DATA_SIZED, INT_COUNT, ITEM_FIX, LOOP_COUNTER, converted_number
from .pipeline import capture

log = logging.getLogger("stepgraph")


NO_QUICK_REPLAY = object()   # (no quick replay: the full lookup follows)


class ReplayPaths:
    _quick_missed: tuple | None = None   # (graph, GuardMiss): this call's quick replay missed
    def _eager(self, args, kwargs, fetched=None):
        """The step run eagerly, the inputs taken before the call handed back (fetches.py)."""
        self.stats.eager_calls += 1
        return fetches.call(self.fn, fetched or self._fetch, args, kwargs, self.__name__)

    def _quick_replay(self, args, kwargs):
        """The graph the last call replayed, when this call's quick key equals that call's and its
        checks hold; else ``NO_QUICK_REPLAY``. A guard miss here is undone, kept in ``_quick_missed``: the
        full lookup does not try that graph again on this call."""
        last, self._quick_missed = self._last, None
        if last is None:
            return NO_QUICK_REPLAY
        try:
            hit = self._guards.quick_key(args, kwargs) == self._last_quick
        except Exception:  # a tensor compared by value: not the same object
            hit = False
        if not (hit and last.stale() is None and last.checks_hold(list(args), args)):
            return NO_QUICK_REPLAY
        out, miss = self._try_replay(last, lambda: last.replay_args(args, kwargs), args, kwargs)
        if miss is None:
            return out
        self._quick_missed = (last, miss)
        return NO_QUICK_REPLAY

    def _replay_entry(self, entry, sig, args, kwargs, older=None):
        """Replay the graph for this key whose host reads hold (one per distinct value seen).
        ``older``: the graphs under this call's live key (LiveFloats.read_live_key), captured
        before a value they read live was baked, tried after ``entry``'s. A graph captured now
        bakes that value: it is filed under this call's own key, never among the older ones."""
        chains = [c for c in (entry, older) if c is not None and not c.gave_up]
        if not chains:
            self.stats.took(Branch.EAGER)
            return self._eager(args, kwargs)
        skipped, miss = self._quick_missed or (None, None)   # (tried on the quick path: not again)
        # (the reason shown is the newest graph's miss: the oldest's, e.g. the first branch
        # taken, said nothing about why the latest one missed too)
        newest = chains[0].siblings[0] if chains[0].siblings else chains[0]
        # (the graph the last call of this chain replayed first: after a flag flipped for good,
        # QAT's disable_observer, every call tried the stale graph and missed its guard first)
        tries = [g for head in chains for g in _last_good_first(head) if g is not skipped]
        for e in tries:
            if not e.checks_hold(sig.leaves, args):   # a Python number it used differs (tracked.py)
                m = e.check_miss(sig.leaves, args)
                miss = m if e is newest or miss is None else miss
                self._moving_numbers |= e.moved_numbers(sig.leaves, args)
                continue
            out, m = self._try_replay(e, lambda: e.replay(sig.leaves, sig.tensor_pos, args), args, kwargs)
            if m is None:
                self._remember(e, args, kwargs)
                for head in chains:
                    if e is head or any(e is g for g in head.siblings):
                        head.last_good = e
                return out
            miss = m if e is newest or miss is None else miss
        if len(self._order) >= self.max_captures:
            chains[0].gave_up = True
            hint = converted_number(str(miss)) or (
                "Return the value from the step and decide outside it, or raise max_captures "
                "if it takes few values")
            if "depends on tensor values" in str(miss):
                # (ELECTRA's ``logits[attention_mask == 1]``, the CTC loss's masked_select: a
                # size per batch, in code the user may not own)
                hint = DATA_SIZED[0].upper() + DATA_SIZED[1:]
            elif re.search(INT_COUNT + r".*\): int\(\) of a", str(miss)):   # (``total += int(t)``: a count)
                hint = "int(t) hands Python a plain copy: " + ITEM_FIX
            elif LOOP_COUNTER.search(str(miss)):
                hint = COUNTER_HINT[0].upper() + COUNTER_HINT[1:]
            elif "int() of a" in str(miss) or "item() of a" in str(miss):
                # (MoCo's ``ptr = int(self.queue_ptr)``, then ``queue[:, ptr:ptr + n] = keys.T``)
                hint = ("If it only positions a write or a read (a ring buffer's pointer), keep it "
                        "a tensor: idx = (ptr_tensor + torch.arange(n)) % size; "
                        "queue.index_copy_(dim, idx, keys); ptr_tensor.add_(n).remainder_(size). "
                        "Otherwise return the value from the step and decide outside it, or raise "
                        "max_captures if it takes few values")
            msg = (f"stepgraph: {self.__name__}: a value the graphs depend on keeps changing ({miss}); "
                   f"max_captures={self.max_captures} graphs are kept, so calls with it run eagerly "
                   f"from now on. {hint}")
            warnings.warn(msg, stacklevel=3)
            log.warning(msg)
            self.stats.took(Branch.EAGER)
            return self._eager(args, kwargs)
        self.stats.took(Branch.CAPTURE)
        return capture(self, sig, args, kwargs, reason=str(miss), sibling_of=entry)

    def _try_replay(self, entry, replay, args, kwargs):
        """``(output, None)``, or ``(None, GuardMiss)`` when a host read differed from the
        capture's (the graph undid its writes; not counted as a replay). Check mode applies."""
        self.stats.replays += 1
        try:
            if len(self.stats.check_reports) < self.check:
                out = checked_call(self, entry, replay, args, kwargs, self.check_rtol)
            else:
                out = replay()
                entry.number_effects(args, kwargs)
            fetches.after_replay(entry.draws_used)   # (draws taken first that its path does not make)
            self.stats.took(Branch.REPLAY)
            return out, None
        except GuardMiss as miss:
            self.stats.replays -= 1
            self.stats.guard_misses[miss.site] = self.stats.guard_misses.get(miss.site, 0) + 1
            return None, miss

    def _drop(self, entry) -> None:
        for key in [k for k, e in self._entries.items() if e is entry]:
            del self._entries[key]
        for e in [entry] + entry.siblings:
            self._order.remove(e)
        self._last = self._last_quick = None

    def _remember(self, entry, args, kwargs):
        # The quick key is taken from the state *after* this call, which is the next call's
        # state only if nothing changes in between: trust it only when that post-call state
        # still has this entry's full signature (a graph that rebinds .grad does not), and
        # only for flat calls, whose leaves are the args themselves.
        key = self._guards.signature(args, kwargs).key if entry.flat_args and not kwargs else None
        if key is not None and (key == entry.key or self._entries.get(key) is entry
                                or self._entries.get(self._live.read_live_key(key)) is entry):
            self._last, self._last_quick = entry, self._guards.quick_key(args, kwargs)
        else:
            self._last = self._last_quick = None


def _last_good_first(head) -> list:
    order = [head] + head.siblings
    best = head.last_good
    if best is None or best is head or not any(best is g for g in head.siblings):
        return order
    return [best] + [g for g in order if g is not best]
