"""The two modes a trace runs under, watching for what a replay could not repeat.

* ``_HostReadMode`` (torch-function level) sees Python-visible host reads — ``.item()``,
  ``.tolist()``, ``.numpy()``, ``print(t)``, ``bool(t)`` — on tensors computed by the step,
  and turns ``.item()`` on optimizer step counters into host scalars (hostscalar.py).
* ``_DispatchCheckMode`` (aten level) sees ops whose output shape or value depends on data, host
  work inside a device step (``_cpu_work``) and tensors filled behind the dispatcher (unfilled.py,
  through constfold.py).
  Both record ``Problem``s; trace.py raises the first after the step ran to its end."""
from __future__ import annotations

import operator
import traceback

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..errors import library_frame, user_frame
from .hostscalar import HostFloat, HyperFloat, current, item_node, substitute, use_carried
from .hostreads import (ReadFloat, ReadLog, c_scalar_read, cuda_division, guard_lost, operands_as_tensors, read_scalar,
                        tensor_shape, tensor_values)
from .sinks import _ELEMENTWISE
from .tensorformat import percent_format, formatted_read
from .arrays import ArrayUses
from .constfold import Constants
from .steparrays import StepArrays
from .cpuwork import _argument_to_device, _cpu_work
from .rnns import note_grad_mode, refuse_packed
from .tensordata import _TENSOR_FROM_DATA, _tensor_of_live_floats, _tensor_of_step_tensors
from .collectives import direct_collective
from .dataorder import note_draw
from .functionals import opened
from .effects import _HOST_READS, _T, Problem, _is_traced
from .state import StateRegistry

_DEVICE_MOVES = {_T.cpu, _T.to}
_HOOK_REGISTRATIONS = {_T.register_hook, _T.register_post_accumulate_grad_hook}
_PATCHED_READS = {_T.tolist, _T.numpy, _T.__array__}  # checked by _host_read_patches instead
_SCALAR_READS = {_T.item, _T.__float__, _T.__int__, _T.__bool__, _T.__index__}  # guarded or live
_PRINTS = {_T.__repr__, _T.__str__, _T.__format__}


_ONE_HOT = torch._C._nn.one_hot   # (torch.nn.functional.one_hot)


def _one_hot(t, num_classes: int, reads: ReadLog):
    """``F.one_hot(t, num_classes)`` of a CPU tensor: ATen checks the class values on the host
    (``t.min().item() >= 0``, ``num_classes > t.max().item()``) before its ``zeros`` +
    ``scatter_``, reads a graph cannot repeat inside a C++ op. Traced as that same ``zeros`` +
    ``scatter_``, with the check as one value guard (true while the values are in range; a call
    with one out of range misses it, and its capture raises eager's error). NotImplemented where
    ATen reads something else on the host (``num_classes=-1``: the output shape) or reads
    nothing (an empty tensor; a device tensor, which scatter checks on the device)."""
    if t.dtype != torch.long or num_classes < 1 or t.numel() == 0 or t.device.type != "cpu":
        return NotImplemented
    ok = ((t >= 0) & (t < num_classes)).all()
    if not read_scalar(get_proxy_mode().tracer, ok, _T.__bool__, reads):
        with _disable_current_modes():
            return _ONE_HOT(t, num_classes)   # eager's error
    out = torch.zeros(*t.shape, num_classes, dtype=t.dtype, device=t.device)
    return out.scatter_(-1, t.unsqueeze(-1), 1)


class _HostReadMode(TorchFunctionMode):
    def __init__(self, step_ids: set[int], problems: list[Problem], reg: StateRegistry | None = None,
                 reads: ReadLog | None = None):
        super().__init__()
        self.reads = reads  # None: every host read is a problem (host_reads="error")
        self.step_ids = step_ids
        self.problems = problems
        self.reg = reg
        self.hooks: list = []   # (where, fn) of hooks registered during the trace
        self.state_hooks: list = []  # (source, tensor, fn): hooks the step put on its own state
        self.step_arrays = StepArrays()   # .numpy() of traced values (steparrays.py)
        self.to_host: list = []   # (node, Problem) of device values copied to the host (tohost.py)

    def _new_counter(self, t) -> bool:
        """A step counter the optimizer created during this trace (no warm-up before it)."""
        if self.reg is None or t.numel() != 1 or t.device.type != "cpu":
            return False
        for _, opt in self.reg.optimizers:
            for st in opt.state.values():
                if isinstance(st, dict) and st.get("step") is t:
                    self.step_ids.add(id(t))
                    return True
        return False

    def _to_host(self, func, args, kwargs):
        """A device value copied to the host: refused unless the step only returns the copy
        (decided on the graph: tohost.py), then copied after each run instead."""
        from torch.fx.experimental.proxy_tensor import get_proxy_slot, has_proxy_slot
        stack = traceback.extract_stack()
        problem = Problem("copy of a device tensor to the CPU (.cpu()/.to('cpu'))", user_frame(stack),
                          "return the device tensor (or its .cpu() copy, untouched) and use it outside "
                          "the step", library_frame(stack))
        out = func(*args, **kwargs)
        tracer = get_proxy_mode().tracer
        if isinstance(out, torch.Tensor) and has_proxy_slot(out, tracer):
            self.to_host.append((get_proxy_slot(out, tracer).proxy.node, problem))
        else:
            self.problems.append(problem)
        return out

    def _problem(self, op, fix):
        stack = traceback.extract_stack()
        self.problems.append(Problem(op, user_frame(stack), fix, library_frame(stack)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.step_arrays.note_torch_use(func, args, kwargs)
        if getattr(func, "__wrapped__", func) in _HOOK_REGISTRATIONS and len(args) > 1:
            self.hooks.append((f"tensor {func.__name__}", args[1]))
            if self.reg is not None and self.reg.name_of(args[0]) is not None:
                self.state_hooks.append((self.reg.name_of(args[0]), args[0], args[1]))
        if func is _ONE_HOT and self.reads is not None and args and _is_traced(args[0]):
            out = _one_hot(args[0], kwargs.get("num_classes", args[1] if len(args) > 1 else -1), self.reads)
            if out is not NotImplemented:
                return out
        if func in _TENSOR_FROM_DATA and args and isinstance(args[0], (list, tuple)) and \
                any(_is_traced(x) for x in pytree.tree_leaves(args[0])):
            return _tensor_of_step_tensors(func, args, kwargs)
        if func in _TENSOR_FROM_DATA and args and self.reads is not None:
            out = _tensor_of_live_floats(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if func is _T.item and args and (id(args[0]) in self.step_ids or self._new_counter(args[0])):
            return item_node(get_proxy_mode().tracer, args[0])
        if self.reads is not None and func in _SCALAR_READS and args and isinstance(args[0], torch.Tensor) \
                and not _is_traced(args[0]) and self.reg is not None and self.reg.name_of(args[0]) is not None:
            # (``int(self.queue_ptr)`` before any op touched the buffer: MoCo without DDP. Into
            # the graph first, so the read is a node of it, guarded like any other.)
            args = (torch.ops.aten.alias.default(args[0]),) + tuple(args[1:])
        if self.reads is not None and args and _is_traced(args[0]):
            if func is _T.__float__ and percent_format():
                # ``'loss = %.3f' % loss`` (RealNVP's print): formatting, as f'{loss:.3f}' is --
                # it was a value guard, a recapture at every printing call
                self.reads.printed.append(user_frame())
                with _disable_current_modes():
                    return func(*args, **kwargs)
            if func in _SCALAR_READS and args[0].numel() == 1:
                return read_scalar(get_proxy_mode().tracer, args[0], func, self.reads)
            if func is _T.__format__ and args[0].numel() == 1 and not args[0].is_floating_point() \
                    and not args[0].is_complex() and self.reads.uses is not None:   # (a name's index)
                n = read_scalar(get_proxy_mode().tracer, args[0], _T.item, self.reads)
                return formatted_read(n, args[1] if len(args) > 1 else "", self.reads.printed)
            if func in _PRINTS:  # printing a tensor: logging, it runs only at capture
                self.reads.printed.append(user_frame())
                with _disable_current_modes():
                    return func(*args, **kwargs)
        info = _HOST_READS.get(func)
        if info is not None and func not in _PATCHED_READS and args and _is_traced(args[0]):
            self._problem(*info)
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func in _DEVICE_MOVES and args and _is_traced(args[0]) and args[0].device.type != "cpu":
            dev = kwargs.get("device", args[1] if len(args) > 1 else None)
            if func is _T.cpu or (dev is not None and torch.device(dev).type == "cpu"
                                  if isinstance(dev, (str, torch.device)) else False):
                return self._to_host(func, args, kwargs)
        tracer = get_proxy_mode().tracer if get_proxy_mode() is not None else None
        floats = [a for a in pytree.tree_leaves((args, kwargs)) if current(a, tracer)]
        if not floats:
            return func(*args, **kwargs)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in pytree.tree_leaves((args, kwargs))):
            body = opened(func)   # (``F.gumbel_softmax(x, tau=live)``: its ops see the float)
            if body is not None:
                with self:
                    return body(*args, **kwargs)
            if func in _ELEMENTWISE:   # (``alpha * log_pi``: a 0-dim tensor made from it, live)
                made, floats = operands_as_tensors(args, floats)
                func, args = cuda_division(func, args, made, kwargs)
            # Autograd may save this number for the backward (``loss * scale``), which the
            # engine calls with a plain float: it cannot stay live there, so guard it instead.
            for f in floats:
                use_carried(f)
                if isinstance(f, HyperFloat):
                    f.baked.add(f.hyper)
            if self.reads is not None:
                guard_lost(floats, self.reads)
        tracer = get_proxy_mode().tracer
        last = tracer.graph._root.prev  # nodes added after this one belong to this call
        out = func(*args, **kwargs)
        new_nodes = []
        n = last.next
        while n is not tracer.graph._root:
            new_nodes.append(n)
            n = n.next
        used = substitute(new_nodes, floats, pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, (list, tuple)) and any(isinstance(y, HostFloat) for y in x)))
        lost = [f for f in floats if id(f) not in used]
        for f in lost:
            use_carried(f)
            if isinstance(f, HyperFloat):
                f.baked.add(f.hyper)  # could not stay live here: guard its value instead
        guard_lost(lost, self.reads) if self.reads is not None else None
        # (a lifted Python number lost here is checked by value instead: use_carried above)
        if any(not isinstance(f, (HyperFloat, ReadFloat)) and f.counter for f in lost):
            self._problem(f"an optimizer step counter's value flowed into {getattr(func, '__name__', func)} "
                          "where stepgraph cannot keep it live", "use a capturable optimizer "
                          "(capturable=True) or report this optimizer to stepgraph")
        return out


def _reads_guarded(t, batch_sizes) -> bool:
    """``t`` is (a view of) guarded batch sizes (nn.LSTM's ``max_batch_size = batch_sizes[0]``)."""
    base = t._base if t._base is not None else t
    return any(base is b for b in batch_sizes)


def _dynamic_problem(func, args) -> str | None:
    tags = func.tags
    if torch.Tag.dynamic_output_shape in tags:
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor):
            idx = args[1] if len(args) > 1 else []
            if not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx):
                return None  # integer indexing has a static output shape
        return (f"{func}: its output shape depends on tensor values",
                "keep shapes static: use masking (torch.where, multiplying by a mask) instead of "
                "boolean indexing / nonzero / unique, or move this part outside the step")
    if torch.Tag.data_dependent_output in tags:
        return (f"{func}: reads a tensor value on the host",
                "return the tensor from the step and read it outside; if it is an optimizer's "
                "tensor lr, use a float lr or fused=True / capturable=True")
    return None


_CARRIED_FIX = ("the step detaches it: a state carried from call to call (an RNN's hidden state) is an input and "
                "an output of the graph -- pass it to the step and return the new one (loss, hidden = step(x, hidden))")
_HISTORY_FIX = ("compute it inside the step (pass its inputs as arguments), or detach it before the call if no "
                "gradient should flow into it (x = x.detach(); and x.requires_grad_() when the step differentiates "
                "with respect to it, as a PINN's torch.autograd.grad(u, x) does: x becomes a leaf of its own); for a "
                "loss built from many earlier forward calls (REINFORCE) capture the forward with "
                "stepgraph.graph_module(model) instead of the whole step")
_LOSS_KEPT = ("a loss kept from the last call (a meter's sum += loss * n, the QAT tutorial's "   # (0-dim)
              "avgloss.update(loss, n)): keep loss.detach() there instead; otherwise ")


class _DispatchCheckMode(TorchDispatchMode):
    def __init__(self, problems: list[Problem], cuda_step: bool = False, known: set | None = None,
                 reads: ReadLog | None = None, arrays=()):
        super().__init__()
        self.arrays = ArrayUses(arrays)   # input numpy arrays (arrays.py)
        self.constants = Constants(self.arrays)   # CPU values built from constants (constfold.py)
        self.reads = reads   # host reads allowed: a data-dependent shape becomes a shape guard
        self.problems = problems
        self.cuda_step = cuda_step
        self.host_scalar_ops: tuple = ()   # (op, "file:line") of each (the refusal names the first)
        self.known = known if known is not None else set()
        self.foreign_seen: set = set()
        self.batch_sizes: list = []   # packed batch sizes guarded by value: reading them is safe
        self.host: dict = {}   # id -> a CPU tensor computed from host values only (_host_op)
        self.backward_seen = False   # (a refusal before it is raised at once: _refuse_now)

    def _shape_guards(self, func, out) -> None:
        from torch.fx.experimental.proxy_tensor import get_proxy_slot, has_proxy_slot
        tracer = get_proxy_mode().tracer
        site = user_frame()
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and has_proxy_slot(t, tracer):
                node = get_proxy_slot(t, tracer).proxy.node
                shape = tracer.create_node("call_function", tensor_shape, (node,), {})
                self.reads.guard(shape, tuple(t.shape), f"the shape of {func}'s output (it depends on "
                                 "tensor values)", site)

    def guard_batch_sizes(self, sizes) -> bool:
        """A packed sequence's batch sizes (host values, from the lengths) are read by every RNN
        kernel after it and baked into the graph: guarded by value (new lengths: another graph;
        unguarded, a replay crashed or computed on the wrong rows). False: refused instead."""
        from torch.fx.experimental.proxy_tensor import get_proxy_slot, has_proxy_slot
        if _reads_guarded(sizes, self.batch_sizes):
            return True
        tracer, site = get_proxy_mode().tracer, user_frame()
        if self.reads is None or not has_proxy_slot(sizes, tracer):
            self.problems.append(Problem(
                "pack_padded_sequence: the packed batch sizes are read from the lengths on the host",
                site, "use host_reads='guard' (the default): the lengths are then guarded by value"))
            return False
        node = tracer.create_node("call_function", tensor_values, (get_proxy_slot(sizes, tracer).proxy.node,), {})
        self.reads.guard(node, tuple(sizes.tolist()), "the batch sizes of a packed sequence (its lengths)", site)
        self.batch_sizes.append(sizes)
        return True

    def _host_op(self, func, args, kwargs, out) -> bool:
        """In a CUDA step: a CPU op on host values only -- the call's CPU tensors, constants, other
        such ops' results (``torch.randint(1, T, (n,))``) -- or a copy of one to the device. Its
        graph node is marked; passes/host_prologue.py runs it before the graph at each call."""
        from torch.fx.experimental.proxy_tensor import get_proxy_slot, has_proxy_slot
        mode = get_proxy_mode()
        if mode is None or not isinstance(func, torch._ops.OpOverload) or func._schema.is_mutable:
            return False
        tracer = mode.tracer
        for a in pytree.tree_leaves((args, kwargs)):
            if not isinstance(a, torch.Tensor):
                continue
            if a.device.type != "cpu" or not (self.host.get(id(a)) is a or not has_proxy_slot(a, tracer)
                                              or get_proxy_slot(a, tracer).proxy.node.op == "placeholder"):
                return False
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not outs and func is not torch.ops.aten.is_pinned.default:
            return False   # (an .item() of a CPU tensor is a host read: hostscalar.py, hostreads.py)
        if func is not torch.ops.aten._to_copy.default and any(o.device.type != "cpu" for o in outs):
            return False
        for o in outs:
            if has_proxy_slot(o, tracer):
                node = get_proxy_slot(o, tracer).proxy.node
                node.meta["stepgraph_host"] = True
                if node.target is operator.getitem:   # (an element of a tuple: the op too)
                    node.args[0].meta["stepgraph_host"] = True
            if o.device.type == "cpu":
                self.host[id(o)] = o
        return True

    def _foreign_history(self, args, kwargs, func=None) -> None:
        """A tensor computed *before* the step, with autograd history (REINFORCE's saved
        log-probs): the graph would hold this call's values and its backward would run into
        the autograd graph of one past call. Parameters (leaves) are fine: read by reference."""
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.grad_fn is not None and id(a) not in self.known \
                    and id(a) not in self.foreign_seen and not _is_traced(a):
                self.foreign_seen.add(id(a))
                stack = traceback.extract_stack()
                self.problems.append(Problem(
                    f"a tensor {str(a.dtype).replace('torch.', '')}{list(a.shape)} computed before the step "
                    f"(grad_fn={type(a.grad_fn).__name__}) is used in it: a replay would reuse this call's "
                    "values and backpropagate into a graph that no longer exists",
                    user_frame(stack), _CARRIED_FIX if func is torch.ops.aten.detach.default else
                    (_LOSS_KEPT if a.dim() == 0 else "") + _HISTORY_FIX,
                    library_frame(stack), plain=True))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.backward_seen = self.backward_seen or torch._C._current_autograd_node() is not None
        if torch.Tag.nondeterministic_seeded in func.tags: note_draw(func, args, kwargs)   # (dataorder.py)
        self._foreign_history(args, kwargs, func)
        folded = self.constants.fold(func, args, kwargs)
        if folded is not NotImplemented:
            return folded
        self.constants.check_write(func, args, kwargs, self.problems)
        if func is torch.ops.aten._local_scalar_dense.default and _reads_guarded(args[0], self.batch_sizes):
            with _disable_current_modes():
                return func(*args, **kwargs)   # a value the graph's guard already fixes
        if func is torch.ops.aten._local_scalar_dense.default and self.reads is not None and _is_traced(args[0]) \
                and (read := c_scalar_read(args[0], self.reads)) is not NotImplemented:
            return read   # (an integer step tensor torch's C parser takes as a number: hostreads.py)
        found = _dynamic_problem(func, args)
        if found is not None and self.reads is not None and torch.Tag.dynamic_output_shape in func.tags:
            # nonzero, boolean masks, unique: this graph holds for the output shape the trace saw;
            # a replay reads it on the host (as the op itself syncs, in eager too) and guards it.
            out = func(*args, **kwargs)
            self._shape_guards(func, out)
            return out
        if found is not None:
            what, fix = found
            stack = traceback.extract_stack()
            self.problems.append(Problem(what, user_frame(stack), fix, library_frame(stack)))
            if torch.Tag.data_dependent_output in func.tags:
                with _disable_current_modes():
                    return func(*args, **kwargs)
        self.arrays.check_write(func, args)   # (into a copy of a numpy argument)
        direct_collective(func, self.problems)   # (a collective not remapped: collectives.py)
        out = func(*args, **kwargs)
        self.arrays.note(func, args, out)
        self.constants.note(func, args, out, kwargs)
        if func is torch.ops.aten.mkldnn_rnn_layer.default: note_grad_mode(out)   # (replayed in the step's grad mode)
        if func is torch.ops.aten._pack_padded_sequence.default:
            if self.cuda_step:
                refuse_packed(self.problems, user_frame())
            self.guard_batch_sizes(out[1])
        work = _cpu_work(func, args, kwargs, out) if self.cuda_step and not _argument_to_device(func, args, out) \
            and not self.arrays.device_index(func, args, kwargs, out) \
            and not self.constants.device_index(func, args, kwargs) \
            and not self._host_op(func, args, kwargs, out) else None
        if work == "scalar":
            # e.g. Adagrad's CPU step counter: fine for 'replay' only
            stack = traceback.extract_stack()
            lib = library_frame(stack)
            self.host_scalar_ops += ((str(func), user_frame(stack) + (f" (in {lib})" if lib else "")),)
        elif work == "tensor":
            stack = traceback.extract_stack()
            self.problems.append(Problem(
                f"{func} runs on CPU tensors inside a CUDA step (a CUDA graph would run it only once, "
                "at capture)", user_frame(stack),
                "move those tensors to the GPU before the step (or make them state on the GPU)",
                library_frame(stack)))
            _refuse_now(self.problems, self.backward_seen)
        return out


def _refuse_now(problems, backward_seen: bool) -> None:
    """Before the trace's backward, refused at once: the call is undone and rerun eagerly (after_failed_trace).
    Kept to the trace's end, the call held the trace's numbers (DETR's biases 2.9e-3 apart on an H200)."""
    if not backward_seen:   # (set by this op's own dispatch too: a backward node running now)
        from .trace import raise_problems
        raise_problems(problems)   # (the first found leads, as at the trace's end)
