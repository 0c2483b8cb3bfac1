"""Stand-in for the `torchvision.models` attributes the vendored programs use (torchvision is not
installed here). Not vendored code.

* ``resnet18(weights=None)`` (the torchvision >= 0.13 builder signature; pytorch/examples siamese_network)
  and ``resnet18/resnet50(pretrained=False, num_classes=...)`` (the older one; sthalles/SimCLR): the
  vendored torchvision ResNet (``resnet.py`` beside this file). No pretrained weights (no downloads).
* ``vgg16(weights=VGG16_Weights.IMAGENET1K_V1)`` (pytorch/examples fast_neural_style's Vgg16, which reads
  only ``.features``): an object whose ``features`` is torchvision's VGG-16 feature stack
  (``vgg.make_layers(cfgs['D'])``, vendored beside this file) with PyTorch's default random init in
  place of the ImageNet weights; the unused 120M-parameter classifier is not built.
"""
import torch.nn as nn

from clients.vendor.pytorch_vision import resnet as _resnet
from clients.vendor.pytorch_vision import vgg as _vgg


class _VGGFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = _vgg.make_layers(_vgg.cfgs['D'])


class models:
    class VGG16_Weights:
        IMAGENET1K_V1 = "IMAGENET1K_V1"  # random weights stand in (no downloads)

    @staticmethod
    def resnet18(*, weights=None, pretrained=False, progress=True, **kwargs):
        if weights is not None or pretrained:
            raise ValueError("only weights=None / pretrained=False is available here (no downloads)")
        return _resnet.resnet18(pretrained=False, progress=progress, **kwargs)

    @staticmethod
    def resnet50(*, pretrained=False, progress=True, **kwargs):
        if pretrained:
            raise ValueError("only pretrained=False is available here (no downloads)")
        return _resnet.resnet50(pretrained=False, progress=progress, **kwargs)

    @staticmethod
    def vgg16(*, weights=None, progress=True):
        return _VGGFeatures()
