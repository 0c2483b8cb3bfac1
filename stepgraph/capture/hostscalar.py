"""Host scalars: optimizer step counters read with ``.item()`` stay live in the graph.

PyTorch's default CPU optimizers (Adam, AdamW, Adagrad, ...) call ``step_t.item()`` and do
their bias-correction arithmetic in Python floats. A plain trace would bake step 2's floats
into every replay. Instead, ``.item()`` on a known step counter returns a ``HostFloat``: a
``float`` whose arithmetic also records ``operator`` nodes in the graph, so each replay
recomputes the same Python floats from the live counter — bit-identical to eager and with no
extra tensor kernels (which the optimizers' ``capturable`` path would add).
"""
from __future__ import annotations

import math
import operator

import torch


MADE: list | None = None   # the HostFloats of the capture running (floatleaks.plain_after)


class HostFloat(float):
    """A float that remembers the fx node computing it during a trace."""

    __slots__ = ("node", "numbers", "counter")

    def __new__(cls, value, node):
        self = float.__new__(cls, float.__float__(value) if isinstance(value, float) else value)
        self.node = node
        if MADE is not None:
            MADE.append(self)   # (floatleaks.py: none stays in the user's objects after the capture)
        self.numbers = ()   # tracked numbers read live into this value (used if it is baked)
        self.counter = False   # computed from an optimizer step counter (a decision on it is guarded)
        node.meta["host_value"] = float.__float__(self)  # what the trace saw (baking uses it)
        return self

    def __reduce__(self):  # never pickled as a HostFloat
        return (float, (_plain(self),))

    derive_rank = 0  # in ``a + b``, the operand of higher rank decides what the result tracks
    # A tracked Python number (tracked.py) combined with this float is used only if the node
    # survives -- trusted for values read from tensors (ReadFloat) only: a live float that C
    # code reads directly (``math.cos(math.pi * epoch)``) leaves its node dead but its value
    # baked, so there the number is used as is.
    number_use_by_node = False

    def _derive(self, value, node):
        """The result of arithmetic on this float (subclasses keep what they track)."""
        return HostFloat(value, node)

    def __format__(self, fmt):
        # A live value formatted (``print(f"lr={g['lr']:.5f}")``): noted like a read value's, so a
        # call redone after each replay rebuilds the text (pycalls.py); it printed the capture's lr
        # at every replay, silently (probe /work/repros/s26/print_lr.py).
        text = float.__format__(_plain(self), fmt)
        tracer = _tracer()
        log = getattr(tracer, "sg_reads", None)
        if log is not None and current(self, tracer):
            from .formats import note
            note(log, self.node, text, fmt)
        return text


def _tracked(x) -> bool:
    """A number tracked while tracing (tracked.py); asked of the type, never of the proxy."""
    return getattr(type(x), "_sg_tracked", False)


def _plain(x):
    """The value as a plain float; never ``float(x)``, which a subclass may track. A tracked
    number handed out plain is used by value."""
    if _tracked(x):
        x._use()
        return _plain(x._v)
    return float.__float__(x) if isinstance(x, float) else float(x)


def _tracer():
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    mode = get_proxy_mode()
    return None if mode is None else mode.tracer


def current(x, tracer) -> bool:
    """A HostFloat of the graph being traced now (not one a past trace left in user state)."""
    return issubclass(type(x), HostFloat) and tracer is not None and x.node.graph is tracer.graph


def node_arg(x, tracer):
    """What a recorded operation takes for ``x``: its node when it belongs to this trace, else
    its value (a plain float for a HostFloat an older trace left behind)."""
    if current(x, tracer):
        return x.node
    if _tracked(x):
        return x._v   # a constant of the node: its use is decided by the node (see _binary)
    return _plain(x) if isinstance(x, HostFloat) else x


def live_op(op, args, live, value, tracer):
    """``op(*args)`` with ``live`` among them (floats of this trace): its graph node and the live
    float it gives, ``value``. Shared by arithmetic (``_binary``), math's functions and
    ``min``/``max`` (hostreads.py). ``meter.sum + loss.item()``: a tracked number is read at each
    replay where it can be (lifted), else baked and used only if the node survives. A number whose
    value check missed before (``lr = get_lr(it)`` meeting a live weight decay) is read live too:
    the result carries it, so it is used by value wherever that result is baked."""
    from .numchecks import roots_of, slot_rooted
    by_node = all(x.number_use_by_node for x in live)
    # (a count read from a tensor, ``meter['correct'] += t.sum().item()`` with the meter a float: read at
    # each replay too, carried, used by value only where the result is baked: it was a graph per count)
    lifted = [x._log.lift(x, typed=False) if _tracked(x) and x._log.active and (
              by_node or x._log.moving(x) or all(r.kind == "read" for r in roots_of(x._e))) else None for x in args]
    node = tracer.create_node("call_function", op, tuple(
        n if n is not None else node_arg(x, tracer) for x, n in zip(args, lifted)), {})
    for x, n in zip(args, lifted):
        if _tracked(x) and n is None:
            x._log.node_use(x, [node]) if by_node else x._use()
    out = max(live, key=lambda x: x.derive_rank)._derive(value, node)
    out.numbers = _carried(*args) + tuple(x for x, n in zip(args, lifted) if n is not None and not by_node)
    # (RAdam's beta2 ** step: a hyper and a counter; so is a Python number of an optimizer's
    # state read live into it, timm LaProp's ``state['exp_avg_lr_1'] * beta1 + (1 - beta1) * lr``,
    # pytorch_optimizer's ``math.pow(beta, step)``: a comparison on it is a decision guarded at
    # each replay, not its value)
    out.counter = any(x.counter for x in live) or any(n is not None and slot_rooted(x) for x, n in zip(args, lifted))
    return out


def _binary(op, swap=False):
    def method(self, other):
        if not _tracked(other) and (not isinstance(other, (int, float)) or isinstance(other, bool)):
            if type(other).__module__ == "numpy" and getattr(other, "shape", None) == () \
                    and current(self, _tracer()):
                # ``gamma * lmbda * advantage + delta_t[0]`` (a numpy.float32: minimalRL's GAE):
                # numpy's own arithmetic, on this float's value guarded as float() guards it
                plain = float(self)
                use_carried(self)
                return op(other, plain) if swap else op(plain, other)
            return NotImplemented
        a, b = (other, self) if swap else (self, other)
        tracer = _tracer()
        live = [x for x in (a, b) if current(x, tracer)]
        if not live:  # used after the trace (plain float semantics) or left by an older one
            return op(_plain(a), _plain(b))
        value = op(*(_plain(x._v) if _tracked(x) else _plain(x) for x in (a, b)))
        return live_op(op, (a, b), live, value, tracer)
    return method


def _carried(*xs) -> tuple:
    # (``issubclass(type(x))``: ``isinstance`` would ask a tracked number its ``__class__``, a check)
    return tuple(p for x in xs if issubclass(type(x), HostFloat) for p in x.numbers)


def use_carried(x) -> None:
    """``x`` is baked where it was used: the tracked numbers read live into it are used by value."""
    for p in x.numbers if issubclass(type(x), HostFloat) else ():
        if p._log.active:
            p._use(force=True)


def _unary(op):
    def method(self):
        value = op(_plain(self))
        tracer = _tracer()
        if not current(self, tracer):
            return value
        out = self._derive(value, tracer.create_node("call_function", op, (self.node,), {}))
        out.numbers, out.counter = self.numbers, self.counter
        return out
    return method


for _name, _op in [("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("pow", operator.pow),
                   ("floordiv", operator.floordiv), ("mod", operator.mod)]:
    setattr(HostFloat, f"__{_name}__", _binary(_op))
    setattr(HostFloat, f"__r{_name}__", _binary(_op, swap=True))
HostFloat.__neg__ = _unary(operator.neg)
HostFloat.__pos__ = _unary(operator.pos)
HostFloat.__abs__ = _unary(operator.abs)


class _DataDependentBranch(Exception):
    pass


_DECISIONS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
              "eq": operator.eq, "ne": operator.ne, "bool": operator.truth}


def guard_decision(x, name, a):
    """``if rho_t > 5`` on a step counter's float (RAdam, ASGD on the CPU): the outcome, guarded
    at each replay (``host_guard``: a flip undoes the replay and captures the other branch once);
    raises _DataDependentBranch where no guard can be placed."""
    tracer = _tracer()
    log = getattr(tracer, "sg_reads", None)
    if name not in _DECISIONS or log is None or len(a) > 1 or any(
            _tracked(y) or (isinstance(y, HostFloat) and not current(y, tracer)) or not isinstance(y, (int, float))
            for y in a):
        raise _DataDependentBranch(name)
    result = _DECISIONS[name](_plain(x), *(_plain(y) if isinstance(y, float) else y for y in a))
    node = tracer.create_node("call_function", _DECISIONS[name], (x.node, *(node_arg(y, tracer) for y in a)), {})
    from ..errors import user_frame
    log.guard(node, result, f"a decision on an optimizer step counter ({name})", user_frame())
    return result


def _refuse(name):
    plain = getattr(float, f"__{name}__")

    def method(self, *a):
        if not current(self, _tracer()):  # after its trace it is a plain float
            return plain(_plain(self), *(_plain(x) if _tracked(x) else x for x in a))
        return guard_decision(self, name, a)
    return method


# Branching on a step counter (``if step > warmup``) would bake one side of the branch; so
# would ``float(step_size)``, a plain copy the trace cannot follow.
for _name in ("lt", "le", "gt", "ge", "eq", "ne", "bool", "int", "float", "round", "floor", "ceil", "trunc"):
    setattr(HostFloat, f"__{_name}__", _refuse(_name))
HostFloat.__hash__ = float.__hash__


def record_item(tracer, t: torch.Tensor):
    """Record ``aten._local_scalar_dense(t)`` in the graph: ``(t.item(), node)``, the value
    exactly as eager reads it (an int stays an int)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot, has_proxy_slot
    from torch.utils._python_dispatch import _disable_current_modes
    if has_proxy_slot(t, tracer):
        src = get_proxy_slot(t, tracer).proxy.node
    else:
        src = tracer.create_arg(t)
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        value = t.item()
    return value, tracer.create_node("call_function", torch.ops.aten._local_scalar_dense.default, (src,), {})


def item_node(tracer, t: torch.Tensor):
    """An optimizer step counter's ``.item()`` as a HostFloat recomputed at each replay."""
    out = HostFloat(*record_item(tracer, t))
    out.counter = True
    return out


def substitute(nodes, floats, call_args) -> set:
    """In ``nodes``' arguments, put each HostFloat's node where its value was passed.

    The dispatcher hands ops plain floats, so values are matched by their bits; a float list
    is matched position by position against a list of the Python call (several step counters
    usually hold the same value). Returns the ids of the HostFloats found.
    """
    by_bits: dict = {}
    for f in floats:
        by_bits.setdefault(_plain(f).hex(), []).append(f)
    seqs = [a for a in call_args if isinstance(a, (list, tuple)) and any(isinstance(x, HostFloat) for x in a)]
    used = set()

    def one(a, hint=None):
        if isinstance(a, float) and not math.isnan(a):
            if isinstance(hint, HostFloat) and _plain(hint).hex() == a.hex():
                used.add(id(hint))
                return hint.node
            group = by_bits.get(a.hex())
            if group:
                used.update(id(f) for f in group)
                return group[0].node
        return a

    def fix(a):
        if isinstance(a, (list, tuple)):
            for seq in seqs:
                if len(seq) == len(a) and all(not isinstance(x, float) or
                                              (isinstance(y, (int, float)) and _plain(y).hex() == x.hex())
                                              for x, y in zip(a, seq)):
                    return type(a)(one(x, y) for x, y in zip(a, seq))
            return type(a)(fix(x) for x in a)
        return one(a)

    for n in nodes:
        n.args = tuple(fix(a) for a in n.args)
        n.kwargs = {k: fix(v) for k, v in n.kwargs.items()}
    del fix   # (recursive: its cell held it in a cycle, and by_bits' read floats with it until
    # the next gc, read as "stored in Python objects" by hostreads.stored_reads: NAdam's warning)
    return used


# ---- live optimizer hyper-parameters (which ones: optimizers.LIVE_HYPERS) -------------------


class HyperLog(set):
    """The live values a trace had to bake (a set of hyper ids), and the ``predicates`` it
    decided on instead: ``(hyper, path, op name, constant)`` -- ``if momentum != 0:`` keeps
    ``momentum`` live and guards only that ``momentum != 0`` still holds."""

    def __init__(self, *a):
        super().__init__(*a)
        self.predicates: set = set()


class HyperFloat(HostFloat):
    """A HostFloat read live from a param group; branching on it bakes it (recorded)."""

    __slots__ = ("hyper", "baked", "path")

    def __new__(cls, value, node, hyper, baked, path=None):
        self = HostFloat.__new__(cls, value, node)
        self.hyper, self.baked = hyper, baked
        self.path = path  # () the value itself, (i,) item i of it (betas); None: computed from it
        return self

    def _derive(self, value, node):
        # ``gamma * R``: still this hyper-parameter's value (branching on it or losing it bakes it)
        return HyperFloat(value, node, self.hyper, self.baked)


_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")


def _recording(name):
    op = getattr(float, f"__{name}__")

    def method(self, *a):
        # (a numpy scalar on the other side -- spinningup's ``kl > 1.5 * target_kl`` with kl from
        # mpi_avg -- as a Python number: float's own comparison returns NotImplemented for it,
        # and so does numpy's for a float subclass, a TypeError the user never wrote)
        a = tuple(x.item() if type(x).__module__ == "numpy" and hasattr(x, "item") and getattr(x, "ndim", 1) == 0
                  else x for x in a)
        if self.counter and current(self, _tracer()):   # a hyper combined with a step counter
            return guard_decision(self, name, a)
        preds = getattr(self.baked, "predicates", None)
        if name in _COMPARE and self.path is not None and preds is not None and len(a) == 1 \
                and type(a[0]) in (int, float):
            preds.add((self.hyper, self.path, name, a[0]))  # guard the answer, not the value
        elif name == "float" and not current(self, _tracer()):
            pass   # (a float an older trace left in user state: plain)
        else:
            self.baked.add(self.hyper)  # the graph now depends on this exact value: guard it
            use_carried(self)
        return op(_plain(self), *(_plain(x) if _tracked(x) else x for x in a))
    return method


def predicate_results(value, preds) -> tuple:
    """What the recorded comparisons answer for ``value`` now (the signature's part of a live
    value that a step branched on)."""
    out = []
    for path, name, other in preds:
        v = value
        for i in path:
            v = v[i] if isinstance(v, (tuple, list)) else None
        out.append(getattr(float, f"__{name}__")(_plain(v), other) if isinstance(v, (int, float)) else None)
    return tuple(out)


# (``float(group['lr'])`` too: a plain copy the trace cannot follow, so that value is guarded)
for _name in ("lt", "le", "gt", "ge", "eq", "ne", "bool", "int", "float", "round", "floor", "ceil", "trunc"):
    setattr(HyperFloat, f"__{_name}__", _recording(_name))
HyperFloat.__hash__ = float.__hash__


def group_reader(group: dict, key: str, label: str = ""):
    def read():
        return group[key]
    read.__name__ = read.__qualname__ = f"param_group_{key}"
    read.live_label = label or f"param_groups[..]['{key}']"  # for explain()
    return read


def live_hyper(tracer, group: dict, key: str, hyper, baked: set, label: str = ""):
    """Replace ``group[key]`` (a float or tuple of floats) by HyperFloats read at replay."""
    value = group[key]
    node = tracer.create_node("call_function", group_reader(group, key, label), (), {})
    if isinstance(value, tuple):
        return tuple(HyperFloat(v, tracer.create_node("call_function", operator.getitem, (node, i), {}), hyper,
                                baked, (i,))
                     if isinstance(v, float) else v for i, v in enumerate(value))
    return HyperFloat(value, node, hyper, baked, ())


def source_reader(src):
    """A function reading a pyvalues Source (a global, cell or attribute) at replay."""
    def read():
        return src.read()   # (an argument's attribute: the call's arguments, Source._root_value)
    read.live_label = src.describe()
    read.__name__ = read.__qualname__ = "python_value_" + "".join(
        c if c.isalnum() else "_" for c in src.describe().replace("global ", ""))
    return read


def live_source(tracer, src, value: float, baked: set):
    """A Python float the step reads (a global ``lr``...) as a HyperFloat read at replay."""
    node = tracer.create_node("call_function", source_reader(src), (), {})
    return HyperFloat(value, node, src, baked, ())


# A numpy scalar on the left (``lr / bias_correction1`` with ``lr = lr_schedule[it]``, a numpy.float64 the step
# put in a param group) would convert this float through ``__float__`` (refused as a branch on a counter):
# numpy's arithmetic runs as Python's on it instead (hostufuncs.py).
from .hostufuncs import array_ufunc  # noqa: E402 - it needs HostFloat

HostFloat.__array_ufunc__ = array_ufunc
