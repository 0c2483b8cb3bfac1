"""Put back what a capture changed when the trace stops midway, so the call can run eagerly.

The trace runs the step on the user's real tensors. When tracing fails partway through for a
reason of its own (the tracer, a torch internal, stepgraph, a refusal that cannot wait for the
end of the step), parameters, grads, optimizer state, BatchNorm buffers and the random
generators hold part of a step that eager would never leave. A ``Rollback`` taken before the
trace undoes that, and the call then runs eagerly:

* storages that existed before the trace are copied just before their first in-place write
  (``CopyOnWrite``, a dispatch mode inside the trace): only what the step writes, once each;
  copies of CUDA storages go to host memory, so the capture's GPU peak stays eager's;
* ``.grad``/buffer/optimizer-state bindings, the optimizers' ``state`` dicts and
  ``param_groups``, the inputs' ``.grad``, LR schedulers stepped inside the step;
* the CPU (and CUDA) random generators' states.

Other Python objects the step changed (a list it appends to, a counter) are not undone: that
part of the step runs again in the eager call. An exception raised by the user's own code is
not a failed capture: eager raises it at the same point, so it reaches the caller unchanged
(one raised inside torch or another library may be the trace's doing: undone, and the eager
run decides -- if eager raises too, the caller gets eager's exception).
"""
from __future__ import annotations

import collections

import contextlib
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..errors import _SKIP_PREFIXES, StepGraphError
from ..passes.analysis import UNANNOTATED_WRITES, written_args


_OURS = ("'TrackedInt'", "'TrackedFloat'", "'HostFloat'", "'ReadFloat'", "'HyperFloat'")   # (tracked.py, hostscalar.py)


def raised_by_user(e: BaseException) -> bool:
    """The user's own exception (raised in their code, or Ctrl-C): not a failed capture."""
    if not isinstance(e, Exception):
        return True   # KeyboardInterrupt, SystemExit: wherever they land, eager gets them too
    if isinstance(e, StepGraphError) or any(t in str(e) for t in _OURS):
        return False   # (``torch.LongTensor(n)`` given a tracked number: "not a storage 'TrackedInt'")
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    name = last.tb_frame.f_code.co_filename
    # Raised inside torch, stepgraph (the tracer's modes, FX's generated "<eval...>" code) or
    # another library: eager may or may not fail there too; the eager run after the undo decides.
    # (A compiled extension's frame names its source, ``mtrand.pyx``: numpy's, not the user's.)
    return not (name.startswith("<") or name.endswith((".pyx", ".pxd", ".pxi"))
                or os.path.abspath(name).startswith(_SKIP_PREFIXES))


def _fake(t: torch.Tensor) -> bool:
    """No real data: a FakeTensor (a fake mode inside the step) or a meta tensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor) or t.is_meta


def _inner(t: torch.Tensor) -> list | None:
    """A wrapper subclass's tensors (a DTensor's local shard), which hold its data; else None."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if not is_traceable_wrapper_subclass(t):
        return None
    parts = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    return [x for p in parts if isinstance(p, torch.Tensor) for x in _inner(p) or [p]]


def _host_rng() -> tuple:
    """(setter, state) of Python's ``random`` and, if loaded, numpy's global generator."""
    import random
    out = [(random.setstate, random.getstate())]
    np = sys.modules.get("numpy")
    if np is not None:
        out.append((np.random.set_state, np.random.get_state()))
    return tuple(out)


@dataclass
class Rollback:
    optimizers: list
    slots: list                     # (Slot, value before)
    opt_state: list                 # (optimizer, param, its state dict, a shallow copy)
    groups: list                    # (param group dict, a shallow copy)
    input_grads: list               # (input tensor, its .grad before)
    rng: torch.Tensor
    cuda_rng: list | None
    host_rng: tuple = ()            # Python's and numpy's global random states (a draw before a refusal)
    copies: dict = field(default_factory=dict)    # storage data_ptr -> (bytes view, saved bytes)
    created: set = field(default_factory=set)     # data_ptrs of storages the trace allocated
    objects: dict = field(default_factory=dict)   # id -> (object, copy of its __dict__)
    containers: dict = field(default_factory=dict)   # id -> (a dict/list passed in, its contents)
    lost: str | None = None         # why some write could not be copied (nothing is undone then)
    taken: list = field(default_factory=list)     # fetches.SeenNext: batches the trace took with next()

    @classmethod
    def take(cls, reg, leaves) -> "Rollback":
        opt_state = [(opt, p, st, dict(st)) for _, opt in reg.optimizers for p, st in opt.state.items()
                     if isinstance(st, dict)]   # (MADGRAD's ``state['k']``: a slot, below)
        groups = [(g, dict(g)) for _, opt in reg.optimizers for g in opt.param_groups]
        inputs = [(t, t.grad) for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls([opt for _, opt in reg.optimizers], [(s, s.get()) for s in reg.slots()], opt_state, groups,
                   inputs, torch.get_rng_state(), cuda, _host_rng())

    def keep_object(self, obj) -> None:
        """A Python object the step is about to change (an LR scheduler): its attributes now."""
        self.objects.setdefault(id(obj), (obj, dict(obj.__dict__)))

    def keep_container(self, c, contents) -> None:
        """A dict or list passed to the step, about to be changed (capture/argchanges.py)."""
        self.containers.setdefault(id(c), (c, contents))

    def keep_sources(self, py, args) -> None:
        """The lists, dicts, sets and deques the step's code reads, as they are before the trace:
        a trace undone midway is rerun eagerly from the start, and a container the step had
        cleared by then (REINFORCE's ``del policy.rewards[:]`` at its end) left the rerun
        nothing to train on (``torch.cat`` of an empty list)."""
        for s in py.sources:
            c = s.read_or(args)
            if type(c) in (list, dict, set, collections.deque, collections.OrderedDict) and len(c) <= _MAX_KEPT:
                self.keep_container(c, c.copy())

    def save(self, t: torch.Tensor) -> None:
        """Before ``t`` is written in place: copy its storage once, if it existed before the trace."""
        if self.lost is not None or _fake(t):
            return
        inner = _inner(t)
        if inner is not None:  # (its own storage is a placeholder)
            for x in inner:
                self.save(x)
            return
        try:
            st = t.untyped_storage()
            # An empty storage (FSDP2's freed unsharded parameter) is keyed by its StorageImpl:
            # undo gives it back its size 0.
            key = st.data_ptr() if st.nbytes() else ("empty", st._cdata)
            if key in self.created or key in self.copies:
                return
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                whole = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)  # every byte, all views
                self.copies[key] = (whole, whole.to("cpu", copy=True))
        except Exception as e:  # noqa: BLE001 - an OOM, a tensor without storage: then undo nothing
            self.lost = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.copies.clear()

    def undo(self) -> bool:
        """Put everything back; False (and nothing undone) when a write could not be copied."""
        if self.lost is not None:
            return False
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            for whole, saved in self.copies.values():
                st = whole.untyped_storage()
                if st.nbytes() != saved.numel():  # resized since (FSDP2 frees/allocates storages)
                    st.resize_(saved.numel())
                whole.copy_(saved)
        for s, v in self.slots:
            s.set(v)
        had = {(id(opt), id(p)) for opt, p, _, _ in self.opt_state}
        for opt in self.optimizers:   # state the trace created (a first step) goes again
            for p in [p for p in opt.state if (id(opt), id(p)) not in had]:
                del opt.state[p]
        for opt, p, st, copy in self.opt_state:
            st.clear()
            st.update(copy)
            opt.state[p] = st
        for group, copy in self.groups:
            group.clear()
            group.update(copy)
        for t, g in self.input_grads:
            t.grad = g
        for obj, attrs in self.objects.values():
            obj.__dict__.clear()
            obj.__dict__.update(attrs)
        for c, contents in self.containers.values():
            if isinstance(c, list):
                c[:] = contents
            elif isinstance(c, collections.deque):
                c.clear()
                c.extend(contents)
            else:
                c.clear()
                c.update(contents)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        # (nerf-pytorch's ``np.random.choice`` ran before the refused read: the eager rerun
        # drew again, trained on another image and left numpy's stream one draw ahead)
        for set_state, state in self.host_rng:
            set_state(state)
        return True


_MAX_KEPT = 1 << 20   # (items: a shallow copy of a replay buffer that size is a few MB)
_TRACING: list = []   # the Rollback of the trace running now


@contextlib.contextmanager
def saving_writes(rollback: Rollback | None):
    """While the trace runs: what stepgraph itself writes into the user's tensors outside
    CopyOnWrite's view is saved first too (``before_write``)."""
    _TRACING.append(rollback)
    try:
        yield
    finally:
        _TRACING.pop()


def before_write(t: torch.Tensor) -> None:
    """stepgraph is about to write ``t`` in place while tracing (a rebound buffer bound back
    to its old tensor: attrstores.py, rebound.py). DINO's center took two updates without it when
    the call was undone after its trace and ran again eagerly."""
    if _TRACING and _TRACING[-1] is not None:
        _TRACING[-1].save(t)


class CopyOnWrite(TorchDispatchMode):
    """In the trace: save each pre-existing storage before an op first writes it."""

    def __init__(self, rollback: Rollback):
        super().__init__()
        self.rb = rollback

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable or func in UNANNOTATED_WRITES:
            for v in written_args(func, args, kwargs):
                if isinstance(v, torch.Tensor):
                    self.rb.save(v)
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) and len(func._schema.returns) > 1 else (out,)
        for ret, o in zip(func._schema.returns, outs):
            if ret.alias_info is None:   # a new allocation, not a view of or write into an input
                for t in pytree.tree_leaves(o):
                    for x in (_inner(t) or [t]) if isinstance(t, torch.Tensor) else ():
                        if x.layout == torch.strided and not _fake(x):
                            self.rb.created.add(x.untyped_storage().data_ptr())
        return out

def snapshot(srcs, args=()):
    """What these variables and their tensors hold now, to put back: after a check-mode replay
    (the eager shadow then runs the step's Python on them), or after a failed trace (the call
    then runs eagerly from its start). ``args``: the call's, for attributes of its arguments."""
    saved = [(s, v, v.detach().clone() if isinstance(v, torch.Tensor) else None)
             for s in srcs for v in [s.read_or(args)]]

    def restore():
        for s, v, data in saved:
            if data is not None:
                with torch.no_grad():
                    v.copy_(data)
            if not _in_tuple(s, args):   # (an element of a tuple: the tuple's own source puts it back)
                s.write(v, args)
    return restore


def _in_tuple(s, args=()) -> bool:
    from .trackplan import _parent
    try:
        return bool(s.path) and s.path[-1][0] == "item" and type(_parent(s, args)) is tuple
    except Exception:  # noqa: BLE001 - not readable now: nothing to write either
        return True

