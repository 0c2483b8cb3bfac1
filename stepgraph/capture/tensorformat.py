"""``Tensor.__format__`` of a one-element integer tensor in a traced step (modes.py): the text
goes to print or logging, or it is used (a key that picks a module)."""
from __future__ import annotations

import os
import sys

import torch

from .sinks import format_target, in_sink
from .tracked import _PROXIES, plain


def formatted_read(n, spec: str, printed: list) -> str:
    """``f"expert_{idx[0]}"``: an integer tensor formatted into text (``Tensor.__format__``), its
    value ``n`` read as a tracked number (hostreads.read_scalar). Text that goes to print or
    logging (:func:`format_target`, confirmed by the sink) is a print, as before: no guard, its
    line in ``printed`` (replays print nothing, warned). Text used anywhere else guards the
    value: SwitchTransformers' ``self[f"expert_{expert_idx[0]}"]`` picks a module by it, and a
    replay that routed elsewhere ran and updated the capture's experts (taken for a print)."""
    text = format(plain(n), spec)
    if type(n) not in _PROXIES or not n._log.active:
        return text
    f = sys._getframe(1)   # (the frame formatting: past torch's __format__ and this package)
    while f is not None and f.f_code.co_filename.startswith(_INTERNAL):
        f = f.f_back
    from ..errors import user_frame
    site = user_frame()
    if in_sink():
        printed.append(site)
        return text
    offset = None if f is None else format_target(f.f_code, f.f_lasti)
    if offset is None:
        n._log.used(n._e, n._v, site)
    else:   # (unconfirmed by the end of the trace, it is used: UseLog.checks)
        n._log.pending.append([f, offset, n._e, n._v, site, False])
        printed.append(site)
    return text


_INTERNAL = (os.path.dirname(torch.__file__) + os.sep,
             os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def percent_format() -> bool:
    """Is the innermost user frame at a ``%`` operation (``str % tensor`` converts the tensor
    with ``float()`` from C; ``number % tensor`` is a tensor op, never ``float()``)?"""
    from ..errors import user_code_frame
    f = user_code_frame(sys._getframe(2))
    if f is None or f.f_lasti < 0:
        return False
    import dis
    at = next((i for i in dis.get_instructions(f.f_code) if i.offset == f.f_lasti), None)
    return at is not None and (at.opname == "BINARY_MODULO" or (at.opname == "BINARY_OP" and at.argrepr == "%"))
