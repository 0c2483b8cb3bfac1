# Vendored verbatim (excerpt) from https://github.com/huggingface/pytorch-image-models/blob/aa4b5850/timm/optim/_param_groups.py (lines 1-78)
# Copyright 2019 Ross Wightman. Apache License 2.0 (see LICENSE beside this file).
# Import line replaced: 8 `from timm.models import group_parameters` (layer-decay only) -> removed.
import fnmatch
import logging
from itertools import islice
from typing import Collection, Optional

from torch import nn as nn



_logger = logging.getLogger(__name__)


def _matches_pattern(name: str, patterns: Collection[str]) -> bool:
    """Check if parameter name matches any pattern (supports wildcards)."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def param_groups_weight_decay(
        model: nn.Module,
        weight_decay: Optional[float] = 1e-5,
        weight_decay_exclude_1d: bool = True,
        no_weight_decay_list: Collection[str] = (),
        fallback_list: Collection[str] = (),
        fallback_no_weight_decay: bool = False,
):
    # Merge no_weight_decay into fallback_list if requested
    if fallback_no_weight_decay:
        fallback_list = set(fallback_list) | set(no_weight_decay_list)

    no_wd = not weight_decay

    decay = []
    decay_fallback = []
    no_decay = []
    no_decay_fallback = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue

        # Determine if this is a "fallback" parameter for fallback optimizer (if available)
        is_fallback = _matches_pattern(name, fallback_list)

        if no_wd:
            # No weight decay at all — everything goes to no_decay groups
            if is_fallback:
                no_decay_fallback.append(param)
            else:
                no_decay.append(param)
        else:
            # Determine weight decay
            matches_pattern = _matches_pattern(name, no_weight_decay_list)
            is_excluded_1d = weight_decay_exclude_1d and (param.ndim <= 1 or name.endswith(".bias"))
            if is_excluded_1d or matches_pattern:
                # No weight decay
                if is_fallback:
                    no_decay_fallback.append(param)
                else:
                    no_decay.append(param)
            else:
                # With weight decay
                if is_fallback:
                    decay_fallback.append(param)
                else:
                    decay.append(param)

    groups = []
    if no_decay:
        groups.append({'params': no_decay, 'weight_decay': 0.})
    if decay:
        groups.append({'params': decay, 'weight_decay': weight_decay})
    if no_decay_fallback:
        groups.append({'params': no_decay_fallback, 'weight_decay': 0., 'use_fallback': True})
    if decay_fallback:
        groups.append({'params': decay_fallback, 'weight_decay': weight_decay, 'use_fallback': True})

    return groups
