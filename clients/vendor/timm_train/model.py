# Vendored verbatim (excerpt) from https://github.com/huggingface/pytorch-image-models/blob/aa4b5850c1543fa488abf260f18390eda46cf85d/timm/utils/model.py
# (lines 1-8, 13-29: unwrap_model, get_state_dict). Copyright 2019 Ross Wightman. Apache License 2.0 (see LICENSE beside this file).
# Import lines dropped: 9 (torchvision FrozenBatchNorm2d), 11-12 (timm.layers BatchNorm helpers), used only by the
# freeze/unfreeze helpers not kept here.
""" Model / state_dict utils

Hacked together by / Copyright 2020 Ross Wightman
"""
import fnmatch
from copy import deepcopy

import torch
from .model_ema import ModelEma


def unwrap_model(model):
    if isinstance(model, ModelEma):
        return unwrap_model(model.ema)
    else:
        if hasattr(model, 'module'):
            return unwrap_model(model.module)
        elif hasattr(model, '_orig_mod'):
            return unwrap_model(model._orig_mod)
        else:
            return model


def get_state_dict(model, unwrap_fn=unwrap_model):
    return unwrap_fn(model).state_dict()
