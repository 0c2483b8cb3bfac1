"""yolov5_loss with the warmup moved out of the step: the loop computes ``ni`` and runs train.py's
warmup block (``np.interp`` of ``accumulate`` and of each group's ``lr`` / ``momentum``) before
calling the step, which keeps the rest of the per-batch body (forward and ComputeLoss under the
disabled autocast, ``scaler.scale(loss).backward()``, the ``ni - last_opt_step >= accumulate``
update with unscale / clip / scaler.step / update / zero_grad / EMA, the ``mloss`` running mean).
This is the workaround a user reaches for when stepgraph cannot capture ``np.interp`` over the
loop's numbers inside the step (clients/yolov5_loss.py runs eagerly with stepgraph's "please
report this" warning). Everything else is clients/yolov5_loss.py.

Source: https://github.com/ultralytics/yolov5/blob/6a048c5fa5bbde3f077f0a0fa0662582cdf29d32/train.py
(AGPL-3.0). Variant of clients/yolov5_loss.py.
"""
from clients import yolov5_loss

SOURCE = "https://github.com/ultralytics/yolov5/blob/6a048c5fa5bbde3f077f0a0fa0662582cdf29d32/train.py"
LICENSE = "AGPL-3.0"
DEVICES = ("cpu",)
TAGS = yolov5_loss.TAGS + ("fix-applied",)


def main(sg, steps=8, device="cpu", amp=None):
    yolov5_loss.main(sg, steps=steps, device=device, amp=amp, warmup_in_step=False)
