"""CPU arguments a CUDA step moves to the GPU itself (``x, y = x.to(device), y.to(device)`` on a
DataLoader batch): the runtime moves them before the graph runs.

A CUDA graph cannot hold that host-to-device copy: it would copy the capture's bytes at every
replay (so the trace used to refuse it as "CPU work in a CUDA step", and the user had to move
the batch out of the step). Instead the argument is moved at each call before the graph, as
eager's own copy does (``CapturedStep.to_device``), and the graph's static buffer for it is a
device tensor. The graph keeps its ``_to_copy`` (now device to device: a dtype change it made
stays, and it computes the same on either tensor).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..errors import NeedsReplay


@dataclass(frozen=True)
class MovedArgument:
    index: int             # position among the graph's inputs (the call's tensors come first)
    device: torch.device   # where the step moves it


def moved_arguments(gm: fx.GraphModule, n_args: int, example: list) -> list[MovedArgument]:
    """The call's CPU tensors whose only uses in the graph are copies to one device."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][:n_args]
    out = []
    for i, ph in enumerate(placeholders):
        x = example[i]
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            continue
        moves = [u for u in ph.users if u.target is torch.ops.aten._to_copy.default
                 and isinstance(u.meta.get("val"), torch.Tensor) and u.meta["val"].device.type != "cpu"]
        if not moves:
            continue
        devices = {u.meta["val"].device for u in moves}
        if len(moves) != len(ph.users) or len(devices) != 1:
            raise NeedsReplay(
                f"argument tensor #{i} (on the CPU) is moved to {sorted(map(str, devices))} and also used "
                "otherwise in the step: a CUDA graph would copy only the capture's values",
                op="Tensor.to", where="the step function",
                fix="move it to the GPU before the step, or use only its moved copy in the step")
        out.append(MovedArgument(i, devices.pop()))
    return out
