"""clients/wgan_gp.py with the fix its CLEAR-ERROR names applied: the host draws (``z`` from
``np.random.normal`` in the loop body, ``alpha`` from ``np.random.random`` in
``compute_gradient_penalty``) made in the loop just before the call and passed as arguments; the
penalty is compute_gradient_penalty with its ``alpha`` line moved to the caller (``penalty_at``,
the restated function's body after the draw; everything else, the ``autograd.grad(...,
create_graph=True)`` double backward, the ``i % n_critic`` branch and the ``batches_done``
counter, as there)."""
from clients.wgan_gp import LICENSE, SOURCE, TAGS  # noqa: F401
from clients.wgan_gp import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, noise_in_step=False)
