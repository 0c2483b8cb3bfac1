"""Library models with their default settings, trained by two of the corpus's programs: torchvision's
models (``torchvision.models.get_model(name, weights=None, num_classes=10)``) by torchvision's
classification reference (clients/torchvision_classification_ema.py: label smoothing, SGD with its
norm-layer weight-decay groups, EMA updated in the step, the accuracy meters), and timm's
(``timm.create_model(name, pretrained=False, num_classes=10, drop_path_rate=0.1)``, stochastic depth
on where the model has it) by timm's train.py (clients/timm_train_epoch_mixup_outside.py: mixup and
cutmix before the step, SoftTargetCrossEntropy, ModelEmaV3, clipping, the per-update cosine lr).

    python -m clients zoo --device cuda --jobs 8          # every model below
    python -m clients zoo:timm:convnext_atto              # one

The program's module is loaded fresh and its model class and image size are swapped for the
library's before its ``main`` runs; nothing else of the program changes. A zoo client needs
torchvision or timm installed (SKIP otherwise: CI's CPU has neither)."""
from __future__ import annotations

TORCHVISION = {   # model -> image size (the smallest each model's own layers take)
    "resnet18": 64, "resnet50": 64, "resnext50_32x4d": 64, "wide_resnet50_2": 64, "densenet121": 64,
    "mobilenet_v2": 64, "mobilenet_v3_small": 64, "mobilenet_v3_large": 64, "efficientnet_b0": 64,
    "efficientnet_v2_s": 64, "regnet_y_400mf": 64, "regnet_x_400mf": 64, "shufflenet_v2_x0_5": 64,
    "squeezenet1_0": 64, "mnasnet0_5": 64, "convnext_tiny": 64, "alexnet": 64, "vgg11_bn": 64,
    "swin_t": 64, "swin_v2_t": 64, "maxvit_t": 224, "vit_b_16": 224,
}
TIMM = {
    "vit_tiny_patch16_224": 224, "deit_tiny_patch16_224": 224, "swin_tiny_patch4_window7_224": 224,
    "convnext_atto": 64, "efficientnet_b0": 64, "mobilenetv3_small_050": 64, "resnet18d": 64,
    "regnetx_002": 64, "levit_128s": 224, "mixer_s16_224": 224, "poolformer_s12": 64,
    "efficientformer_l1": 224, "dm_nfnet_f0": 64, "dla34": 64, "hrnet_w18_small": 64,
    "coat_lite_tiny": 224, "ghostnet_100": 64, "repvgg_a0": 64, "eva02_tiny_patch14_224": 224,
    "fastvit_t8": 64, "rexnet_100": 64, "cait_xxs24_224": 224, "tinynet_a": 64, "beit_base_patch16_224": 224,
    "maxvit_tiny_tf_224": 224, "edgenext_xx_small": 64, "mobilevitv2_050": 64, "pvt_v2_b0": 64,
}
PROGRAMS = {"tv": "torchvision_classification_ema", "timm": "timm_train_epoch_mixup_outside"}


def names() -> list[str]:
    return [f"zoo:tv:{m}" for m in TORCHVISION] + [f"zoo:timm:{m}" for m in TIMM]


def load(name: str, load_client):
    """The program's module for ``zoo:<lib>:<model>``, its model and image size swapped."""
    _, lib, model = name.split(":", 2)
    mod = load_client(PROGRAMS[lib])
    if lib == "tv":
        import torchvision   # (ImportError: the harness's SKIP)

        def build(num_classes=10):
            return torchvision.models.get_model(model, weights=None, num_classes=num_classes)
        mod.ResNet, mod.image_size = build, TORCHVISION[model]
    else:
        import timm
        import clients.timm_train_epoch as program   # (the variant's main calls this module's)
        size = TIMM[model]

        def build(num_classes=10):
            try:
                return timm.create_model(model, pretrained=False, num_classes=num_classes, drop_path_rate=0.1)
            except TypeError:   # (no stochastic depth in this model: GhostNet, DLA)
                return timm.create_model(model, pretrained=False, num_classes=num_classes)
        program.SmallNet, program.image_size = build, size
    mod.SOURCE = f"{mod.SOURCE} with {lib}'s {model}"
    return mod

