"""Library code the trace must meet as eager does, and fixes the user can apply for library code.

Libraries that already know how to avoid host reads while a graph is traced: tell them.

Hugging Face ``transformers`` asks ``is_tracing(tensor)`` before reading a mask on the host
(``masking_utils``: ``if padding_mask.all(): skip the mask``) and builds the explicit mask
instead when it is tracing. stepgraph's trace runs on real tensors, so it answers False and
the read would be a host sync. While stepgraph traces, ``is_tracing(t)`` is also True for a
tensor the step computed (one with a proxy), in every loaded ``transformers`` module that
imported it. The mask is then always built: the same values eager computes with padding; on
an unpadded batch the explicit all-visible mask replaces ``is_causal`` (same attention, other
kernel: fp tolerance, not bitwise). CUDA steps only: on the CPU the read is a guarded host read
(a graph for unpadded batches, one for padded; bitwise), where before grads were ~1e-8 off at
every replay of an unpadded batch, said nowhere (footgun (u)).

PyTorch's transformer fast paths (eval mode without grad) are skipped when ``has_torch_function``
says a mode is active, and stepgraph's own modes are: the trace ran the slow path while eager
ran ``_transformer_encoder_layer_fwd`` (~1e-7 apart). ``torch_fast_paths`` answers those checks
as eager would. A padded batch turned into a nested tensor cannot be traced: refused with a fix.
"""
from __future__ import annotations

import contextlib
import sys

import torch


@contextlib.contextmanager
def tracing_hints(is_traced, device: str = "cuda"):
    iu = sys.modules.get("transformers.utils.import_utils")
    orig = getattr(iu, "is_tracing", None) if iu is not None else None
    if orig is None or device != "cuda":   # (on the CPU the read is a guarded host read: bitwise)
        yield
        return

    def is_tracing(tensor=None):
        return orig(tensor) or (tensor is not None and is_traced(tensor))
    patched = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("transformers") and getattr(mod, "is_tracing", None) is orig:
            mod.is_tracing = is_tracing
            patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            mod.is_tracing = orig


_FAST_PATH_MODULES = ("torch.nn.modules.transformer", "torch.nn.modules.activation")


def _overrides_torch_function(x) -> bool:
    """A tensor subclass with its own ``__torch_function__`` (modes aside)."""
    f = getattr(type(x), "__torch_function__", None)
    return isinstance(x, torch.Tensor) and f is not None and f is not torch._C._disabled_torch_function_impl \
        and getattr(f, "__func__", f) is not torch.Tensor.__torch_function__.__func__


@contextlib.contextmanager
def torch_fast_paths(where):
    """While tracing: transformer fast-path checks see no stepgraph modes (eager's choice of
    kernels); nested-tensor conversion of a padded batch raises a ``CaptureError`` (``where()``
    names the user's line)."""
    from ..errors import CaptureError
    from torch.nn.modules import activation
    ov = torch.overrides
    saved = ov.has_torch_function, torch._nested_tensor_from_mask_left_aligned, torch._nested_tensor_from_mask
    # (nn.MultiheadAttention.forward also refuses its fast path while make_fx traces: an eval
    # MHA under no_grad -- a distillation teacher, a validation pass in the step -- took the
    # slow path, 6e-8 from eager's torch._native_multi_head_attention at every replay)
    saved_mha = getattr(activation, "_is_make_fx_tracing", None)

    def has_torch_function(args):
        if sys._getframe(1).f_globals.get("__name__") in _FAST_PATH_MODULES:
            return any(_overrides_torch_function(a) for a in args)
        return saved[0](args)

    def nested_from_mask(*a, **k):
        raise CaptureError(
            "nn.TransformerEncoder's fast path (eval mode, no grad, a src_key_padding_mask) turns the padded "
            "batch into a nested tensor, which stepgraph cannot trace; its padded positions come out as zeros",
            op="torch._nested_tensor_from_mask", where=where(),
            fix="build the encoder with nn.TransformerEncoder(..., enable_nested_tensor=False) (the fast path "
                "then runs on the padded batch and is captured), or run the step under "
                "torch.backends.mha.set_fastpath_enabled(False)")
    ov.has_torch_function = has_torch_function
    # Whether the padding is left-aligned is read from the mask's values; answering yes sends any
    # batch that could take the nested path to the refusal above, never to a different path.
    torch._nested_tensor_from_mask_left_aligned = lambda *a, **k: True
    torch._nested_tensor_from_mask = nested_from_mask
    if saved_mha is not None:
        activation._is_make_fx_tracing = lambda: False
    try:
        yield
    finally:
        ov.has_torch_function, torch._nested_tensor_from_mask_left_aligned, torch._nested_tensor_from_mask = saved
        if saved_mha is not None:
            activation._is_make_fx_tracing = saved_mha


# Host reads inside library code: what to change in the user's own code instead.
_LIBRARY_FIXES = (
    ("amp/grad_scaler.py", "GradScaler reads found_inf on the host for non-fused optimizers: use a fused "
                           "optimizer (e.g. AdamW(..., fused=True)), whose step takes the scaler's tensors"),
    ("nn/modules/transformer.py", "pass is_causal=True with a causal mask (encoder(x, mask=mask, is_causal=True), "
                                  "also for nn.Transformer / TransformerEncoderLayer / TransformerDecoder): PyTorch "
                                  "then does not compare the mask with a causal one on the host; or use "
                                  "host_reads='guard' (the default), which guards that comparison"),
)


def library_draw_fix(inside: str) -> str:
    """The fix for a random draw that decides something on the host inside library code
    (x-transformers' ``random() < layer_dropout``, ResidualVQ's quantize dropout, a torchvision
    augmentation in a forward): the generic fixes (draw it outside, pass it in) name code the
    user does not own."""
    return (f"the draw is inside {inside}, not your code: turn that randomness off in the library if the "
            "recipe allows (its layer-dropout / drop-path-by-layer / quantizer-dropout / augmentation "
            "option set to 0 or False, or the augmentation moved to the data pipeline), or keep the step "
            "eager and graph the modules that do not draw: block = stepgraph.graph_module(block) for each "
            "one, or stepgraph.graph_module(model), which runs a forward that draws eagerly and graphs "
            "its submodules")


def library_fix(inside: str, fix: str) -> str:
    """The fix for a problem found inside library code (``inside``: ``path:line``)."""
    for marker, known in _LIBRARY_FIXES:
        if marker in inside:
            return known
    return (f"{fix} (the read is inside {inside}: if you cannot change that code, call it outside "
            "the step, or capture the submodules around it instead of the whole step: "
            "model.backbone = stepgraph.graph_module(model.backbone))")


@contextlib.contextmanager
def record_scheduler_steps(calls: list, problems: list, stepped: list, before_step=None, assigned=None):
    """LR schedulers stepped inside the step (Hugging Face's loop: ``optimizer.step();
    lr_scheduler.step()``) are Python code a replay would skip: record each call, to be made
    again after every replay. Valid when no optimizer steps after it in the same call (the new
    lr is for the next call, as in eager); otherwise refused. ``assigned`` gets ``(group, key,
    value)`` for each param-group entry a scheduler set: the re-run scheduler sets it after each
    replay, so it is no constant of the graph (trackplan.hyper_effects)."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from ..errors import user_frame
    from .effects import Problem
    from . import nextlr
    # Schedulers whose own ``step`` replaces LRScheduler's (CosineAnnealingWarmRestarts,
    # SequentialLR, ChainedScheduler, a user's) are recorded too; only the outermost call is
    # (SequentialLR's inner schedulers are its business). ReduceLROnPlateau takes this call's
    # metric, which a replay cannot pass again: left to the host-read checks.
    classes, todo = [], [LRScheduler]
    while todo:
        c = todo.pop()
        todo.extend(c.__subclasses__())
        if "step" in vars(c) and not issubclass(c, ReduceLROnPlateau):
            classes.append(c)
    saved = [(c, vars(c)["step"]) for c in classes]
    depth = [0]

    def wrap(orig):
        def outer(self, *a, **k):
            if depth[0]:
                return orig(self, *a, **k)
            depth[0] += 1
            try:
                return step(orig, self, *a, **k)
            finally:
                depth[0] -= 1
        return outer

    def step(orig, self, *a, **k):
        mark, where = len(stepped), user_frame()
        if before_step is not None:
            before_step(self)   # (a failed capture puts the scheduler back: rollback.py)

        def check():
            if len(stepped) > mark:
                problems.append(Problem(
                    f"{type(self).__name__}.step() runs before an optimizer step in the same call: a replay "
                    "cannot change the lr between them", where, "step the scheduler after "
                    "optimizer.step() (as PyTorch recommends), or outside the step", plain=True))
        calls.append((self, a, k, check))
        # The scheduler computes next call's lr from this one: with the live values (HyperFloats)
        # in the groups, its arithmetic *and its epoch branch* would be recorded into the graph
        # (StepLR decaying at every replay). It runs on plain floats; what it leaves unchanged
        # stays live, what it changes is next call's value (read live where the step returns it).
        lives = _unlive(self.optimizer)
        before = [(g, dict(g)) for g in getattr(self.optimizer, "param_groups", ())]
        try:
            return orig(self, *a, **k)
        finally:
            for g, key, v, plain in lives:
                if g.get(key) == plain:
                    g[key] = v
            nextlr.mark(self, lives, where)   # (what it set is next call's value: read after a replay)
            if assigned is not None:
                assigned.extend((g, key, v) for g, old in before for key, v in g.items()
                                if key != "params" and v is not old.get(key))
    for c, orig in saved:
        c.step = wrap(orig)
    handle = register_optimizer_step_pre_hook(lambda opt, a, k: stepped.append(opt))
    try:
        yield
    finally:
        for c, orig in saved:
            c.step = orig
        handle.remove()
        for *_, check in calls:
            check()


def _unlive(opt) -> list:
    """Replace tracing floats in ``opt``'s groups by plain floats; (group, key, old, plain)."""
    from .hostscalar import HostFloat, _plain
    saved = []
    for g in getattr(opt, "param_groups", ()):
        for key, v in list(g.items()):
            if isinstance(v, HostFloat):
                plain = _plain(v)
            elif isinstance(v, tuple) and any(isinstance(x, HostFloat) for x in v):
                plain = tuple(_plain(x) if isinstance(x, HostFloat) else x for x in v)
            else:
                continue
            saved.append((g, key, v, plain))
            g[key] = plain
    return saved



def untraceable_modules(reg, device: str):
    """A ``CaptureError`` for a cuDNN RNN on CUDA (found before tracing; the caller runs the call
    eagerly, then raises it) with ``STEPGRAPH_CUDNN_RNN=refuse``, or by default ('auto') when it
    trains with dropout between layers. Otherwise such RNNs are captured as their decomposition
    (capture/rnns.py): tracing cuDNN's RNN itself hands make_fx its flattened weight buffer as an
    UntypedStorage (torch 2.11). The dropout masks cuDNN draws come from its own dropout state,
    which the decomposition cannot replay: measured on an H100, word_language_model's gradients
    then differed from eager's by 1.2 (relative), the same masks from PyTorch's generator."""
    import torch
    from .. import config
    from ..errors import CaptureError, user_frame
    mode = config.get("cudnn_rnn")
    if device != "cuda" or not torch.backends.cudnn.enabled or mode == "decompose":
        return None
    for name, m in [(f"{root}.{k}" if k else root, m) for root, mod in reg.modules for k, m in mod.named_modules()]:
        if isinstance(m, torch.nn.RNNBase) and any(p.is_cuda for p in m.parameters()):
            what = f"{name} ({type(m).__name__})"
            if mode != "refuse" and m.training and m.dropout > 0 and m.num_layers > 1:
                return CaptureError(
                    f"{what} trains with dropout={m.dropout} between its layers, which cuDNN draws "
                    "from its own dropout state: no graph can draw the masks eager draws\n  this call "
                    "ran eagerly to its end: your model and optimizer hold the result of this step",
                    op=f"cuDNN RNN dropout {what}", where=user_frame(),
                    fix="run the step with cuDNN off for RNNs (wrap the call in `with "
                    "torch.backends.cudnn.flags(enabled=False):`: eager and the graph then draw the "
                    "same masks), set STEPGRAPH_CUDNN_RNN=decompose (masks from PyTorch's generator: "
                    "statistically alike, not eager's), or keep this step eager (on_capture_error='eager')")
            if mode != "refuse":
                continue
            return CaptureError(
                f"{what} runs cuDNN's RNN kernel, which stepgraph cannot trace (it takes a flattened "
                "weight buffer the tracer does not handle)\n  this call ran eagerly to its end: your "
                "model and optimizer hold the result of this step", op=f"cuDNN RNN {what}",
                where=user_frame(), fix="unset STEPGRAPH_CUDNN_RNN=refuse (the RNN is then captured as "
                "matmuls, within fp tolerance of cuDNN), run the step with cuDNN off for RNNs (wrap "
                "the call in `with torch.backends.cudnn.flags(enabled=False):`), or keep this step "
                "eager (on_capture_error='eager')")
    return None


def scheduled_tensors(steps) -> list:
    """``(tensor, its value now)`` for each tensor hyper-parameter (a tensor lr, or the lr stepgraph
    holds on the GPU) of the optimizers that LR schedulers stepped in the step drive, taken before
    a replay. The graph writes this call's lr into them (``group['lr'].fill_``, recorded: a read of
    it later in the step, a print, is the graph's) and the scheduler run again after the replay
    computes it again from the group: from the value before, put back first (from the graph's,
    ExponentialLR / StepLR / CosineAnnealingLR stepped twice per call, silently -- on every
    Adam/AdamW on CUDA, where the lr is such a tensor)."""
    out = []
    for sched, *_ in steps:
        opt = sched.optimizer if isinstance(sched, torch.optim.lr_scheduler.LRScheduler) else None
        for g in opt.param_groups if opt is not None else ():
            out += [(v, v.detach().clone()) for k, v in g.items()
                    if k != "params" and isinstance(v, torch.Tensor) and v.dim() == 0]
    return out
