"""What a failed capture leaves: always what the eager call would; then an error or eager calls.

* A failure during the trace (the tracer, a torch internal, stepgraph, a refusal that cannot
  wait for the end of the step) is undone (capture/rollback.py) and the call runs eagerly from
  its start; an exception of the user's own code (or Ctrl-C) reaches the caller unchanged,
  with what ran before it, exactly as in eager.
* A refusal (``StepGraphError``) is raised once the call has run to its end, or, with
  ``on_capture_error="eager"``, the call returns its eager result with one warning and the step
  runs eagerly from then on.
* Any other failure is stepgraph's (a graph pass, a backend compile): never the user's crash.
  The call returns its eager result, one warning says what failed, and the step runs eagerly.
"""
from __future__ import annotations

import logging
import warnings

from .captured import plain_floats
from .errors import RunsEagerly, StepGraphError

log = logging.getLogger("stepgraph")


def after_failed_trace(e: BaseException, rollback, eager):
    """The trace stopped with ``e``: ``(eager's result,)`` after undoing it, or None when it
    must propagate (the user's own exception, or nothing could be undone: noted on ``e``)."""
    from .capture.rollback import raised_by_user
    if raised_by_user(e):
        return None
    if not rollback.undo():
        _note(e, f"stepgraph could not undo the partial capture ({rollback.lost}): the model and "
                 "optimizer may hold part of this step")
        return None
    out = (eager(),)   # from where the call began; eager's own exceptions reach the caller
    _note(e, "this call then ran eagerly from its start (the partial trace was undone): your model "
             "and optimizer hold the result of this step")
    return out


def capture_failed(step, e: BaseException, done):
    """Handle ``e`` from a capture whose call ran to its end when ``done`` is ``(result,)``:
    return that result (the step runs eagerly from now on) or raise ``e``."""
    refusal = isinstance(e, StepGraphError)
    internal = done is not None and isinstance(e, Exception) and not refusal
    known = isinstance(e, RunsEagerly)
    if internal or known or (refusal and step.on_capture_error == "eager"):
        step._eager_only = True
        if done is not None:
            first = (str(e).splitlines() or [""])[0][:300]
            if known:
                msg = f"stepgraph: {step.__name__} runs eagerly from now on: {first}"
            elif internal and _known(e) is not None:
                msg = f"stepgraph: {step.__name__} runs eagerly from now on: {_known(e)}"
            elif internal:
                msg = (f"stepgraph: {step.__name__} could not be captured: {type(e).__name__} while capturing it "
                       f"({first}). This call's result is eager's and the step runs eagerly from now on; "
                       "please report this (traceback in the 'stepgraph' logger)")
            else:
                msg = (f"stepgraph: {step.__name__} could not be captured; it runs eagerly from now on "
                       f"(on_capture_error='eager'): {first}")
            warnings.warn(msg, stacklevel=4)
            log.warning(msg, exc_info=e if internal else None)
            return plain_floats(done[0])
        log.warning("stepgraph: capture of %s failed; running eagerly from now on", step.__name__, exc_info=e)
    raise e


# Tracer failures whose cause is a line of the user's that the user can change: (text in the
# error, what it is, the fix). (Reptile's ``copy.deepcopy(model.state_dict())`` in the step; an
# op given a ``torch.Generator``, which make_fx of torch 2.11 cannot trace: DP-SGD's noise.)
_KNOWN = (("UntypedStorage", "copy.deepcopy of tensors (a state_dict) inside the step cannot be traced",
           "copy them with {k: v.detach().clone() for k, v in sd.items()}, or deepcopy outside the step"),
          ("'TrackedInt'", "a legacy constructor (Tacotron 2's torch.LongTensor(max_len)) given a number read "
           "from a tensor cannot be traced", "make it with torch.empty(n, dtype=torch.long) (or torch.arange(n), "
           "torch.zeros), which take such numbers"),
          ("torch._C.Generator", "an op given a torch.Generator inside the step cannot be traced by this "
           "torch version", "draw from the default generator (seed it outside the step), or draw outside "
           "the step and pass the result"))


def _known(e: BaseException) -> str | None:
    import traceback
    from .errors import user_frame
    text = str(e)
    for needle, what, fix in _KNOWN:
        if needle in text:
            return f"{what} (at {user_frame(traceback.extract_tb(e.__traceback__))}); {fix}"
    return None


def _note(e: BaseException, text: str) -> None:
    if hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(text)
