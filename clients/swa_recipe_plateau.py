"""clients/swa_recipe.py with ReduceLROnPlateau(optimizer) as the pre-SWA scheduler, stepped between epochs with a validation loss (``scheduler.step(val_loss)``); the compiled per-batch step as there."""
from clients.swa_recipe import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.swa_recipe import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, plateau=True)
