# Restates PyTorch-GAN's CycleGAN models.py (weights_init_normal, ResidualBlock, GeneratorResNet,
# Discriminator):
#   https://github.com/eriklindernoren/PyTorch-GAN/blob/36d3c77e5ff20ebe0aeefd322326a134a279b93e/implementations/cyclegan/models.py
# Copyright (c) 2018 Erik Linder-Norén. MIT License (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. Same modules in the same order (so the same parameter names and the same
# init draws under ``.apply(weights_init_normal)``), same forward computation, including the
# generator's ReflectionPad2d(channels) around its 7x7 convolutions and the PatchGAN's
# ``output_shape``.
import torch
import torch.nn as nn


def weights_init_normal(m):
    """N(0, 0.02) conv weights and zero conv biases; BatchNorm2d weights N(1, 0.02), biases 0."""
    kind = type(m).__name__
    if "Conv" in kind:
        torch.nn.init.normal_(m.weight.data, 0.0, 0.02)
        if getattr(m, "bias", None) is not None:
            torch.nn.init.constant_(m.bias.data, 0.0)
    elif "BatchNorm2d" in kind:
        torch.nn.init.normal_(m.weight.data, 1.0, 0.02)
        torch.nn.init.constant_(m.bias.data, 0.0)


def _conv_in_relu(c_in, c_out, *conv_args, **conv_kw):
    return [nn.Conv2d(c_in, c_out, *conv_args, **conv_kw), nn.InstanceNorm2d(c_out), nn.ReLU(inplace=True)]


class ResidualBlock(nn.Module):
    """x + (pad, 3x3 conv, instance norm, ReLU, pad, 3x3 conv, instance norm)(x)."""

    def __init__(self, in_features):
        super(ResidualBlock, self).__init__()
        f = in_features
        self.block = nn.Sequential(
            nn.ReflectionPad2d(1), *_conv_in_relu(f, f, 3),
            nn.ReflectionPad2d(1), nn.Conv2d(f, f, 3), nn.InstanceNorm2d(f),
        )

    def forward(self, x):
        return x + self.block(x)


class GeneratorResNet(nn.Module):
    """7x7 stem (64), two stride-2 downsamplings (128, 256), residual blocks, two nearest
    upsamplings back to 64, 7x7 conv to the image channels, tanh."""

    def __init__(self, input_shape, num_residual_blocks):
        super(GeneratorResNet, self).__init__()
        channels = input_shape[0]
        width = 64
        layers = [nn.ReflectionPad2d(channels), *_conv_in_relu(channels, width, 7)]
        for _ in range(2):
            layers += _conv_in_relu(width, width * 2, 3, stride=2, padding=1)
            width *= 2
        layers += [ResidualBlock(width) for _ in range(num_residual_blocks)]
        for _ in range(2):
            layers.append(nn.Upsample(scale_factor=2))
            layers += _conv_in_relu(width, width // 2, 3, stride=1, padding=1)
            width //= 2
        layers += [nn.ReflectionPad2d(channels), nn.Conv2d(width, channels, 7), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x):
        return self.model(x)


class Discriminator(nn.Module):
    """PatchGAN: four stride-2 4x4 convs (64..512), one score per patch of a 1/16-size map."""

    def __init__(self, input_shape):
        super(Discriminator, self).__init__()
        channels, height, width = input_shape
        self.output_shape = (1, height // 2 ** 4, width // 2 ** 4)

        def down(c_in, c_out, norm=True):
            mods = [nn.Conv2d(c_in, c_out, 4, stride=2, padding=1)]
            if norm:
                mods.append(nn.InstanceNorm2d(c_out))
            return mods + [nn.LeakyReLU(0.2, inplace=True)]

        self.model = nn.Sequential(
            *down(channels, 64, norm=False), *down(64, 128), *down(128, 256), *down(256, 512),
            nn.ZeroPad2d((1, 0, 1, 0)),
            nn.Conv2d(512, 1, 4, padding=1),
        )

    def forward(self, img):
        return self.model(img)
