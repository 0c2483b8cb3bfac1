# timm's activation-checkpointing helpers, restated (not copied: the lookup service this was
# written with does not allow committing its text) after
# https://github.com/huggingface/pytorch-image-models/blob/17452b8abb8acf8b12f3b6a6abf7c7ef47612ae5/timm/models/_manipulate.py
# (``checkpoint``, ``checkpoint_seq``) and timm/layers/config.py (``use_reentrant_ckpt``,
# ``set_reentrant_ckpt``: a module flag, False unless set, read when the helpers are called).
# Copyright 2019 Ross Wightman. Apache License 2.0 (see LICENSE beside this file).
from itertools import chain
from typing import Optional

import torch
import torch.utils.checkpoint

_USE_REENTRANT_CKPT = False


def use_reentrant_ckpt() -> bool:
    return _USE_REENTRANT_CKPT


def set_reentrant_ckpt(enable: bool = True) -> None:
    global _USE_REENTRANT_CKPT
    _USE_REENTRANT_CKPT = enable


def checkpoint(function, *args, use_reentrant: Optional[bool] = None, **kwargs):
    """torch.utils.checkpoint.checkpoint with use_reentrant defaulting to timm's flag."""
    if use_reentrant is None:
        use_reentrant = use_reentrant_ckpt()
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def checkpoint_seq(functions, x, every: int = 1, flatten: bool = False, skip_last: bool = False,
                   use_reentrant: Optional[bool] = None):
    """Run ``functions`` (an nn.Sequential or a list of callables) in order on ``x``, each run of
    ``every`` consecutive ones inside one torch.utils.checkpoint.checkpoint (all but the last
    when ``skip_last``), so only the segments' inputs are kept for backward."""
    if use_reentrant is None:
        use_reentrant = use_reentrant_ckpt()

    def segment(first, last, fns):
        def forward(_x):
            for j in range(first, last + 1):
                _x = fns[j](_x)
            return _x
        return forward

    if isinstance(functions, torch.nn.Sequential):
        functions = functions.children()
    if flatten:
        functions = chain.from_iterable(functions)
    if not isinstance(functions, (tuple, list)):
        functions = tuple(functions)

    n = len(functions) - (1 if skip_last else 0)
    end = -1
    for start in range(0, n, every):
        end = min(start + every - 1, n - 1)
        x = torch.utils.checkpoint.checkpoint(segment(start, end, functions), x, use_reentrant=use_reentrant)
    if skip_last:
        return segment(end + 1, len(functions) - 1, functions)(x)
    return x
