"""clients/nerf_pytorch.py with the fix its CLEAR-ERROR names applied: the lego config's random ray batch (``np.random.choice`` of the image and of the pixels, the centre crop) is drawn in the loop and ``batch_rays, target_s`` are passed to the step; everything else as there."""
from clients.nerf_pytorch import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.nerf_pytorch import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, rays_outside=True)
