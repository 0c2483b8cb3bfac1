"""torchvision references/segmentation/train.py with ``--amp`` (the versions that have it):
``scaler = torch.cuda.amp.GradScaler() if args.amp else None``, the forward and criterion under
``autocast(enabled=scaler is not None)`` (float16), then ``scaler.scale(loss).backward()``,
``scaler.step(optimizer)``, ``scaler.update()``. The model, data and the rest of the loop are
``torchvision_segmentation``'s (see its docstring); here the scaler is ``torch.amp.GradScaler``
of the run's device and the autocast float16 on it (the CPU has both), so a step whose fp16
gradients overflow is skipped and the scale halved, as on CUDA.
"""
from clients import torchvision_segmentation as base

SOURCE = base.SOURCE
LICENSE = base.LICENSE
TAGS = base.TAGS + ("grad-scaler", "autocast-fp16", "skip-on-inf")


def main(sg, steps=8, device="cpu", amp=None):
    base.args.amp = True
    try:
        base.main(sg, steps=steps, device=device, amp=amp)
    finally:
        base.args.amp = False
