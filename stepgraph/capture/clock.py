"""The clock the step reads (``time.time()`` & co. called by its own code), as a tracked number.

pytorch/examples imagenet times each batch inside the loop body: ``data_time.update(time.time()
- end)`` at its top, ``end = time.time()`` at its end. A replay runs no Python, so both kept the
capture's values (durations went stale, then negative). While the step is traced (sinks.py
installs these), a clock the step's code calls returns a tracked number rooted at the clock
(``numchecks.Root("clock")``): what the step computes from it and stores (``end``, a meter's
attributes) is evaluated again after each replay with the clock read then, as eager's Python
would; a decision on it is checked before the replay. A use that needs its value in the graph
(``int(time.time())``, a CUDA graph's scalar) keeps this capture's value and is named at
capture (uselog.used, outputs.read_side_effects). Library code's clocks (a log record's time)
and another thread's are not the step's values.
"""
from __future__ import annotations

import sys
import threading

CLOCKS = ("time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "monotonic_ns")


def clock(orig, log, name: str):
    """``orig`` (``time.<name>``) for the trace whose tracked numbers ``log`` keeps."""
    from ..errors import library_file
    from .numchecks import Root
    thread = threading.get_ident()   # (the tracing thread: a logger's or a loader's clock is its own)

    def read():
        value = orig()
        if log.active and threading.get_ident() == thread and not library_file(sys._getframe(1).f_code.co_filename):
            root = Root("clock", orig, f"time.{name}()")
            if not _ops_recorded():
                log.start_clocks.append(root)
            return log.wrap(value, root)
        return value
    read.__wrapped__ = orig
    return read


def _ops_recorded() -> bool:
    """Has the trace recorded a tensor op yet? A clock read before any (``t0 = time.time()`` at
    the step's top) is read before each replay runs, not with the ones after it: both read
    after the replay made ``time.time() - t0`` ~0 or negative, silently."""
    import torch
    from .hostscalar import _tracer
    tracer = _tracer()   # (readers of Python values and hyper-parameters come first: not the step's work)
    return tracer is None or any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                                 for n in tracer.graph.nodes)
