"""clients/qat_mobilenet.py with the fix its CLEAR-ERROR names applied: the loss meter is updated
with ``loss.detach()`` (``avgloss.update(loss.detach(), image.size(0))``) instead of the loss tensor
with its grad_fn, so the meter's running sum no longer chains each step's autograd graph onto the
last; everything else (fake-quant observers updating in the step, ``disable_observer`` and
``freeze_bn_stats`` between epochs, ``convert`` and evaluation) as there."""
from clients.qat_mobilenet import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.qat_mobilenet import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, detach_meter=True)
