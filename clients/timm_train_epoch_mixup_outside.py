"""clients/timm_train_epoch.py with the fix its CLEAR-ERROR names applied: ``input, target =
mixup_fn(input, target)`` (numpy.random draws: lam, mixup-or-cutmix, the cutmix box) moved out of
the step into the loop, just before the call, so the step gets the mixed batch and soft targets as
arguments; everything else (SoftTargetCrossEntropy, ModelEmaV3 via task.update_ema, NativeScaler
with clip_grad, per-update cosine schedule, ``loss.item()`` meter) as there."""
from clients.timm_train_epoch import LICENSE, SOURCE, TAGS  # noqa: F401
from clients.timm_train_epoch import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, mixup_in_step=False)
