# Restates ``accuracy`` of sthalles/SimCLR's utils.py (the rest of that file, checkpoint and
# config writing, is not used):
#   https://github.com/sthalles/SimCLR/blob/1848fc934ad844ae630e6c452300433fe99acfd9/utils.py
# Copyright (c) 2020 Thalles Silva. MIT License (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text.
import torch


def accuracy(output, target, topk=(1,)):
    """Top-k accuracies in percent, one 1-element tensor per k in ``topk``."""
    with torch.no_grad():
        n = target.size(0)
        _, ranked = output.topk(max(topk), 1, True, True)
        hits = ranked.t().eq(target.view(1, -1).expand_as(ranked.t()))   # (maxk, n)
        return [hits[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / n) for k in topk]
