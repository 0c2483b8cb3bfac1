"""clients/dpsgd_per_sample_grads.py with the DP noise drawn from a torch.Generator the program seeds and owns (``torch.normal(0, std, size=p.shape, generator=noise_generator)``), a separate noise stream as DP code keeps one."""
from clients.dpsgd_per_sample_grads import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.dpsgd_per_sample_grads import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, noise_gen=True)
