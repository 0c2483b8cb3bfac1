"""clients/nerf_pytorch.py with the llff config's ray batching: the step slices ``rays_rgb[i_batch:i_batch+N_rand]``, advances ``i_batch`` and, at the end of the rays, reshuffles ``rays_rgb = rays_rgb[torch.randperm(...)]`` (nonlocal rebinds), with raw_noise_std 1.0 (``torch.randn`` in raw2outputs)."""
from clients.nerf_pytorch import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.nerf_pytorch import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, batching=True)
