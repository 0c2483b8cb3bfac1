# Restates sthalles/SimCLR's models/resnet_simclr.py (ResNetSimCLR) and the one exception it
# raises (exceptions/exceptions.py's InvalidBackboneError):
#   https://github.com/sthalles/SimCLR/blob/1848fc934ad844ae630e6c452300433fe99acfd9/models/resnet_simclr.py
#   https://github.com/sthalles/SimCLR/blob/1848fc934ad844ae630e6c452300433fe99acfd9/exceptions/exceptions.py
# Copyright (c) 2020 Thalles Silva. MIT License (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. As in the source, both candidate backbones (resnet18, then resnet50) are
# built, so the random draws of their inits, and of the projection head after them, are the
# same; the torchvision builders are the vendored ones (clients/vendor/pytorch_vision/resnet.py).
import torch.nn as nn

from clients.vendor.pytorch_vision import resnet as models


class InvalidBackboneError(Exception):
    """The backbone name is neither resnet18 nor resnet50."""


class ResNetSimCLR(nn.Module):
    """A torchvision ResNet whose ``fc`` (out_dim outputs) gets a hidden layer in front of it:
    ``backbone.fc = Sequential(Linear(d, d), ReLU(), old fc)``, SimCLR's projection head."""

    def __init__(self, base_model, out_dim):
        super(ResNetSimCLR, self).__init__()
        self.resnet_dict = {}
        for name in ("resnet18", "resnet50"):
            self.resnet_dict[name] = getattr(models, name)(pretrained=False, num_classes=out_dim)
        self.backbone = self._get_basemodel(base_model)
        head = self.backbone.fc
        d = head.in_features
        self.backbone.fc = nn.Sequential(nn.Linear(d, d), nn.ReLU(), head)

    def _get_basemodel(self, model_name):
        if model_name not in self.resnet_dict:
            raise InvalidBackboneError(
                f"unknown backbone {model_name!r}: the config must name resnet18 or resnet50")
        return self.resnet_dict[model_name]

    def forward(self, x):
        return self.backbone(x)
