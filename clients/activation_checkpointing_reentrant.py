"""``activation_checkpointing`` (timm train.py ``--grad-checkpointing`` on a ViT with dropout and
DropPath inside the checkpointed blocks) with timm's reentrant flag set (``set_reentrant_ckpt(True)``,
the ``TIMM_REENTRANT_CKPT`` switch): ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``,
the autograd.Function form that reruns the block under ``torch.enable_grad()`` in backward."""
from clients import activation_checkpointing as base

SOURCE, LICENSE = base.SOURCE, base.LICENSE
TAGS = base.TAGS + ("use-reentrant",)


def main(sg, steps=8, device="cpu", amp=None):
    base.main(sg, steps=steps, device=device, amp=amp, reentrant=True)
