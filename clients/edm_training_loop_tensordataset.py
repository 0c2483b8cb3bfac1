"""clients/edm_training_loop.py with the images held in a ``torch.utils.data.TensorDataset``
(uint8 tensors; the DataLoader's collate stacks tensor rows) instead of training/dataset.py's
numpy items; ``next(dataset_iterator)`` stays inside the step as the program writes it;
everything else as there."""
from clients.edm_training_loop import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.edm_training_loop import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, tensor_dataset=True)
