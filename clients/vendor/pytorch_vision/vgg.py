# Vendored verbatim from https://github.com/pytorch/vision/blob/02196ff416e2ccfe1127d1c1a8745e47afa2fd93/torchvision/models/vgg.py
# Copyright (c) Soumith Chintala 2016. BSD 3-Clause License (see LICENSE beside this file).
# Kept: make_layers and cfgs, unedited, with the imports they need; the VGG class (its 4096-wide
# classifier is never used by fast_neural_style's Vgg16, which takes `.features`), the builders and the
# download code are cut (whole statements).
import torch.nn as nn
from typing import Union, List, Dict


def make_layers(cfg: List[Union[str, int]], batch_norm: bool = False) -> nn.Sequential:
    layers = []
    in_channels = 3
    for v in cfg:
        if isinstance(v, int):
            conv2d = nn.Conv2d(in_channels, int(v), kernel_size=3, padding=1)
            if batch_norm:
                layers += [conv2d, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
            else:
                layers += [conv2d, nn.ReLU(inplace=True)]
            in_channels = v
        else:
            layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
    return nn.Sequential(*layers)


cfgs: Dict[str, List[Union[str, int]]] = {
    'A': [64, 'M', 128, 'M', 256, 256, 'M', 512, 512, 'M', 512, 512, 'M'],
    'B': [64, 64, 'M', 128, 128, 'M', 256, 256, 'M', 512, 512, 'M', 512, 512, 'M'],
    'D': [64, 64, 'M', 128, 128, 'M', 256, 256, 256, 'M', 512, 512, 512, 'M', 512, 512, 512, 'M'],
    'E': [64, 64, 'M', 128, 128, 'M', 256, 256, 256, 256, 'M', 512, 512, 512, 512, 'M', 512, 512, 512, 512, 'M'],
}
