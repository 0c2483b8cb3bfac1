"""clients/dpsgd_per_sample_grads.py with torch.optim.Adam(lr=1e-3) taking the noised, clipped per-sample gradients instead of SGD."""
from clients.dpsgd_per_sample_grads import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.dpsgd_per_sample_grads import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, optim="adam")
