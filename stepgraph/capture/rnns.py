"""cuDNN's RNNs (nn.LSTM / nn.GRU / nn.RNN on CUDA) are traced as their decomposition.

Why not trace cuDNN itself: ``aten::lstm`` (and gru, rnn_tanh, rnn_relu) is a composite that,
on CUDA with cuDNN on, views the module's flattened weights as one buffer with
``empty(0).set_(params[0].untyped_storage())`` before calling ``_cudnn_rnn``. That ``set_``
takes an ``UntypedStorage``, which make_fx cannot record (NotImplementedError "argument of type:
<class 'torch.storage.UntypedStorage'>"). Getting past it (recording the buffer as a view of
the first parameter) would still leave: cuDNN's weight gradients as views of one flat buffer
bound to ``.grad``, a reserve buffer, and a dropout state owned by a process-wide cache that is
(re)seeded with a host read and guarded by CUDA events -- none of which a CUDA graph records
safely, nor a check on this machine can exercise.

Instead, while stepgraph traces, the four RNN functions are answered by PyTorch's own
decompositions (``torch._decomp.decompositions``, the ones Inductor uses): per-layer matmuls and
pointwise ops, traceable, recordable into one CUDA graph, on any backend. The layer loop is
stepgraph's own: PyTorch's ``_rnn_helper`` never applies the dropout between layers
(its condition ``num_layers < i - 1`` is never true); here it is ``torch.dropout`` between
layers, as the non-cuDNN CUDA kernels apply it. The difference from eager, documented in
tests/test_footguns.py (q) and logged once:

* fp tolerance, not bitwise: other kernels; eager cuDNN follows ``torch.backends.cudnn.allow_tf32``
  (on by default: TF32 on Ampere and later), the decomposition follows
  ``torch.backends.cuda.matmul`` (full fp32 by default);
* dropout between layers draws its masks from PyTorch's generator, not cuDNN's dropout state
  (same distribution, other masks).

Packed sequences (``aten::lstm.data``): their batch sizes are host values read from the lengths,
guarded by value (modes._DispatchCheckMode.guard_batch_sizes: new lengths, another graph). On
the CPU they capture (native kernels, or the decomposition when forced). In a CUDA step they are
refused with a clear message: the lengths are CPU tensors, sorted and packed on the host, which
one CUDA graph would run only at capture (the refused call runs cuDNN, as eager).
``_FORCE`` (tests only) decomposes on every device, so the CPU tests exercise this code.
"""
from __future__ import annotations

import logging
from functools import partial

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

log = logging.getLogger("stepgraph")

_FORCE = False       # tests: decompose RNNs on every device, not only where eager would run cuDNN
_logged = [False]

_VF = torch._C._VariableFunctions
_RNNS = {_VF.lstm: "lstm", _VF.gru: "gru", _VF.rnn_tanh: "rnn_tanh", _VF.rnn_relu: "rnn_relu"}
_MODULE = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}


def _eager_runs_cudnn(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.backends.cudnn.enabled and torch.backends.cudnn.is_acceptable(x)


def _layers(x, hiddens, params, has_biases, num_layers, dropout, train, bidirectional, batch_first, layer):
    """The layer stack (one ``layer`` call per layer and direction); (output, final hiddens)."""
    x = x.transpose(0, 1) if batch_first else x
    dirs = 2 if bidirectional else 1
    finals = []
    for i in range(num_layers):
        outs = []
        for d in range(dirs):
            out, h = layer(x, hiddens[i * dirs + d], params[i * dirs + d], has_biases, reverse=d == 1)
            outs.append(out)
            finals.append(h)
        x = torch.cat(outs, outs[0].dim() - 1) if dirs == 2 else outs[0]
        if dropout != 0 and train and i < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    return (x.transpose(0, 1) if batch_first else x), finals


def _decomposed(kind: str, args):
    from torch._decomp import decompositions as D
    x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    if kind == "lstm":
        h0, c0 = hx
        flat = D.gather_params(params, has_biases, h0.size(2) != c0.size(2))
        out, finals = _layers(x, list(zip(h0, c0)), flat, has_biases, num_layers, dropout, train,
                              bidirectional, batch_first, D.one_layer_lstm)
        hs = [h.reshape(h0.shape[1:]) for h, _ in finals]
        cs = [c.reshape(c0.shape[1:]) for _, c in finals]
        return out, torch.stack(hs, 0), torch.stack(cs, 0)
    cell = D.gru_cell if kind == "gru" else D.rnn_cell(torch.tanh if kind == "rnn_tanh" else torch.relu)
    flat = D.gather_params(params, has_biases, False)
    out, finals = _layers(x, hx.unbind(0), flat, has_biases, num_layers, dropout, train, bidirectional,
                          batch_first, partial(D.one_layer_rnn, hidden_fn=cell))
    return out, torch.stack([h.reshape(hx.shape[1:]) for h in finals], 0)


def _decomposed_packed(kind: str, args):
    """The ``.data`` forms (a PackedSequence); its batch sizes, guarded by value, as ints."""
    from torch._decomp import decompositions as D
    data, sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional = args
    with _disable_current_modes():
        sizes = sizes.tolist()
    if kind == "lstm":
        h0, c0 = hx
        flat = D.gather_params(params, has_biases, h0.size(2) != c0.size(2))
        out, finals = _layers(data, list(zip(h0, c0)), flat, has_biases, num_layers, dropout, train, bidirectional,
                              False, partial(D.one_layer_lstm_data, batch_sizes=sizes))
        return out, torch.stack([h for h, _ in finals], 0), torch.stack([c for _, c in finals], 0)
    cell = D.gru_cell_data if kind == "gru" else D.rnn_cell_data(torch.tanh if kind == "rnn_tanh" else torch.relu)
    out, finals = _layers(data, hx.unbind(0), D.gather_params(params, has_biases, False), has_biases, num_layers,
                          dropout, train, bidirectional, False,
                          partial(D.one_layer_rnn_data, batch_sizes=sizes, hidden_fn=cell))
    return out, torch.stack(finals, 0)


_PACKED = "a packed sequence (pack_padded_sequence)"


def refuse_packed(problems: list, where: str) -> None:
    """A packed sequence in a CUDA step: the lengths' CPU work (sort, packing) would run once, at
    capture, in a CUDA graph. Put first: the CPU-work problems it causes name no useful fix."""
    from .effects import Problem
    if any(p.op.startswith(_PACKED) for p in problems):
        return
    problems.insert(0, Problem(
        _PACKED + " in a CUDA step cannot be captured yet: its lengths are "
        "CPU tensors, sorted and packed on the host at every call", where,
        "pass the padded batch to the RNN and mask the padded positions in the loss (shapes then stay "
        "static), or keep this step eager (on_capture_error='eager')", plain=True))


class RnnDecomposition(TorchFunctionMode):
    """While tracing: ``torch._VF.lstm/gru/rnn_tanh/rnn_relu`` (what nn.LSTM/GRU/RNN call) run
    as their decomposition where eager would run cuDNN (or everywhere, ``_FORCE``). A packed
    sequence's batch sizes are guarded by value (``guard_sizes``, modes._DispatchCheckMode), on
    cuDNN it is refused (``problems``; ``where()`` names the user's line)."""

    def __init__(self, problems: list, where, guard_sizes):
        super().__init__()
        self.problems, self.where, self.guard_sizes = problems, where, guard_sizes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _RNNS.get(func) if not kwargs else None
        if kind is None or len(args) != 9:
            return func(*args, **(kwargs or {}))
        cudnn = _eager_runs_cudnn(args[0])
        if isinstance(args[3], (list, tuple)):   # .data(data, batch_sizes, hx, params, ...)
            if cudnn:
                refuse_packed(self.problems, self.where())
                with _disable_current_modes():
                    return func(*args)   # refused: the call's state must be eager's
            if not self.guard_sizes(args[1]) or not _FORCE:
                return func(*args)
            return _decomposed_packed(kind, args)
        if not (_FORCE or cudnn):
            return func(*args)
        if not _logged[0]:
            _logged[0] = True
            log.info("stepgraph: nn.%s on cuDNN is captured as its decomposition (matmuls and pointwise "
                     "ops): fp tolerance against eager, dropout between layers from PyTorch's generator",
                     _MODULE[kind])
        return _decomposed(kind, args)


def note_grad_mode(out) -> None:
    """An mkldnn RNN layer's node remembers the grad mode it ran in (replayed in it)."""
    import operator
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, has_proxy_slot
    tracer = get_proxy_mode().tracer
    t = out[0] if isinstance(out, (tuple, list)) else out
    if isinstance(t, torch.Tensor) and has_proxy_slot(t, tracer):
        node = get_proxy_slot(t, tracer).proxy.node
        node = node.args[0] if node.target is operator.getitem else node
        node.meta["grad_enabled"] = torch.is_grad_enabled()
