"""clients/cyclegan.py with the fix its CLEAR-ERROR names applied: the image pool
(``fake_A_buffer.push_and_pop(fake_A)``, which appends to ``self.data`` and, once full, swaps with
host ``random``) is used in the loop, outside the step. The per-batch body is split there into two
steps, the generators' update (returning ``fake_A`` and ``fake_B``) and both discriminators'
updates (taking the pool's ``fake_A_`` and ``fake_B_``); their statements as in cyclegan.py. The
pool keeps the generator step's returned images across steps, as the program does."""
from clients.cyclegan import LICENSE, SOURCE, TAGS  # noqa: F401
from clients.cyclegan import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, pool_in_step=False)
