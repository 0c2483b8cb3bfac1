# Restates PyTorch-GAN's CycleGAN utils.py (the ReplayBuffer image pool and the LambdaLR decay):
#   https://github.com/eriklindernoren/PyTorch-GAN/blob/36d3c77e5ff20ebe0aeefd322326a134a279b93e/implementations/cyclegan/utils.py
# Copyright (c) 2018 Erik Linder-Norén. MIT License (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. The pool keeps its images in ``self.data`` (a list it appends to, then
# overwrites) and draws with Python's global ``random`` (``uniform(0, 1)``, then ``randint``), as
# the source does: clients/cyclegan.py's outcome depends on both.
import random

import torch
from torch.autograd import Variable


class ReplayBuffer:
    """Image pool of Shrivastava et al.: the discriminators see a mix of this step's fakes and
    fakes kept from earlier steps."""

    def __init__(self, max_size=50):
        assert max_size > 0, "the pool needs room for at least one image"
        self.max_size = max_size
        self.data = []

    def push_and_pop(self, data):
        picked = []
        for image in data.data:
            image = torch.unsqueeze(image, 0)
            if len(self.data) < self.max_size:
                # still filling: keep it and hand it back
                self.data.append(image)
                picked.append(image)
            elif random.uniform(0, 1) > 0.5:
                # swap: hand back a stored image, keep the new one in its slot
                slot = random.randint(0, self.max_size - 1)
                picked.append(self.data[slot].clone())
                self.data[slot] = image
            else:
                picked.append(image)
        return Variable(torch.cat(picked))


class LambdaLR:
    """Multiplier for torch's LambdaLR: 1 until ``decay_start_epoch``, then linear to 0 at
    ``n_epochs`` (``offset``: the epoch training resumes from)."""

    def __init__(self, n_epochs, offset, decay_start_epoch):
        assert (n_epochs - decay_start_epoch) > 0, "the decay must start before training ends"
        self.n_epochs = n_epochs
        self.offset = offset
        self.decay_start_epoch = decay_start_epoch

    def step(self, epoch):
        decay_epochs = self.n_epochs - self.decay_start_epoch
        return 1.0 - max(0, epoch + self.offset - self.decay_start_epoch) / decay_epochs
