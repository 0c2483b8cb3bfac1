"""Stand-in for the one `torchvision` attribute pytorch/examples siamese_network/main.py uses:
``torchvision.models.resnet18(weights=None)`` (the torchvision >= 0.13 builder signature). It builds the
vendored torchvision ResNet-18 (``resnet.py`` beside this file, whose older builder spells it
``pretrained=False``); only ``weights=None`` (no pretrained weights) is supported. Not vendored code.
"""
from clients.vendor.pytorch_vision import resnet as _resnet


class models:
    @staticmethod
    def resnet18(*, weights=None, progress=True, **kwargs):
        if weights is not None:
            raise ValueError("only weights=None is available here (no downloads)")
        return _resnet.resnet18(pretrained=False, progress=progress, **kwargs)
