"""Objects the step hands to its own helper functions, seen while the warm-up call runs.

``def compute_loss(cfg, out, y): ... cfg.aux_weight ...`` called from the step as
``compute_loss(cfg, model(x), y)``, ``cfg`` a global: pyvalues scans ``compute_loss`` but cannot
tell what its parameter ``cfg`` holds, so ``cfg.aux_weight`` was read by no guard. The loop
changed it between calls and replays kept the captured value, silently (helper-90, session 36).
The warm-up call runs under a profile hook that records, for each user function the step calls
(two levels down at most), the configuration objects bound to its parameters; the step's values
are then found again with those bound (``find_sources(helpers=...)``). An object made anew in the
step at each call, or one of the step's own arguments, is not recorded (no root to read it from
at the next call: the argument's own guard covers it).
"""
from __future__ import annotations

import argparse
import contextlib
import dis
import sys
import types

import torch

from ..errors import user_class
from .chains import _chains, _user_code, unwrapped_function

_SCALARS = (int, float, bool, str, type(None))


@contextlib.contextmanager
def recording(fn, args, out: list):
    """Around the warm-up call: ``out`` gets ``(function, {parameter: object})`` per helper."""
    step_code = getattr(unwrapped_function(fn), "__code__", None)
    if step_code is None or sys.getprofile() is not None:   # (the user's profiler, cProfile: left alone)
        yield out
        return
    seen = {id(f.__code__) for f, _ in out}

    def hook(frame, event, arg):
        if event == "call" and id(frame.f_code) not in seen and frame.f_code is not step_code:
            try:
                note(frame)
            except Exception:  # noqa: BLE001 - a scan that fails records nothing; the call goes on
                pass

    def note(frame):
        code, back = frame.f_code, frame.f_back
        if back is None or not (back.f_code is step_code or back.f_back is not None and back.f_back.f_code is step_code):
            return
        seen.add(id(code))
        if not _user_code(code) or code.co_freevars:
            return
        method = _method_of(frame, code)
        if method is not None:   # (``getattr(pool, name)(x)``: a method no chain names, scanned bound)
            out.append((method, None))
            return
        names = [n for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount] if n in _read_only(code)]
        binds = {n: v for n in names if _bindable(v := frame.f_locals.get(n)) and not any(v is a for a in args)}
        if binds:
            out.append((types.FunctionType(code, frame.f_globals), binds))
    sys.setprofile(hook)
    try:
        yield out
    finally:
        sys.setprofile(None)


_READ_ONLY: dict = {}   # id(code) -> its parameters the code only reads settings of


def _read_only(code) -> frozenset:
    """Parameters whose attributes and items the function only reads: not ``self`` (a method's
    object is scanned as such), not one it calls methods on or stores into (a meter it updates:
    its numbers are the step's own changes, tracked by path, trackplan.py)."""
    got = _READ_ONLY.get(id(code))
    if got is None:
        params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        bad = {"self", "cls"} | {name for _, name, path, _ in _chains(code) if any(k in ("method", "call") for k, _ in path)}
        ins = [x for x in dis.get_instructions(code) if x.opname not in ("CACHE", "NOP", "EXTENDED_ARG")]
        for i, x in enumerate(ins):
            if x.opname in ("LOAD_FAST", "LOAD_FAST_CHECK") and any(
                    y.opname in ("STORE_ATTR", "STORE_SUBSCR", "DELETE_ATTR", "DELETE_SUBSCR") for y in ins[i + 1:i + 7]):
                bad.add(x.argval)
        _READ_ONLY[id(code)] = got = frozenset(params) - bad
    return got


def _method_of(frame, code):
    """The bound method this frame runs when it is a user class's (not a module's or optimizer's,
    which are scanned as such): CycleGAN's ``getattr(pool, "query")(fake)``, whose writes to
    ``self`` no replay made, silently (helper-94)."""
    if not code.co_argcount or code.co_varnames[0] != "self" or code.co_name in frame.f_back.f_code.co_names \
            or code.co_name.startswith("__"):
        return None   # (one the caller's code names, ``meters['loss'].update(v)``: its chain's, by path;
    #                    ``__init__`` of an object made in the step, a defaultdict's new meter)
    obj = frame.f_locals.get("self")
    f = getattr(type(obj), code.co_name, None)
    if getattr(unwrapped_function(f), "__code__", None) is not code or not _bindable(obj):
        return None
    return types.MethodType(f, obj)


def _bindable(v) -> bool:
    """A configuration object: a namespace, a dict of settings, an instance of a user class."""
    if isinstance(v, (argparse.Namespace, types.SimpleNamespace)):
        return True
    if type(v) is dict:
        return 0 < len(v) <= 64 and all(isinstance(x, _SCALARS) for x in v.values())
    return user_class(type(v)) and hasattr(v, "__dict__") and not isinstance(
        v, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, type, BaseException))
