# Vendored verbatim from https://github.com/sthalles/SimCLR/blob/1848fc9/models/resnet_simclr.py
# Copyright (c) 2020 Thalles Silva. MIT License (see LICENSE beside this file).
# Imports replaced: `import torchvision.models as models` -> the stand-in clients/vendor/pytorch_vision/models_shim.py
# (the vendored torchvision ResNet; torchvision is not installed here); `from exceptions.exceptions import
# InvalidBackboneError` -> the class defined below (verbatim from exceptions/exceptions.py). Nothing else changed.
import torch.nn as nn
from clients.vendor.pytorch_vision.models_shim import models



class BaseSimCLRException(Exception):
    """Base exception"""


class InvalidBackboneError(BaseSimCLRException):
    """Raised when the choice of backbone Convnet is invalid."""



class ResNetSimCLR(nn.Module):

    def __init__(self, base_model, out_dim):
        super(ResNetSimCLR, self).__init__()
        self.resnet_dict = {"resnet18": models.resnet18(pretrained=False, num_classes=out_dim),
                            "resnet50": models.resnet50(pretrained=False, num_classes=out_dim)}

        self.backbone = self._get_basemodel(base_model)
        dim_mlp = self.backbone.fc.in_features

        # add mlp projection head
        self.backbone.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.backbone.fc)

    def _get_basemodel(self, model_name):
        try:
            model = self.resnet_dict[model_name]
        except KeyError:
            raise InvalidBackboneError(
                "Invalid backbone architecture. Check the config file and pass one of: resnet18 or resnet50")
        else:
            return model

    def forward(self, x):
        return self.backbone(x)
