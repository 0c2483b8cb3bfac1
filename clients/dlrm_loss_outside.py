"""clients/dlrm.py with the fix its CLEAR-ERROR names applied: the step returns the loss tensor
``E`` and ``L = E.detach().cpu().numpy()`` runs in the loop, after the call; everything else
(sparse EmbeddingBag gradients and dense MLP gradients under one SGD, LRPolicyScheduler stepped
in the step) as there."""
from clients.dlrm import LICENSE, SOURCE, TAGS  # noqa: F401
from clients.dlrm import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, numpy_in_step=False)
