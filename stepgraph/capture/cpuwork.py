"""CPU work inside a CUDA step: which ops compute on CPU tensors (a CUDA graph would run them
only once, at capture) and which are not work of that kind (an argument copied to the device,
attention's RNG seed/offset, empty placeholders). Asked by modes._DispatchCheckMode."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .effects import _is_traced


# CUDA attention kernels hand their dropout RNG seed/offset from forward to backward as 0-dim
# CPU tensors when not capturing, and as device tensors while a CUDA graph records (the philox
# state then comes from the graph's generator): not host work, so not a reason to fall back.
_ATTENTION_RNG_OPS = frozenset(
    getattr(torch.ops.aten, name).default for name in (
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_efficient_attention_forward", "_efficient_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward")
    if hasattr(torch.ops.aten, name))


def _argument_to_device(func, args, out) -> bool:
    """``x.to("cuda")`` of a CPU tensor the step was called with (a DataLoader batch moved in the
    step): not CPU work, the runtime moves that argument before the graph as eager's copy does
    (pipeline.arguments_to_device, ``CapturedStep.to_device``)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot, has_proxy_slot
    if func is not torch.ops.aten._to_copy.default or not isinstance(out, torch.Tensor) or out.device.type == "cpu":
        return False
    a, mode = args[0], get_proxy_mode()
    return (mode is not None and isinstance(a, torch.Tensor) and a.device.type == "cpu"
            and a.layout == torch.strided and has_proxy_slot(a, mode.tracer)
            and get_proxy_slot(a, mode.tracer).proxy.node.op == "placeholder")


def _cpu_work(func, args, kwargs, out) -> str | None:
    """In a CUDA step: ``"tensor"`` for an op computing on CPU tensors with data, ``"scalar"`` for
    one touching only 0-dim CPU tensors (host scalars such as step counters), else None."""
    if func in (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default):
        return None  # torch.tensor(...) constants: fixed values, fine to bake
    if func in _ATTENTION_RNG_OPS:
        return None
    if func is torch.ops.aten._to_copy.default and args and isinstance(args[0], torch.Tensor) \
            and args[0].device.type != "cpu":
        # a device value copied to the host (``loss.detach().cpu()``): the torch-function mode
        # noted it, and tohost.py moves it out of the graph or refuses it at its line. Counted
        # as host work it made every such CUDA step replay-only (H200: NeedsHostScalars).
        return None
    # Empty CPU tensors hold no data (torch.utils.checkpoint allocates such placeholders).
    cpu = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.device.type == "cpu"
           and o.numel() > 0]
    # CPU inputs count when the step computed them, or when they hold data (not a 0-dim value).
    cpu += [a for a in pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.numel() > 0
            and (_is_traced(a) or a.dim() > 0) and not _literal(a)]
    if not cpu:
        return None
    return "scalar" if all(t.dim() == 0 for t in cpu) else "tensor"


_LIFTS = (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default)


def _literal(a) -> bool:
    """A 0-dim CPU tensor of a Python literal the step's code wrote (``true_dist[:, pad] = 0``,
    ``torch.where(m, x, 0.)``: traced as ``fill_.Tensor`` / ``where`` on a lifted constant): its
    value never changes, and a CUDA kernel reads it on the host as a scalar; a CUDA graph then
    keeps it, as it keeps any literal. Counted as host work, the Annotated Transformer's label
    smoothing made its CUDA step replay-only (H200)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot, has_proxy_slot
    mode = get_proxy_mode()
    return (a.dim() == 0 and mode is not None and has_proxy_slot(a, mode.tracer)
            and get_proxy_slot(a, mode.tracer).proxy.node.target in _LIFTS)
