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


def move_arrays(gm: fx.GraphModule, positions: list[int]) -> None:
    """numpy array arguments (capture/arrays.py) that a CUDA step uses only to index device
    tensors or to copy to the device (``b_obs[mb_inds]``, ``torch.as_tensor(a, device=...)``):
    the array's CPU-side uses (make_fx's copy, casts, views) move with it to the device, behind
    one ``_to_copy`` that :func:`moved_arguments` then moves before the graph, as for a batch
    the step moves itself. ``positions``: the arrays' places among the graph's inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i in positions:
        ph = placeholders[i]
        cpu = _cpu_closure(ph)
        if cpu is None:
            continue
        cpu, device = cpu
        with gm.graph.inserting_after(ph):
            moved = gm.graph.call_function(torch.ops.aten._to_copy.default, (ph,), {"device": device})
        moved.meta["val"] = _on(ph.meta.get("val"), device)
        ph.replace_all_uses_with(moved, delete_user_cb=lambda u: u is not moved)
        for n in cpu:
            n.meta.pop("stepgraph_host", None)
            n.meta["val"] = _on(n.meta.get("val"), device)
    gm.recompile()


def _cpu_closure(ph):
    """(the CPU nodes computed from ``ph`` alone, the one device their results feed), or None."""
    cpu, devices, todo = set(), set(), [ph]
    while todo:
        for u in todo.pop().users:
            v = u.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return None   # (a host read of it, a tuple: left as it is)
            if v.device.type != "cpu":
                devices.add(v.device)
            elif u not in cpu:
                cpu.add(u)
                todo.append(u)
    for n in cpu:
        for a in n.all_input_nodes:
            v = a.meta.get("val")
            if a is not ph and a not in cpu and isinstance(v, torch.Tensor) and v.device.type == "cpu":
                return None   # (it meets other CPU tensors)
    return (cpu, devices.pop()) if len(devices) == 1 else None


def _on(v, device):
    """Metadata of ``v`` on ``device``."""
    if not isinstance(v, torch.Tensor):
        return v
    mode = getattr(v, "fake_mode", None)
    if mode is not None:
        with mode:
            return v.to(device)
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)


_INDEX_OPS = frozenset((torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor, torch.ops.aten.index_put.default,
                        torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default))


def constants_to_device(gm: fx.GraphModule) -> int:
    """CPU constants (``li = torch.tensor([...])`` in the step, capture/constfold.py) that only
    index device tensors, alone or through CPU ops on themselves (DLRM's ``Z[:, li, lj]``): eager
    copies them to the device at each call; being constants, they are copied once, here, and
    the graph holds them there (a CUDA graph would otherwise record a copy from pageable host
    memory). Returns how many moved."""
    moved = 0
    for n in list(gm.graph.nodes):
        if n.op != "get_attr":
            continue
        value = getattr(gm, n.target, None)
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.dim() == 0:
            continue
        found = _cpu_closure(n)
        if found is None:
            continue
        cpu, device = found
        ends = {u for m in cpu | {n} for u in m.users if u not in cpu}
        if not ends or not all(u.target in _INDEX_OPS for u in ends):
            continue
        setattr(gm, n.target, value.to(device))
        n.meta["val"] = _on(n.meta.get("val"), device)
        for m in cpu:
            m.meta.pop("stepgraph_host", None)
            m.meta["val"] = _on(m.meta.get("val"), device)
            for k, v in list(m.kwargs.items()):   # (lift_fresh_copy, clone: no device argument)
                if k == "device":
                    m.update_kwarg(k, device)
        moved += 1
    if moved:
        gm.recompile()
    return moved
