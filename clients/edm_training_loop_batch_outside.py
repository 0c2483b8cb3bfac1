"""clients/edm_training_loop_tensordataset.py with its batches taken outside the step: the loop calls
``next(dataset_iterator)`` once per accumulation round and passes the list to the step (the fix a
user applies where a loader's ``next()`` in the step would replay one batch); everything else as
there."""
from clients.edm_training_loop import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.edm_training_loop import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, batch_outside=True, tensor_dataset=True)
