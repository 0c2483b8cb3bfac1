"""clients/word2vec_sgns.py with the fix its CLEAR-ERROR names applied: torch.optim.SparseAdam
keeps its step count as a Python int, so ``optimizer.step()`` moves out of the compiled step to
just after the call; the step keeps ``zero_grad()``, the forward and ``backward()`` (whose
gradients are sparse). Everything else as there."""
from clients.word2vec_sgns import LICENSE, SOURCE, TAGS  # noqa: F401
from clients.word2vec_sgns import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, sparse_adam_in_step=False)
