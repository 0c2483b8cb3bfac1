"""Stand-in for ``torch.utils.tensorboard.SummaryWriter`` as simclr.py uses it (``log_dir`` and
``add_scalar``): a temporary run directory, scalars kept in memory. Not vendored code."""
import tempfile


class SummaryWriter:
    def __init__(self, log_dir=None):
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="simclr_runs_")
        self.scalars = []

    def add_scalar(self, tag, value, global_step=None):
        self.scalars.append((tag, value, global_step))
