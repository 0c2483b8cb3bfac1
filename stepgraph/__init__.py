"""stepgraph: a whole PyTorch training step — forward, backward, optimizer — as one graph.

Example::

    import torch, torch.nn.functional as F, stepgraph

    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @stepgraph.compile
    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(5):
        loss = train_step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    print(train_step.stats)   # eager_calls=1 captures=1 replays=3
"""
from __future__ import annotations

from .errors import CaptureError, StepGraphError
from .runtime import Stats, StepFunction
from .partial import GraphedModule, graph_module

__version__ = "0.1.0"


def compile(fn=None, *, backend: str = "auto", warmup: int = 1, max_captures: int = 8,
            state=(), on_capture_error: str = "raise", clone_outputs: bool = True, check=0,
            host_reads: str = "guard"):
    """Capture ``fn`` — a whole training step — as one graph, replayed on later calls.

    Call 1 (``warmup`` calls) runs eagerly so optimizer state exists; the next call traces
    the step at the aten level *while running it* and returns its real result; later calls
    with the same guard signature replay the graph. Modules and optimizers are found from
    ``fn``'s closure and globals; pass others in ``state=[model, opt]``.

    Args:
        backend: ``"auto"`` (CUDA graph on GPU, ``"replay"`` on CPU), ``"replay"``, ``"cudagraph"``,
            or ``"inductor"`` (the whole step fused by TorchInductor, compiled in a background
            process while the unfused graph runs; fp tolerance instead of bitwise).
        warmup: eager calls before the first capture.
        max_captures: graphs kept (one per guard signature); past it, new signatures run
            eagerly with one warning.
        on_capture_error: ``"raise"`` (default) or ``"eager"``: fall back for good; the failing
            call returns its eager result with one warning when it ran to its end (a refused
            step), and raises only when the failure stopped it midway.
        clone_outputs: with the CUDA-graph backend, returned tensors are copies (default), so
            later replays never overwrite them; ``False`` returns the graph's static output
            buffers (zero-copy: valid until the next call).
        host_reads: ``"guard"`` (default): a value the step reads on the host (``loss.item()``,
            ``if torch.isfinite(loss):``) is read again at each replay; returned or used in
            arithmetic it is live, and where Python branches on it the graph checks it is the
            value seen at capture (a different one undoes the graph's writes and captures that
            call for the new value). ``"error"``: any host read is a ``CaptureError``.
        check: for the first ``check`` replays (``True``: 3; also ``STEPGRAPH_CHECK=1``) also run
            the step eagerly from the same state and report the first tensor that diverges
            (``stats.check_reports``; eager's result is kept).

    Example::

        step = stepgraph.compile(train_step)            # or @stepgraph.compile(backend="replay")
    """
    def wrap(f):
        return StepFunction(f, backend=backend, warmup=warmup, max_captures=max_captures,
                            state=state, on_capture_error=on_capture_error, clone_outputs=clone_outputs, host_reads=host_reads,
                            check=check)
    return wrap(fn) if fn is not None else wrap


__all__ = ["compile", "StepFunction", "Stats", "StepGraphError", "CaptureError", "graph_module", "GraphedModule"]
