"""pytorch/examples fast_neural_style: training a feed-forward style-transfer network (Johnson et
al.) against a fixed VGG-16 loss network. ``TransformerNet`` (transformer_net.py): ``ConvLayer``s
(``ReflectionPad2d(kernel_size // 2)`` then ``Conv2d``) with affine ``InstanceNorm2d`` and ReLU, two
stride-2 downsamplings, five ``ResidualBlock``s, two ``UpsampleConvLayer``s
(``torch.nn.functional.interpolate(mode='nearest', scale_factor=2)`` then a reflection-padded conv)
and a final 9x9 ``ConvLayer``. ``Vgg16`` (vgg.py): the features of vgg16 cut into ``slice1..4`` at
layer indices 4, 9, 16 and 23, parameters ``requires_grad = False``, returning the namedtuple
``VggOutputs(relu1_2, relu2_2, relu3_3, relu4_3)``. utils.py: ``gram_matrix`` (``y.view(b, ch, w *
h)``, ``features.bmm(features_t) / (ch * h * w)``) and ``normalize_batch`` (``batch.div_(255.0)``
-- in place on the batch it is given: the loader's content batch and the network's output -- then
``(batch - mean) / std`` with ``batch.new_tensor`` ImageNet statistics).

Loop: neural_style.py ``train()``. Before the loop as the program does: the style image repeated
to the batch size, ``features_style = vgg(utils.normalize_batch(style))``, ``gram_style =
[utils.gram_matrix(y) for y in features_style]``; Adam(lr 1e-3) on the TransformerNet, ``MSELoss``.
Each epoch resets ``agg_content_loss``, ``agg_style_loss``, ``count``. The per-batch body is the
step function (the batch passed in; the aggregates written through ``nonlocal``, as a user moving
the body into a function would): ``n_batch = len(x)``, ``count += n_batch``, ``zero_grad``, ``y =
transformer(x)``, both batches normalised, ``vgg`` on each, ``content_loss = content_weight *
mse_loss(features_y.relu2_2, features_x.relu2_2)``, the style loss summed over the four features
against ``gm_s[:n_batch, :, :]`` (the last batch of an epoch is smaller), ``* style_weight``,
``backward``, ``step``, ``agg_content_loss += content_loss.item()`` and ``agg_style_loss +=
style_loss.item()``. The ``log_interval`` message (the aggregates over ``batch_id + 1``) stays in
the loop; no checkpoint files, no final save.

Source: https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/fast_neural_style/neural_style/neural_style.py
(and transformer_net.py, vgg.py, utils.py there), BSD-3-Clause. Restated after the source, not
copied: same modules, names, ops and order. Deviations: torchvision is not used -- ``Vgg16`` builds
its ``features`` as torchvision's ``vgg16`` does (``make_layers`` cfg "D": 3x3 convs with padding 1,
``ReLU(inplace=True)``, 2x2 max-pools; kaiming_normal fan_out init, zero biases) with random
weights instead of the IMAGENET1K_V1 download, channels scaled down; the dataset (ImageFolder of
COCO with Resize/CenterCrop/ToTensor/mul(255)) and the style image are synthetic tensors in
[0, 255], loaded by a ``DataLoader(batch_size=4)`` (fresh batch tensors per iteration, as the
program's loader gives, which ``normalize_batch`` then divides in place). Scaled down: images 256
-> 16, TransformerNet channels 32/64/128 -> 8/16/32, VGG channels 64/128/256/512 -> 8/16/32/32, 14
training images (batches 4, 4, 4, 2), epochs 2, log_interval 500 -> 2.
"""
import time
from collections import namedtuple

import torch
from torch.optim import Adam

SOURCE = ("https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/"
          "fast_neural_style/neural_style/neural_style.py")
LICENSE = "BSD-3-Clause"
TAGS = ("style-transfer", "cnn", "instancenorm", "reflection-pad", "interpolate", "frozen-feature-net",
        "gram-matrix", "namedtuple-outputs", "in-place-input", "nonlocal-accumulators", "item-in-step",
        "partial-last-batch", "adam")


# ---------------------------------------------------------------- transformer_net.py (restated)

class TransformerNet(torch.nn.Module):
    def __init__(self, c1=32, c2=64, c3=128):
        super(TransformerNet, self).__init__()
        # initial convolutions
        self.conv1 = ConvLayer(3, c1, kernel_size=9, stride=1)
        self.in1 = torch.nn.InstanceNorm2d(c1, affine=True)
        self.conv2 = ConvLayer(c1, c2, kernel_size=3, stride=2)
        self.in2 = torch.nn.InstanceNorm2d(c2, affine=True)
        self.conv3 = ConvLayer(c2, c3, kernel_size=3, stride=2)
        self.in3 = torch.nn.InstanceNorm2d(c3, affine=True)
        # residual blocks
        self.res1 = ResidualBlock(c3)
        self.res2 = ResidualBlock(c3)
        self.res3 = ResidualBlock(c3)
        self.res4 = ResidualBlock(c3)
        self.res5 = ResidualBlock(c3)
        # upsampling
        self.deconv1 = UpsampleConvLayer(c3, c2, kernel_size=3, stride=1, upsample=2)
        self.in4 = torch.nn.InstanceNorm2d(c2, affine=True)
        self.deconv2 = UpsampleConvLayer(c2, c1, kernel_size=3, stride=1, upsample=2)
        self.in5 = torch.nn.InstanceNorm2d(c1, affine=True)
        self.deconv3 = ConvLayer(c1, 3, kernel_size=9, stride=1)
        self.relu = torch.nn.ReLU()

    def forward(self, X):
        y = self.relu(self.in1(self.conv1(X)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.relu(self.in3(self.conv3(y)))
        y = self.res1(y)
        y = self.res2(y)
        y = self.res3(y)
        y = self.res4(y)
        y = self.res5(y)
        y = self.relu(self.in4(self.deconv1(y)))
        y = self.relu(self.in5(self.deconv2(y)))
        y = self.deconv3(y)
        return y


class ConvLayer(torch.nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super(ConvLayer, self).__init__()
        reflection_padding = kernel_size // 2
        self.reflection_pad = torch.nn.ReflectionPad2d(reflection_padding)
        self.conv2d = torch.nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        return self.conv2d(self.reflection_pad(x))


class ResidualBlock(torch.nn.Module):
    """Residual block (https://arxiv.org/abs/1512.03385)."""

    def __init__(self, channels):
        super(ResidualBlock, self).__init__()
        self.conv1 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in1 = torch.nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in2 = torch.nn.InstanceNorm2d(channels, affine=True)
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        residual = x
        out = self.relu(self.in1(self.conv1(x)))
        out = self.in2(self.conv2(out))
        return out + residual


class UpsampleConvLayer(torch.nn.Module):
    """Nearest upsampling then a convolution (instead of ConvTranspose2d: no checkerboard)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride, upsample=None):
        super(UpsampleConvLayer, self).__init__()
        self.upsample = upsample
        reflection_padding = kernel_size // 2
        self.reflection_pad = torch.nn.ReflectionPad2d(reflection_padding)
        self.conv2d = torch.nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        x_in = x
        if self.upsample:
            x_in = torch.nn.functional.interpolate(x_in, mode='nearest', scale_factor=self.upsample)
        return self.conv2d(self.reflection_pad(x_in))


# ---------------------------------------------------------------- vgg.py (restated; torchvision's vgg16 features)

def _vgg16_features(widths=(64, 128, 256, 512)):
    """torchvision ``make_layers(cfgs["D"])``: [64, 64, M, 128, 128, M, 256 x3, M, 512 x3, M, 512 x3, M]
    (only the first 23 layers are ever sliced), with VGG's init for the convs."""
    a, b, c, d = widths
    cfg = [a, a, "M", b, b, "M", c, c, c, "M", d, d, d, "M", d, d, d, "M"]
    layers, in_channels = [], 3
    for v in cfg:
        if v == "M":
            layers += [torch.nn.MaxPool2d(kernel_size=2, stride=2)]
        else:
            conv2d = torch.nn.Conv2d(in_channels, v, kernel_size=3, padding=1)
            torch.nn.init.kaiming_normal_(conv2d.weight, mode="fan_out", nonlinearity="relu")
            torch.nn.init.constant_(conv2d.bias, 0)
            layers += [conv2d, torch.nn.ReLU(inplace=True)]
            in_channels = v
    return torch.nn.Sequential(*layers)


class Vgg16(torch.nn.Module):
    def __init__(self, requires_grad=False, widths=(64, 128, 256, 512)):
        super(Vgg16, self).__init__()
        vgg_pretrained_features = _vgg16_features(widths)   # (random weights: see the docstring)
        self.slice1 = torch.nn.Sequential()
        self.slice2 = torch.nn.Sequential()
        self.slice3 = torch.nn.Sequential()
        self.slice4 = torch.nn.Sequential()
        for x in range(4):
            self.slice1.add_module(str(x), vgg_pretrained_features[x])
        for x in range(4, 9):
            self.slice2.add_module(str(x), vgg_pretrained_features[x])
        for x in range(9, 16):
            self.slice3.add_module(str(x), vgg_pretrained_features[x])
        for x in range(16, 23):
            self.slice4.add_module(str(x), vgg_pretrained_features[x])
        if not requires_grad:
            for param in self.parameters():
                param.requires_grad = False

    def forward(self, X):
        h = self.slice1(X)
        h_relu1_2 = h
        h = self.slice2(h)
        h_relu2_2 = h
        h = self.slice3(h)
        h_relu3_3 = h
        h = self.slice4(h)
        h_relu4_3 = h
        vgg_outputs = namedtuple("VggOutputs", ['relu1_2', 'relu2_2', 'relu3_3', 'relu4_3'])
        return vgg_outputs(h_relu1_2, h_relu2_2, h_relu3_3, h_relu4_3)


# ---------------------------------------------------------------- utils.py (restated)

class utils:
    @staticmethod
    def gram_matrix(y):
        (b, ch, h, w) = y.size()
        features = y.view(b, ch, w * h)
        features_t = features.transpose(1, 2)
        gram = features.bmm(features_t) / (ch * h * w)
        return gram

    @staticmethod
    def normalize_batch(batch):
        # ImageNet mean and std
        mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
        std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
        batch = batch.div_(255.0)
        return (batch - mean) / std


class args:  # neural_style.py train defaults, scaled down
    epochs = 2; batch_size = 4; image_size = 16; style_size = None; seed = 42; content_weight = 1e5
    style_weight = 1e10; lr = 1e-3; log_interval = 2; checkpoint_model_dir = None


n_images = 14   # batches of 4, 4, 4, 2


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)

    g = torch.Generator().manual_seed(1)
    # (ImageFolder + transforms: images in [0, 255])
    train_dataset = torch.utils.data.TensorDataset(
        torch.rand(n_images, 3, args.image_size, args.image_size, generator=g).mul(255),
        torch.zeros(n_images, dtype=torch.long))
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size)

    transformer = TransformerNet(8, 16, 32).to(device)
    optimizer = Adam(transformer.parameters(), args.lr)
    mse_loss = torch.nn.MSELoss()

    vgg = Vgg16(requires_grad=False, widths=(8, 16, 32, 32)).to(device)
    style = torch.rand(3, args.image_size, args.image_size, generator=g).mul(255)   # (load_image + style_transform)
    style = style.repeat(args.batch_size, 1, 1, 1).to(device)

    features_style = vgg(utils.normalize_batch(style))
    gram_style = [utils.gram_matrix(y) for y in features_style]
    sg.track(transformer=transformer, optimizer=optimizer, vgg=vgg)

    agg_content_loss = agg_style_loss = 0.
    count = 0

    @sg.compile
    def train_step(x):
        nonlocal agg_content_loss, agg_style_loss, count
        n_batch = len(x)
        count += n_batch
        optimizer.zero_grad()

        x = x.to(device)
        y = transformer(x)

        y = utils.normalize_batch(y)
        x = utils.normalize_batch(x)

        features_y = vgg(y)
        features_x = vgg(x)

        content_loss = args.content_weight * mse_loss(features_y.relu2_2, features_x.relu2_2)

        style_loss = 0.
        for ft_y, gm_s in zip(features_y, gram_style):
            gm_y = utils.gram_matrix(ft_y)
            style_loss += mse_loss(gm_y, gm_s[:n_batch, :, :])
        style_loss *= args.style_weight

        total_loss = content_loss + style_loss
        total_loss.backward()
        optimizer.step()

        agg_content_loss += content_loss.item()
        agg_style_loss += style_loss.item()
        return total_loss

    n = 0
    for e in range(args.epochs):
        transformer.train()
        agg_content_loss = 0.
        agg_style_loss = 0.
        count = 0
        for batch_id, (x, _) in enumerate(train_loader):
            total_loss = train_step(x)
            sg.log((total_loss, agg_content_loss, agg_style_loss, count))

            if (batch_id + 1) % args.log_interval == 0:
                mesg = "{}\tEpoch {}:\t[{}/{}]\tcontent: {:.6f}\tstyle: {:.6f}\ttotal: {:.6f}".format(
                    time.ctime(), e + 1, count, len(train_dataset),
                    agg_content_loss / (batch_id + 1),
                    agg_style_loss / (batch_id + 1),
                    (agg_content_loss + agg_style_loss) / (batch_id + 1))
            n += 1
            if n >= steps:
                return
