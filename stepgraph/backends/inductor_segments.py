"""``inductor`` for a step that reads values on the host: each segment between the reads fused.

A host read (``return loss.item()``, ``if not torch.isfinite(loss):``, a meter's
``sum += loss.item() * n``, a live number fed to an op) cuts the step into segments
(segments.py: the same split, host work and guards as the ``cudagraph`` backend's). Here each
segment is compiled by Inductor (its state lifted to inputs, as inductor.py does for the whole
step) and the host work runs between them:

* on the CPU a segment is a call of its fused code; what a later segment reads from it is
  copied into the static buffer that segment was compiled against, the rest is handed on as is;
* on CUDA a segment's first call runs its fused code directly (Inductor's kernels load and
  autotune on their first run, which no recording may hold), then it is recorded into a CUDA
  graph that writes its static outputs: later calls replay it with one launch.

The compile is in-process, in the capturing call (no background compile, no switch): a
segmented step has several small graphs. A segment Inductor cannot compile runs unfused (the
replay backend's code), said once.
"""
from __future__ import annotations

import logging
import warnings

import torch
from torch import fx

from ..passes.alpha import fold_alpha
from . import CompileRequest
from .cudagraph import capture_graph
from .hostops import static_like
from .inductor import _compile, lift_state
from .segments import compile_segmented, replay_segment_fn

log = logging.getLogger("stepgraph")


def _fixed_into_graph(module: fx.GraphModule, args: list) -> tuple[fx.GraphModule, list[int]]:
    """The segment with its non-tensor inputs (values a guard fixed) written in as constants;
    the positions of the tensor inputs it still takes."""
    g = fx.Graph()
    env: dict = {}
    out = g.graph_copy(module.graph, env)
    g.output(out)
    keep = []
    for i, ph in enumerate([n for n in g.nodes if n.op == "placeholder"]):
        if isinstance(args[i], torch.Tensor):
            keep.append(i)
            continue
        for u in list(ph.users):
            u.args = fx.map_arg(u.args, lambda x, ph=ph, v=args[i]: v if x is ph else x)
            u.kwargs = fx.map_arg(u.kwargs, lambda x, ph=ph, v=args[i]: v if x is ph else x)
        g.erase_node(ph)
    g.lint()
    return fx.GraphModule(module, g), keep


def _fused(module: fx.GraphModule, args: list, cuda: bool, failed: list):
    """The segment's callable: Inductor's code over (its tensor inputs, its lifted state)."""
    gm, keep = _fixed_into_graph(module, args)
    lifted, state = lift_state(gm)
    fold_alpha(lifted)  # (inductor.py: Inductor's addmm pattern drops alpha)
    state_in = [t.detach() for t in state]
    try:
        compiled = _compile(lifted, [args[i] for i in keep] + state_in, cuda)
    except Exception as e:  # noqa: BLE001 - this segment runs unfused, said below
        failed.append(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
        return replay_segment_fn(module, args)

    def fn(*a):
        return compiled(*[a[i] for i in keep], *state_in)
    if cuda:
        return fn
    return _checked_at_first_call(module, args, fn)


def _checked_at_first_call(module: fx.GraphModule, args: list, fused):
    """CPU: the segment's first call is checked against its unfused code on the same state, as a
    background compile is at its switch (verify.py); beyond tolerance (or NaN where the unfused
    code has none) the segment runs unfused from then on, warned. lora_finetune's fused segment
    gave NaN from its first call."""
    from .. import config
    from .verify import FusedCheck, random_draws
    if not config.get("inductor_verify"):
        return fused
    unfused = replay_segment_fn(module, args)
    check = [FusedCheck.plan(module, args, random_draws(module))]
    run = [fused]

    def fn(*a):
        if not check:
            return run[0](*a)
        out, parity = check.pop().run(list(a), lambda ins: unfused(*ins), lambda ins: fused(*ins))
        if parity.diverged or parity.error:
            run[0] = unfused
            msg = (f"stepgraph: an Inductor-fused segment did not match its unfused code "
                   f"({parity.describe()}); that segment runs unfused from now on (eager's kernels)")
            warnings.warn(msg, stacklevel=2)
            log.warning(msg)
        return out
    return fn


class _HostSegment:
    """CPU: a segment's "replay" runs its fused code; outputs a later segment reads (``feeds``)
    are copied into the static buffers it was compiled against, the rest are returned fresh."""

    def __init__(self, fn, args, outs):
        self.fn, self.args, self.outs, self.feeds = fn, args, outs, range(len(outs))

    def replay(self):
        res = list(self.fn(*self.args))
        for k in self.feeds:
            res[k] = _copy_into(self.outs[k], res[k])
        return res


class _RecordedAfterFirstRun:
    """CUDA: the first replay runs the fused code into the static outputs, then records that
    into a CUDA graph (in the step's pool); later replays launch the graph."""

    def __init__(self, fn, args, outs, pool):
        self.fn, self.args, self.outs, self.pool, self.graph = fn, args, outs, pool, None

    def _into_outs(self, *a):
        for s, o in zip(self.outs, self.fn(*a)):
            _copy_into(s, o)
        return self.outs

    def replay(self):
        if self.graph is not None:
            self.graph.replay()
            return None
        self._into_outs(*self.args)
        if self.graph is None:
            try:
                self.graph, _ = capture_graph(self._into_outs, self.args, self.pool)
            except Exception as e:  # noqa: BLE001 - this call's segment ran; later ones run un-recorded
                msg = ("stepgraph: an Inductor-fused segment could not be recorded into a CUDA graph; it "
                       f"runs without one from now on (same results): {type(e).__name__}: {str(e).strip()[:300]}")
                warnings.warn(msg, stacklevel=2)
                log.warning(msg)
                self.graph = _Direct(self)
        return None


class _Direct:
    """A segment left un-recorded: each replay runs its fused code."""

    def __init__(self, seg: _RecordedAfterFirstRun):
        self._seg = seg

    def replay(self):
        self._seg._into_outs(*self._seg.args)


def _static_like(v, device):
    if isinstance(v, torch.Tensor):
        if device is not None and v.device.type == "cpu":
            # (SDPA's dropout seed and offset: 0-dim CPU tensors when run directly, device ones
            # inside a recording; the recorded segment and the next one's compile see the latter)
            return static_like(v.to(device))
        return static_like(v)
    if isinstance(v, (list, tuple)):   # a multi-output op (split, native_layer_norm) read later
        return type(v)(_static_like(x, device) for x in v)
    return None


def _static_outputs(outputs: list, device) -> list:
    return [_static_like(o.meta.get("val"), device) for o in outputs]


def _copy_into(static, value):
    """``value`` written into ``static`` (a tensor, or a tuple of them); what a reader gets."""
    if isinstance(static, torch.Tensor):
        static.copy_(value)
        return static
    if isinstance(static, (list, tuple)):
        return type(static)(_copy_into(s, v) for s, v in zip(static, value))
    return value


def compile_inductor_segmented(gm: fx.GraphModule, example_inputs, request: CompileRequest):
    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs) or any(
        isinstance(getattr(gm, n.target, None), torch.Tensor) and getattr(gm, n.target).is_cuda
        for n in gm.graph.nodes if n.op == "get_attr")
    failed: list = []

    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda),
                  torch.device("cuda")) if cuda else None

    def record(fn, args, pool, outputs):
        outs = _static_outputs(outputs, device)
        seg = _RecordedAfterFirstRun(fn, args, outs, pool) if cuda else _HostSegment(fn, args, outs)
        return seg, outs

    run = compile_segmented(gm, example_inputs, request,
                            segment_fn=lambda m, a: _fused(m, a, cuda, failed), record=record)
    run.segment_kind = ("Inductor-fused segments: {n} (each a CUDA graph from its second run)" if cuda
                        else "Inductor-fused segments: {n}")
    if not cuda:
        for i, seg in enumerate(run.segments):
            later = {x for s in run.segments[i + 1:] for x in s.inputs}
            seg.graph.feeds = [k for k, o in enumerate(seg.outputs) if o in later]
    if failed:
        msg = (f"stepgraph: Inductor could not fuse {len(failed)} of the step's {len(run.segments)} "
               f"segments; they run unfused (same results as backend='replay'): {failed[0]}")
        warnings.warn(msg, stacklevel=6)
        log.warning(msg)
    log.info("stepgraph: backend='inductor' fused the step as %d segments between its host reads",
             len(run.segments))
    return run
