# Restates DINOLoss of facebookresearch/dino's main_dino.py (the rest of that script, argparse,
# train_dino, train_one_epoch and the augmentations, is not here: clients/dino.py reproduces the
# loop):
#   https://github.com/facebookresearch/dino/blob/7c446df5b9f45747937fb0d72314eb9f7b66930a/main_dino.py
# Copyright (c) Facebook, Inc. and its affiliates. Apache License 2.0 (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. Kept as in the source because the corpus exercises it: the ``center``
# buffer is rebound (``self.center = ...``, not updated in place) after a ``dist.all_reduce`` of
# the batch center; the teacher temperature is a numpy schedule indexed by epoch; the loss is
# accumulated from a Python 0 and divided in place.
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class DINOLoss(nn.Module):
    """Cross-entropy between the centered, sharpened teacher distribution of each global crop and
    the student's distribution of every other crop."""

    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp,
                 warmup_teacher_temp_epochs, nepochs, student_temp=0.1,
                 center_momentum=0.9):
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        # a lower teacher temperature early on keeps the start of training stable
        warmup = np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs)
        rest = np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp
        self.teacher_temp_schedule = np.concatenate((warmup, rest))

    def forward(self, student_output, teacher_output, epoch):
        student = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher = F.softmax((teacher_output - self.center) / temp, dim=-1)
        teacher = teacher.detach().chunk(2)

        total, terms = 0, 0
        for t_idx, q in enumerate(teacher):
            for s_idx, s in enumerate(student):
                if s_idx == t_idx:   # same view for teacher and student: skipped
                    continue
                total += torch.sum(-q * F.log_softmax(s, dim=-1), dim=-1).mean()
                terms += 1
        total /= terms
        self.update_center(teacher_output)
        return total

    @torch.no_grad()
    def update_center(self, teacher_output):
        """EMA of the teacher outputs' mean over the whole (all-reduced) batch."""
        summed = torch.sum(teacher_output, dim=0, keepdim=True)
        dist.all_reduce(summed)                                   # over every process's batch
        mean = summed / (len(teacher_output) * dist.get_world_size())
        m = self.center_momentum
        # a rebind of the registered buffer (Module.__setattr__ replaces it), not an in-place update
        self.center = self.center * m + mean * (1 - m)
