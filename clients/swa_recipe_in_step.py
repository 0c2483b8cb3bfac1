"""clients/swa_recipe.py with the SWA update and both schedulers moved into the per-batch step (per-iteration averaging): ``if epoch > swa_start: swa_model.update_parameters(model); swa_scheduler.step() else: scheduler.step()`` inside the compiled step, ``epoch`` passed in."""
from clients.swa_recipe import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.swa_recipe import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, in_step=True)
