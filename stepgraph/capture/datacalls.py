"""Host data calls: a function of the user's that the step calls to draw its batch on the host,
taken before the step at each call (fetches.py) and fed in as inputs.

minimalRL's DQN calls ``s, a, r, s_prime, done = memory.sample(batch_size)`` in its train step
ten times (``random.sample`` over a deque of transitions, the batch built with ``torch.tensor``);
GraphSAGE samples neighbours with ``random.sample``; NeRF's ``sample_rays(i)`` draws an image and
rays with ``np.random.choice``. A replay runs no Python, so such a step was refused (hostrandom.py)
although the call is host work the step's graph does not depend on otherwise.

When a host random draw the plan cannot take by itself happens in a function the step's own code
calls (the function that draws, called by the step itself: not one it reaches through another
function of the user's, such as DDPG's ``train()``, which samples and trains), the capture records
the call *site* from the step's bytecode (``CallSite``): the callable (a method of an object the
step reaches through a parameter, a global or a closure variable; or a global or closure
function) and each argument as a load the runtime can repeat -- a constant, a global, a closure
variable or a parameter of the step (read from the call's own arguments). Anything else (an
expression, a keyword argument, a value the step computed) is not a site: refused as before. From
the next call on, the runtime makes the call (``run``) before the step, in the step's
order with its other taken inputs, and the step's call returns that result (``handed_back``: the
method or function is patched for the step's run; other receivers and other arguments call the
original).

What makes that eager's result, and what is checked:
- the arguments are read when the call is taken, as the step would read them;
- the draw order of ``random``/numpy is the step's (every host input is taken in its order);
- torch's CPU generator: a call is planned only when nothing drew from it in the step before the
  call's first host draw (``cpu_moved``: not the step before it, not an earlier data call), so the
  call's own torch draws come first in eager's order too;
- the call must not apply a torch function to a parameter or a tensor that needs grad, nor return
  one (``_ModelWatch``: a call that runs the model or steps an optimizer is no data call): checked
  at each take; such a plan is dropped with a warning, that call running with the result taken,
  and the step is refused from then on;
- a step that changes the receiver's containers in code it calls (``memory.put(t)`` before the
  sample) is refused, and never planned (outputs.refuse_hidden_changes).
A call that reads its data from a numpy array instead of drawing (nanoGPT's ``get_batch``, llm.c's
``next_batch``) is found by that read (dataorder.py), which also checks the order of torch draws and
that the step leaves the call's receiver alone before the call.
Not covered: a call reading other tensor state (a module buffer, optimizer state) that the step
updates before the call would read it before the update.
"""
from __future__ import annotations

import builtins
import dis
import functools
import inspect
import sys
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

_HERE = __file__.rsplit("/capture/", 1)[0]   # stepgraph's own code
_STATE = threading.local()   # the step being traced: (fn, args, kwargs), frames recorded
UNSAFE: "weakref.WeakSet" = weakref.WeakSet()   # steps whose data call touched the model


@dataclass(frozen=True)
class Load:
    """How the step's code loads one value at the call site, repeatable before the step."""
    kind: str              # "const" | "global" | "free" | "param"
    name: str
    value: object = None   # the constant

    def read(self, fn, bound: dict):
        if self.kind == "const":
            return self.value
        if self.kind == "global":
            g = _function(fn).__globals__
            return g[self.name] if self.name in g else getattr(builtins, self.name)
        if self.kind == "free":
            f = _function(fn)
            return f.__closure__[f.__code__.co_freevars.index(self.name)].cell_contents
        return bound[self.name]

    def describe(self) -> str:
        return repr(self.value) if self.kind == "const" else self.name


@dataclass(frozen=True, eq=False)
class CallSite:
    """``target.method(*args)`` or ``target(*args)`` at one call instruction of the step."""
    fn: object             # the step function (its globals, closure and parameters)
    target: Load
    method: str | None
    args: tuple
    where: str

    def callable(self, bound: dict):
        t = self.target.read(self.fn, bound)
        return getattr(t, self.method) if self.method else t

    def values(self, bound: dict) -> list:
        return [a.read(self.fn, bound) for a in self.args]

    def describe(self) -> str:
        head = f"{self.target.name}.{self.method}" if self.method else self.target.name
        return f"{head}({', '.join(a.describe() for a in self.args)})"


def _function(fn):
    return getattr(fn, "__func__", fn)


def unwrapped(fn):
    """What a ``functools.partial`` (``partial(loader.next_batch, 2)``) calls."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def bind(fn, args, kwargs) -> dict:
    """The step's parameters by name for this call (``self`` of a bound method included)."""
    from .fetches import FETCH_KW
    f = _function(fn)
    kwargs = {k: v for k, v in kwargs.items() if k != FETCH_KW}   # (a planned call's taken inputs)
    out = dict(inspect.signature(fn).bind_partial(*args, **kwargs).arguments)
    if f is not fn and f.__code__.co_varnames:
        out[f.__code__.co_varnames[0]] = fn.__self__
    return out


def _params(code) -> tuple:
    return code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]


def _load(ins, code) -> Load | None:
    if ins.opname == "LOAD_CONST":
        return Load("const", repr(ins.argval), ins.argval)
    if ins.opname == "LOAD_GLOBAL" and not (ins.arg & 1):
        return Load("global", ins.argval)
    if ins.opname == "LOAD_DEREF" and ins.argval in code.co_freevars:
        return Load("free", ins.argval)
    if ins.opname in ("LOAD_FAST", "LOAD_FAST_CHECK") and ins.argval in _params(code):
        return Load("param", ins.argval)
    return None


def call_site(fn, code, lasti: int, where: str) -> CallSite | None:
    """The call at ``lasti`` of the step's ``code`` when its callable and arguments are simple
    loads (Python 3.11's and 3.12's bytecode); None otherwise."""
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
    # (f_lasti may point into the CALL's inline cache entries: the last instruction at or before it)
    at = max((k for k, i in enumerate(ins) if i.offset <= lasti), default=None)
    if at is None or ins[at].opname != "CALL":
        return None
    j = at - 1
    if ins[j].opname == "PRECALL":
        j -= 1
    args = []
    for _ in range(ins[at].arg):
        a = _load(ins[j], code)
        if a is None:
            return None
        args.append(a)
        j -= 1
    args.reverse()
    head = ins[j]
    if head.opname == "LOAD_METHOD" or (head.opname == "LOAD_ATTR" and sys.version_info >= (3, 12) and head.arg & 1):
        target = _load(ins[j - 1], code)
        return None if target is None or target.kind == "const" else CallSite(fn, target, head.argval, tuple(args), where)
    if head.opname == "LOAD_GLOBAL" and head.arg & 1:
        return CallSite(fn, Load("global", head.argval), None, tuple(args), where)
    if head.opname == "LOAD_DEREF" and head.argval in code.co_freevars and ins[j - 1].opname == "PUSH_NULL":
        return CallSite(fn, Load("free", head.argval), None, tuple(args), where)
    return None


class tracing:
    """While the step is traced: which function it is and this call's arguments."""

    def __init__(self, fn, args, kwargs):
        self.state = (fn, args, kwargs)

    def __enter__(self):
        self.prev = getattr(_STATE, "step", None)
        _STATE.step, _STATE.frames = self.state, []   # (frames held: a freed one's id is reused)
        return self

    def __exit__(self, *exc):
        _STATE.step, _STATE.frames = self.prev, []


def draw_frames():
    """At a host draw: ``(outer, own)``. ``outer``: the frame of the user function the step's own
    code called that the draw runs in, at any depth below it (a helper the sampler calls), or
    None. ``own``: that same frame when it made the draw itself (``memory.sample(n)`` drawing
    ``random.sample``), the only kind of data call, else None -- minimalRL DDPG's step calls
    ``train(...)``, which calls ``memory.sample``; ``train`` runs the model and steps the
    optimizers, so only the function that draws, called by the step itself, is a data call."""
    step = getattr(_STATE, "step", None)
    if step is None:
        return None, None
    code = _function(step[0]).__code__
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_HERE):
        f = f.f_back   # (stepgraph's own frames: the draw's wrapper)
    drew = f
    while drew is not None and drew.f_code.co_name in _NESTED and drew.f_back is not None:
        drew = drew.f_back   # (a comprehension's frame, Python 3.11's: its function's work)
    inner = None
    while f is not None and f.f_back is not None and f.f_back.f_code is not code:
        f, inner = f.f_back, f
    if f is None or f.f_back is None or f.f_code is code:
        return None, None
    if f.f_code.co_filename.startswith(_HERE) and inner is not None:
        f = inner   # (called through handed_back's stand-in: the user's function it called)
    from .pyvalues import _user_code
    return f, (f if f is drew and _user_code(f.f_code) else None)


def in_data_call() -> bool:
    """Whether the caller runs inside a data call already recorded (NeRF's ``sample_rays(i)`` reads
    ``images[img_i]`` after drawing ``img_i``): what it reads is taken with the call. If no plan
    takes the call after all, the draw that made it one is refused, so nothing is kept."""
    frames = getattr(_STATE, "frames", None)
    if not frames:
        return False
    f = sys._getframe(1)
    while f is not None:
        if any(x is f for x in frames):
            return True
        f = f.f_back
    return False


def recorded(frame) -> bool:
    """This call is a data call already recorded (its later draws are its own)."""
    return any(x is frame for x in _STATE.frames)


def site_of(frame) -> CallSite | None:
    """The repeatable call site of the data call running in ``frame`` (then recorded), or None."""
    fn, args, kwargs = _STATE.step
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename.startswith(_HERE):
        caller = caller.f_back   # (handed_back's stand-in between the step and the call)
    site = call_site(fn, caller.f_code, caller.f_lasti, f"{caller.f_code.co_filename}:{caller.f_lineno}")
    if site is None:
        return None
    try:
        bound = bind(fn, args, kwargs)
        for a in site.args + (site.target,):   # a parameter the step rebound before the call: not repeatable
            if a.kind == "param" and not _same((caller.f_locals.get(a.name),), (bound.get(a.name),)):
                return None
        target = site.callable(bound)
        receiver = site.target.read(fn, bound) if site.method else None
    except Exception:  # noqa: BLE001 - not repeatable as read
        return None
    if getattr(_function(unwrapped(getattr(target, "sg_original", target))), "__code__", None) is not frame.f_code \
            or (site.method and not isinstance(getattr(receiver, "__dict__", None), dict)):
        return None   # (a receiver without an instance dict: its method cannot be handed back)
    _STATE.frames.append(frame)   # (held: a freed frame's id is reused)
    return site


def _model_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and (isinstance(t, torch.nn.Parameter) or t.requires_grad
                                            or t.grad_fn is not None)


class _ModelWatch(TorchFunctionMode):
    """Names the first torch function a data call applies to a parameter or a tensor that needs
    grad: it runs the model (or steps an optimizer) and is no data call."""

    def __init__(self):
        super().__init__()
        self.touched = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.touched is None and any(_model_tensor(t) for t in pytree.tree_leaves((args, kwargs))):
            self.touched = getattr(func, "__name__", str(func))
        return func(*args, **kwargs)


def run(site: CallSite, bound: dict):
    """The data call made now, before the step: (its result, None) or (its result, why it is no
    data call: it touched the model)."""
    with _ModelWatch() as watch:
        out = site.callable(bound)(*site.values(bound))
    if watch.touched is None and any(_model_tensor(t) for t in pytree.tree_leaves(out)):
        watch.touched = "its result"
    return out, watch.touched


class handed_back:
    """While the step runs: its call at each planned site returns the result taken before it
    (in order); another receiver, other arguments, or a call past those taken run the original."""

    def __init__(self, taken: list, on_mismatch):
        self.taken, self.on_mismatch = taken, on_mismatch   # [(site, bound, args, value, host rng state, snapshots)]
        self.saved: list = []

    def __enter__(self):
        queues: dict = {}
        for site, bound, args, value, state, snaps in self.taken:
            key = (id(site.fn), site.target, site.method)   # (one patch per callable: its calls in order)
            queues.setdefault(key, (site, bound, []))[2].append((args, value, state, snaps))
        for site, bound, queue in queues.values():
            self._patch(site, bound, queue)
        return self

    def _patch(self, site, bound, queue):
        target = site.target.read(site.fn, bound)
        orig = site.callable(bound)

        def handed(*a, **k):
            if queue and queue[0][3] is not None and _taken_otherwise(site, queue[0][3]):
                self.on_mismatch(queue[0][2])   # (its draws: from where eager makes them)
                queue.clear()   # (taken first, it read the receiver before the step's change)
                return orig(*a, **k)
            if queue and not k and _same(a, queue[0][0]):
                return queue.pop(0)[1]
            if queue:   # (other arguments: a global ``it`` the step advanced before get_batch(it))
                self.on_mismatch(queue[0][2])
                _taken_otherwise(site, queue[0][3], f"the arguments of {site.describe()}")
                queue.clear()
            return orig(*a, **k)
        handed.sg_original = orig   # (site_of: a call of it made through this stand-in)
        if site.method:
            d = getattr(target, "__dict__", None)
            if d is None:
                return   # (no instance dict: the original runs, and draws: refused as before)
            self.saved.append(("attr", d, site.method, d.get(site.method, _MISSING)))
            d[site.method] = handed
        elif site.target.kind == "global":
            g = _function(site.fn).__globals__
            self.saved.append(("attr", g, site.target.name, g.get(site.target.name, _MISSING)))
            g[site.target.name] = handed
        else:
            f = _function(site.fn)
            cell = f.__closure__[f.__code__.co_freevars.index(site.target.name)]
            self.saved.append(("cell", cell, None, cell.cell_contents))
            cell.cell_contents = handed

    def __exit__(self, *exc):
        for kind, where, name, old in reversed(self.saved):
            if kind == "cell":
                where.cell_contents = old
            elif old is _MISSING:
                where.pop(name, None)
            else:
                where[name] = old
        self.saved.clear()


def _taken_otherwise(site, snaps, what: str | None = None) -> bool:
    """The step changed what the call reads (its receiver, the globals it reads: dataorder.py;
    ``what``: its arguments) after it was taken: the take's own changes the step left alone
    are put back, and the step is refused from the next call on (a replay would take it so)."""
    import logging
    import warnings
    from .dataorder import changed, merge
    if what is None:
        name = changed(snaps[1], site.method or site.target.name) if snaps is not None else None
        if name is None:
            return False
        what = f"{site.target.name}.{name}" if site.method else f"the global {name}"
    if snaps is not None:
        merge(*snaps)
    UNSAFE.add(site.fn)
    msg = (f"stepgraph: the step changes {what} before calling {site.describe()} ({site.where}), so that "
           "call cannot be taken before the step: this call ran it where the step calls it, and the step "
           "is refused from the next call on (call it in the loop and pass its result as an argument)")
    warnings.warn(msg, stacklevel=3)
    logging.getLogger("stepgraph").warning(msg)
    return True


_MISSING = object()
_NESTED = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _same(a, b) -> bool:
    from .tracked import plain
    if len(a) != len(b):
        return False
    return all(x is y or (type(plain(x)) in (int, float, str, bool) and plain(x) == plain(y)) for x, y in zip(a, b))

