"""Live host floats on a device graph: one small tensor per call instead of baked scalars.

On the ``replay`` backend a live float (an ``lr`` a loop assigns, a global the step reads) is
a Python value passed to each op at each replay. A CUDA graph (and Inductor's code) bakes an
op's scalar arguments at record time, so there each such value would force a recapture. This
pass moves the host arithmetic out of the graph and feeds its results in as one float64 tensor
(``live_scalars``), packed by :meth:`DeviceScalars.pack` at every call (one asynchronous copy
from pinned memory): the ops that took a Python scalar take a 0-dim tensor instead.

The tensor forms round differently from the scalar ones (``param + alpha * grad`` in one
kernel against ``grad * lr`` then ``+``), so the runtime only uses this for values that did
change between calls; a value that never changes stays baked and bitwise equal to eager.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

aten = torch.ops.aten

# Python operations on live floats that the graph records (capture/hostscalar.py, hostreads.py).
_HOST_OPS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow,
             operator.floordiv, operator.mod, operator.neg, operator.pos, operator.abs,
             operator.getitem}


def is_reader(n: fx.Node, numbers=False) -> bool:
    """A live float's reader (livefloats.py); with ``numbers`` (True, or the set of readers left
    out) also a tracked number's (capture/uselog.py: an optimizer's Python step count)."""
    return n.op == "call_function" and (hasattr(n.target, "live_label") or numbers not in (False, None) and
                                        is_number_reader(n) and n not in _left_out(numbers))


def _left_out(numbers) -> frozenset:
    return numbers if isinstance(numbers, frozenset) else frozenset()


def is_number_reader(n: fx.Node) -> bool:
    return n.op == "call_function" and hasattr(n.target, "number_label")


def _label(n: fx.Node) -> str:
    return getattr(n.target, "live_label", None) or n.target.number_label


def host_nodes(gm: fx.GraphModule, numbers=False) -> list[fx.Node]:
    """Readers of live floats (and numbers) and the Python arithmetic on them, in graph order."""
    host: set = set()
    out = []
    for n in gm.graph.nodes:
        if is_reader(n, numbers) or (n.op == "call_function" and n.target in _HOST_OPS
                             and any(a in host for a in n.all_input_nodes)
                             and all(a in host for a in n.all_input_nodes)) \
                or (n.op == "call_function" and getattr(n.target, "__module__", None) == "math"
                    and n.all_input_nodes and all(a in host for a in n.all_input_nodes)):
            host.add(n)
            out.append(n)
    return out


@dataclass
class DeviceScalars:
    """The host part of a graph whose live floats reach device ops through ``live_scalars``."""
    program: fx.GraphModule          # no inputs; returns the floats, in slot order
    device: torch.device
    labels: list = field(default_factory=list)   # what each slot holds, for explain()
    outputs: dict = field(default_factory=dict)  # graph output index -> slot: a live float returned
    last: list = field(default_factory=list)     # this call's values (pack)

    def values(self) -> list:
        return list(self.program())

    def fill_outputs(self, outs) -> list:
        """The step's returned live floats (``return loss, opt.param_groups[0]["lr"]``) are
        this call's host values, as eager returns them: no device read, no sync."""
        outs = list(outs)
        for i, slot in self.outputs.items():
            outs[i] = self.last[slot]
        return outs

    def pack(self) -> torch.Tensor:
        """This call's values on the device. The pinned staging block is reused only once its
        copy has run (PyTorch's caching host allocator records the copy's stream)."""
        self.last = self.values()   # (as Python computed them: a returned int stays an int)
        vals = [float(v) for v in self.last]
        if self.device.type != "cuda":
            return torch.tensor(vals, dtype=torch.float64)
        host = torch.tensor(vals, dtype=torch.float64, pin_memory=True)
        return host.to(self.device, non_blocking=True)


class Unsupported(Exception):
    """An op takes a live float where no tensor form is known: those values must be baked.
    ``roots``: the reader nodes feeding such ops (what to bake); empty when it is not known."""

    def __init__(self, msg: str, roots=()):
        super().__init__(msg)
        self.roots = set(roots)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _val(n):
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    if isinstance(v, (list, tuple)):
        return v[0] if v else None
    return v


def _strided(a) -> bool:
    """A dense operand: a node whose value is a strided tensor, or a foreach list of them (the
    list itself has no value: 2d0eeb7 took every foreach list for sparse, and its add for a mul
    of a list, which failed every live-lr SGD/RMSprop/Adadelta replay on the H200)."""
    if isinstance(a, (list, tuple)):
        return all(_strided(x) for x in a)
    v = _val(a)
    return isinstance(v, torch.Tensor) and v.layout == torch.strided


def _rewrite(g: fx.Graph, n: fx.Node, scalar, dry: bool = False, device=None) -> None:
    """Replace ``n`` (an op taking a host node as a Scalar) by its tensor form; ``scalar(x, dtype)``
    is the graph node of host node ``x`` as a 0-dim tensor. ``dry``: only check it is known."""
    t, args, kw = n.target, list(n.args), dict(n.kwargs)
    ref = args[0][0] if args and isinstance(args[0], (list, tuple)) and args[0] else (args[0] if args else None)
    ref = _val(ref)
    dtype = _opmath(ref.dtype) if isinstance(ref, torch.Tensor) else torch.float32

    def s(x):
        return scalar(x, dtype)

    def host(x):
        return isinstance(x, fx.Node) and bool(x.meta.get("device_scalar_host"))

    if isinstance(ref, torch.Tensor) and not (ref.is_floating_point() or ref.is_complex()) and any(
            host(a) and type(a.meta.get("host_value")) is int for a in list(args) + list(kw.values())):
        # (an int scalar keeps an integer op integral; a 0-dim float tensor would promote it)
        raise Unsupported(f"{t} takes a live int with an integer tensor")
    call = g.call_function
    packet = getattr(t, "overloadpacket", None)
    name = packet.__name__ if packet is not None else ""
    inplace = name.endswith("_")
    base = name.rstrip("_")
    suffix = "_" if inplace else ""
    two = len(args) == 2
    if base in ("add", "sub", "_foreach_add", "_foreach_sub") and host(kw.get("alpha")) and two \
            and not any(host(a) for a in args) and set(kw) == {"alpha"}:
        if dry:
            return
        # a + alpha * b is one fused multiply-add in the kernel; addcmul(a, b, alpha_t) (value 1)
        # is the same single rounding with alpha read from the device (bitwise, fp32).
        alpha = s(kw["alpha"])
        if base.endswith("sub"):
            alpha = call(aten.neg.default, (alpha,))
        if not all(_strided(a) for a in args):
            # (a sparse grad, nn.EmbeddingBag(sparse=True), which make_fx leaves without "val":
            # no sparse addcmul; its add rounds the product before the sum anyway)
            n.args, n.kwargs = (args[0], call(aten.mul.Tensor, (args[1], alpha))), {}
            n.target = getattr(aten, "add" + suffix).Tensor
            return
        _per_element(g, n, lambda a, b: call(getattr(aten, "addcmul" + suffix).default, (a, b, alpha)),
                     args[0], args[1], foreach=base.startswith("_foreach"))
        return
    if base in ("addcdiv", "addcmul", "_foreach_addcdiv", "_foreach_addcmul") \
            and host(kw.get("value", args[3] if len(args) == 4 else None)) \
            and not any(host(a) for a in args[:3]):
        if dry:
            return
        value = s(kw["value"] if "value" in kw else args[3])
        a, b, c = args[:3]
        foreach = base.startswith("_foreach")
        if base.endswith("cdiv") or foreach:
            # a + value * (b op c), the quotient/product rounded first: addcmul(a, b op c, value_t)
            op = aten.div.Tensor if base.endswith("cdiv") else aten.mul.Tensor
            _per_element(g, n, lambda x, y, z: call(getattr(aten, "addcmul" + suffix).default,
                                                     (x, call(op, (y, z)), value)), a, b, c, foreach=foreach)
        else:
            # a + (value * b) * c: addcmul(a, b * value_t, c)
            _per_element(g, n, lambda x, y, z: call(getattr(aten, "addcmul" + suffix).default,
                                                     (x, call(aten.mul.Tensor, (y, value)), z)), a, b, c,
                         foreach=False)
        return
    if base in ("div", "_foreach_div") and two and host(args[1]) and not host(args[0]) and not kw \
            and device is not None and torch.device(device).type == "cuda":
        if dry:
            return
        # CUDA divides by a Python float as a multiply by its reciprocal, taken in double and
        # rounded to the op's dtype (H200: 303 of 303 divisors; a float32 reciprocal matched 219);
        # a tensor divisor is a true division, a rounding apart (torchvision's meter ``sum / count``)
        inv = call(aten._to_copy.default, (call(aten.reciprocal.default, (scalar(args[1], torch.float64),)),),
                   {"dtype": dtype})
        n.args, n.target = (args[0], inv), getattr(aten, base.replace("div", "mul") + suffix).Tensor
        return
    if base in ("add", "mul", "div", "sub", "_foreach_add", "_foreach_mul", "_foreach_div") and two \
            and host(args[1]) and not host(args[0]) and not host(kw.get("alpha")):
        if dry:
            return
        n.args, n.target = (args[0], s(args[1])), getattr(aten, base + suffix).Tensor
    elif base == "_foreach_sub" and two and host(args[1]) and not kw:
        if dry:
            return
        neg = call(aten.neg.default, (s(args[1]),))
        n.args, n.target = (args[0], neg), getattr(aten, "_foreach_add" + suffix).Tensor
    elif base == "lerp" and len(args) == 3 and host(args[2]) and not kw:
        if dry:
            return
        n.args, n.target = (args[0], args[1], s(args[2])), getattr(aten, "lerp" + suffix).Tensor
    elif base == "_foreach_lerp" and len(args) == 3 and host(args[2]) and not kw:
        if dry:
            return
        diff = call(aten._foreach_sub.List, (args[1], args[0]))  # self + w * (end - self)
        scaled = call(aten._foreach_mul.Tensor, (diff, s(args[2])))
        n.args, n.target = (args[0], scaled), getattr(aten, "_foreach_add" + suffix).List
    elif t is aten.pow.Scalar and two and host(args[0]) and not host(args[1]):
        if dry:  # beta ** step (capturable Adam's bias correction, step a device tensor)
            return
        n.args, n.target = (s(args[0]), args[1]), aten.pow.Tensor_Tensor
    elif t is aten._foreach_pow.ScalarAndTensor and two and host(args[0]) and not host(args[1]):
        if dry:
            return
        base_t = s(args[0])
        n.args, n.target = ([base_t] * len(args[1]), args[1]), aten._foreach_pow.List
    elif t is aten.scalar_tensor.default and len(args) == 1 and host(args[0]) \
            and device is not None and torch.device(kw.get("device") or "cpu").type == torch.device(device).type:
        if dry:   # torch.scalar_tensor(alpha, ...) of a live float (hostreads.operands_as_tensors)
            return
        dtype = kw.get("dtype") or torch.get_default_dtype()
        # (the float64 slot rounded once to dtype: what scalar_tensor does with the Python float)
        new = call(aten._to_copy.default, (scalar(args[0], torch.float64),), {"dtype": dtype})
        n.replace_all_uses_with(new)
        g.erase_node(n)
    elif t in (aten.fill_.Scalar, aten.fill.Scalar) and two and host(args[1]):
        if dry:
            return
        n.args, n.target = (args[0], s(args[1])), (aten.fill_.Tensor if inplace else aten.fill.Tensor)
    else:
        raise Unsupported(f"{t} takes a live float")


def _per_element(g: fx.Graph, n: fx.Node, make, *lists, foreach: bool) -> None:
    """Replace ``n`` by ``make(*items)`` (a foreach op: one node per element of its lists, its
    ``getitem`` users rewired; an in-place one returns its first list)."""
    # (each new node keeps the value it replaces: a later rewrite reads it -- _strided took a
    # foreach list of such nodes for sparse, SGD's nesterov step after its weight decay, H200)
    if not foreach:
        new = make(*lists)
        new.meta.setdefault("val", n.meta.get("val"))
        n.replace_all_uses_with(new)
        g.erase_node(n)
        return
    outs = [make(*items) for items in zip(*lists)]
    for u in list(n.users):
        if u.op == "call_function" and u.target is operator.getitem:
            outs[u.args[1]].meta.setdefault("val", u.meta.get("val"))
            u.replace_all_uses_with(outs[u.args[1]])
            g.erase_node(u)
    if n.users:
        raise Unsupported(f"{n.target}'s result is used as a list")
    g.erase_node(n)


def _check(gm: fx.GraphModule, device, numbers):
    """The host nodes and their device consumers; raises :class:`Unsupported` (``gm`` unchanged)
    where an op takes one with no known tensor form. Checks every consumer before any change."""
    host = host_nodes(gm, numbers)
    hostset = set(host)
    consumers = list(dict.fromkeys(u for h in host for u in h.users if u not in hostset))
    for h in host:
        h.meta["device_scalar_host"] = True
    bad, why = [], []
    for u in consumers:
        try:
            if u.op == "output" and isinstance(u.args[0], (list, tuple)) \
                    and not any(isinstance(a, (list, tuple, dict)) for a in u.args[0]):
                continue   # (returned to Python: filled from the host values, fill_outputs)
            if u.op != "call_function" or not isinstance(u.target, torch._ops.OpOverload):
                raise Unsupported(f"{u.target} takes a live float")
            _rewrite(gm.graph, u, None, dry=True, device=device)
        except Unsupported as e:
            bad.append(u)
            why.append(str(e))
    if bad or not consumers:
        for h in host:
            del h.meta["device_scalar_host"]
    if bad:
        raise Unsupported("; ".join(dict.fromkeys(why)), _roots([a for u in bad for a in u.all_input_nodes
                                                                  if a in hostset], numbers))
    return host, consumers


def numbers_to_feed(gm: fx.GraphModule, device) -> frozenset | None:
    """The tracked numbers read at each replay whose device ops all take them as a 0-dim tensor
    are fed in (:func:`to_device_scalars`); returns the readers left out (a meter's sum meeting
    a value read from a tensor: Python between segments), or None when none is fed."""
    out = frozenset()
    while True:
        try:
            _check(gm, device, out)
            bad = frozenset()
        except Unsupported as e:   # (none of its roots a number: a live float's, to_device bakes it)
            bad = frozenset(r for r in e.roots if is_number_reader(r))
        finally:
            for n in gm.graph.nodes:
                n.meta.pop("device_scalar_host", None)
        if not bad:
            break
        out |= bad
    hostset = set(host_nodes(gm, out))
    feeding = [a for h in hostset for u in h.users if u not in hostset for a in u.all_input_nodes if a in hostset]
    return out if any(is_number_reader(r) for r in _roots(feeding, out)) else None


def to_device_scalars(gm: fx.GraphModule, device, numbers=False) -> DeviceScalars | None:
    """Rewrite ``gm`` in place (a trailing ``live_scalars`` placeholder) and return how to fill
    it; None when the graph has no live floats. Raises :class:`Unsupported`, with ``gm``
    unchanged, when an op takes a live float in a way with no known tensor form. ``numbers``:
    tracked numbers read at each replay are fed in too (an optimizer's Python step count)."""
    host, consumers = _check(gm, device, numbers)
    if not consumers:
        return None
    hostset = set(host)
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    if anchor is None:
        with g.inserting_before(next(iter(g.nodes))):
            live = g.placeholder("live_scalars")
    else:
        with g.inserting_after(anchor):
            live = g.placeholder("live_scalars")
    slots: dict = {}      # host node -> slot index
    cache: dict = {}      # (host node, dtype) -> 0-dim tensor node

    def scalar(h, dtype):
        if h not in slots:
            slots[h] = len(slots)
        key = (h, dtype)
        if key not in cache:
            sel = g.call_function(aten.select.int, (live, 0, slots[h]))
            cache[key] = sel if dtype == torch.float64 else \
                g.call_function(aten._to_copy.default, (sel,), {"dtype": dtype})
        return cache[key]

    outputs: dict = {}
    for u in dict.fromkeys(consumers):
        with g.inserting_before(u):
            if u.op == "output":
                outs = list(u.args[0])
                for i, a in enumerate(outs):
                    if a in hostset:
                        outs[i] = scalar(a, torch.float64)   # (a device copy; the host value replaces it)
                        outputs[i] = slots[a]
                u.args = (type(u.args[0])(outs),)
                continue
            _rewrite(g, u, scalar, device=device)
    # The host program: the same arithmetic, returning the slots' values.
    prog = fx.Graph()
    env: dict = {}
    for h in host:
        env[h] = prog.node_copy(h, lambda x: env[x])
    order = sorted(slots, key=slots.get)
    prog.output([env[h] for h in order])
    program = fx.GraphModule(gm, prog)
    for h in reversed(host):
        if not h.users:
            g.erase_node(h)
    g.lint()
    gm.recompile()
    labels = [_label(h) for h in host if is_reader(h, numbers)]
    return DeviceScalars(program, torch.device(device), labels, outputs)


def _roots(nodes, numbers=False) -> set:
    """The readers the host nodes ``nodes`` are computed from."""
    out, todo, seen = set(), list(nodes), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_reader(n, numbers):
            out.add(n)
        todo.extend(n.all_input_nodes)
    return out
