"""Models and optimizers a step finds (arguments, globals, closures) are held weakly
(capture/state.py): when their user drops one, the step frees its graphs, which held its tensors;
at a miss, state its code reaches anew (a rebound global) is registered."""
from __future__ import annotations

from .capture.pyvalues import PyValues


class Busy:
    """Counts the calls running (``with self._lock, self._busy``: no extra frame for warnings)."""
    n = 0

    def __enter__(self):
        self.n += 1

    def __exit__(self, *exc):
        self.n -= 1


class DroppedState:
    """StepFunction's part: what a dropped model's weak reference callback does."""

    def _state_dropped(self) -> None:
        """A model or optimizer passed as an argument was freed by its user (a weak reference's
        callback): free the graphs now unless a call is running (then at the next call)."""
        self._dropped = True
        if self._lock.acquire(blocking=False):
            try:
                if not self._busy.n:
                    self._forget_dropped()
            finally:
                self._lock.release()

    def _found_more(self, args, sig) -> bool:
        """At a signature miss: did the step's code reach new state (a global ``model`` rebound,
        k-fold) or a hook registered since the scan? Then its values are scanned again."""
        from .capture.state import adopt_code
        if adopt_code(self._reg, self.fn) or self._reg.hook_key() != self._guards.scanned_hooks:
            self._guards.find_python_values(self.fn, args)
            return True
        # (an object the step reads rebound since the last graph -- YOLOv5's ``ema = ModelEMA(...)``
        # made anew: its method's ``self.updates`` was a source of the old object only, and the new
        # one's counter was baked. Found again, keeping what was found: older keys still match)
        last = self._order[-1].key.py_values if self._order else ()
        if not any(_rebound(a, b) for a, b in zip(last, sig.key.py_values)):
            return False
        n = len(self._guards.py.sources)
        self._guards.find_python_values(self.fn, args, keep=True)
        return len(self._guards.py.sources) != n

    def _forget_dropped(self) -> None:
        # Every graph goes: they hold the dropped state's tensors, and the guards' layout
        # (train/eval flags, hyper-parameters of all state seen) changes without it.
        self._dropped = False
        _warn_if_dropped_each_call(self)
        self._reg.prune()
        self._entries.clear()
        self._order.clear()
        self._last = self._last_quick = None
        self._warm_done = 0   # the next model warms up (an optimizer makes its state) as the first did
        self._guards.live.clear()
        self._guards.keyed.clear()
        self._guards.preds.clear()
        from .livefloats import LiveFloats
        self._live = LiveFloats(self._guards, self._reg, self.__name__)   # (its baked values were the dropped state's)
        self._guards.py = PyValues()   # sources found through the dropped state: read again
        self._rescan = True


def _warn_if_dropped_each_call(step) -> None:
    """A model, optimizer or module with tensors given anew at each call (``step(x, y,
    nn.CrossEntropyLoss(weight=w))``) frees the last one's graphs at each call: every call warms
    up again and nothing replays. Said once, after three such calls in a row."""
    import warnings
    streak = getattr(step, "_drop_streak", (0, -1))
    n = streak[0] + 1 if step.stats.replays == streak[1] else 1
    step._drop_streak = (n, step.stats.replays)
    if n == 3:
        warnings.warn(f"stepgraph: {step.__name__}: a model, optimizer or module holding tensors that the step "
                      "reaches was freed after each of the last 3 calls (a new one each call?), so each call "
                      "warms up again and nothing replays; keep one object and change its tensors in place "
                      "(criterion.weight.copy_(w)), or pass the tensors as arguments", stacklevel=4)


def _rebound(a, b) -> bool:
    """Two keys of one source: an object keyed by identity, another object now; or a dict keyed
    by its keys that holds another key now (its lists are sources of their own: varitems.py)."""
    return isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] and a[:1] in (("object",), ("keys of",)) \
        and a[1:] != b[1:]
