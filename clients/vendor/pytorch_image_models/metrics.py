# Vendored verbatim (excerpt) from https://github.com/huggingface/pytorch-image-models/blob/aa4b5850/timm/utils/metrics.py (lines 1-23: AverageMeter)
# Copyright 2019 Ross Wightman. Apache License 2.0 (see LICENSE beside this file).
""" Eval metrics and related

Hacked together by / Copyright 2020 Ross Wightman
"""


class AverageMeter:
    """Computes and stores the average and current value"""
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count if self.count else 0
