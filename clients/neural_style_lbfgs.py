"""The PyTorch tutorial "Neural Transfer Using PyTorch" (advanced_source/neural_style_tutorial.py,
Gatys et al.'s style transfer): the image itself is optimised with ``optim.LBFGS([input_img
.requires_grad_()])`` (lr 1, max_iter 20). ``ContentLoss`` / ``StyleLoss`` modules are inserted
after the chosen convolutions of a copy of VGG's ``features`` (``get_style_model_and_losses``:
``Normalization`` first, in-place ReLUs replaced by out-of-place ones, the layers after the last loss
trimmed); each stores ``self.loss = F.mse_loss(..)`` in its ``forward`` (the style one on
``gram_matrix``: ``features.view(a * b, c * d)``, ``torch.mm(features, features.t())``,
``.div(a * b * c * d)``) and returns its input. The step is the body of ``run_style_transfer``'s
``while run[0] <= num_steps`` loop as written: it defines ``closure()`` --
``input_img.data.clamp_(0, 1)``, ``optimizer.zero_grad()``, ``model(input_img)``, the style and
content scores summed from the modules' ``.loss`` attributes and weighted (style 1e6, content 1),
``loss.backward()``, ``run[0] += 1`` (a counter in a list cell), ``if run[0] % 50 == 0:`` a print
of ``style_score.item()`` / ``content_score.item()``, ``return style_score + content_score`` -- and
calls ``optimizer.step(closure)``, which evaluates it up to 25 times with data-dependent early exits.
At this commit the VGG copy's parameters keep ``requires_grad`` (the tutorial sets no
``requires_grad_(False)``), so every ``backward`` also accumulates into their ``.grad``, never zeroed
(the optimizer holds only the image): tracked as state. After the loop, the last
``input_img.data.clamp_(0, 1)``.

What a user of stepgraph changes: the loop body becomes ``lbfgs_step()`` decorated with
``@stepgraph.compile`` (the closure defined inside it, as the tutorial does; ``run``, ``model``,
the loss lists and ``optimizer`` are closure variables of ``run_style_transfer``). Replaced: the
pretrained torchvision ``vgg19(pretrained=True).features`` by ``tiny_vgg_features()``, VGG's
layer pattern in plain torch (Conv3x3-ReLU(inplace) pairs and MaxPool2d(2), 5 convolutions of
8/8/16/16/16 channels, seeded default init) so that conv_1..conv_5 exist; the two JPEGs by seeded
``torch.rand(1, 3, 16, 16)`` images (imsize 128 -> 16); no matplotlib. The prints go to a list.
``num_steps`` stays 300; the loop stops after ``steps`` calls of the step. CPU only (the
tutorial's ``Normalization`` builds its tensors with ``torch.tensor(mean)`` on the default device).

Source: https://github.com/pytorch/tutorials/blob/8bcd0ac63dff35599649fc78711b6c155717823f/advanced_source/neural_style_tutorial.py
(BSD-3-Clause, Copyright (c) 2017-, PyTorch contributors). Restated after the source, not copied:
same modules, names, ops and semantics.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

SOURCE = ("https://github.com/pytorch/tutorials/blob/8bcd0ac63dff35599649fc78711b6c155717823f/"
          "advanced_source/neural_style_tutorial.py")
LICENSE = "BSD-3-Clause"
DEVICES = ("cpu",)
TAGS = ("lbfgs", "closure", "style-transfer", "optimize-input", "data-clamp", "module-attr-loss",
        "list-counter-in-step", "item-in-step", "print-in-step", "gram-matrix", "frozen-net-grads")

device = torch.device("cpu")
printed = []


class ContentLoss(nn.Module):

    def __init__(self, target,):
        super(ContentLoss, self).__init__()
        # a stated value, not a variable: detached from the graph
        self.target = target.detach()

    def forward(self, input):
        self.loss = F.mse_loss(input, self.target)
        return input


def gram_matrix(input):
    a, b, c, d = input.size()  # a=batch size(=1), b=feature maps, (c,d)=map size
    features = input.view(a * b, c * d)
    G = torch.mm(features, features.t())
    # normalised by the number of elements
    return G.div(a * b * c * d)


class StyleLoss(nn.Module):

    def __init__(self, target_feature):
        super(StyleLoss, self).__init__()
        self.target = gram_matrix(target_feature).detach()

    def forward(self, input):
        G = gram_matrix(input)
        self.loss = F.mse_loss(G, self.target)
        return input


def tiny_vgg_features():
    """VGG's ``features`` layer pattern, scaled down (stands in for vgg19(pretrained=True).features)."""
    cfg = [8, 8, "M", 16, 16, "M", 16]
    layers, c = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(c, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            c = v
    return nn.Sequential(*layers)


class Normalization(nn.Module):
    def __init__(self, mean, std):
        super(Normalization, self).__init__()
        # [C x 1 x 1] to broadcast over [B x C x H x W]
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def forward(self, img):
        return (img - self.mean) / self.std


content_layers_default = ['conv_4']
style_layers_default = ['conv_1', 'conv_2', 'conv_3', 'conv_4', 'conv_5']


def get_style_model_and_losses(cnn, normalization_mean, normalization_std,
                               style_img, content_img,
                               content_layers=content_layers_default,
                               style_layers=style_layers_default):
    cnn = copy.deepcopy(cnn)

    normalization = Normalization(normalization_mean, normalization_std).to(device)

    content_losses = []
    style_losses = []

    model = nn.Sequential(normalization)

    i = 0  # increment every time we see a conv
    for layer in cnn.children():
        if isinstance(layer, nn.Conv2d):
            i += 1
            name = 'conv_{}'.format(i)
        elif isinstance(layer, nn.ReLU):
            name = 'relu_{}'.format(i)
            # the in-place version does not play well with the loss modules
            layer = nn.ReLU(inplace=False)
        elif isinstance(layer, nn.MaxPool2d):
            name = 'pool_{}'.format(i)
        elif isinstance(layer, nn.BatchNorm2d):
            name = 'bn_{}'.format(i)
        else:
            raise RuntimeError('Unrecognized layer: {}'.format(layer.__class__.__name__))

        model.add_module(name, layer)

        if name in content_layers:
            target = model(content_img).detach()
            content_loss = ContentLoss(target)
            model.add_module("content_loss_{}".format(i), content_loss)
            content_losses.append(content_loss)

        if name in style_layers:
            target_feature = model(style_img).detach()
            style_loss = StyleLoss(target_feature)
            model.add_module("style_loss_{}".format(i), style_loss)
            style_losses.append(style_loss)

    # trim off the layers after the last content and style losses
    for i in range(len(model) - 1, -1, -1):
        if isinstance(model[i], ContentLoss) or isinstance(model[i], StyleLoss):
            break

    model = model[:(i + 1)]

    return model, style_losses, content_losses


def get_input_optimizer(input_img):
    # the input is what requires a gradient
    optimizer = optim.LBFGS([input_img.requires_grad_()])
    return optimizer


def run_style_transfer(sg, steps, cnn, normalization_mean, normalization_std,
                       content_img, style_img, input_img, num_steps=300,
                       style_weight=1000000, content_weight=1):
    printed.append('Building the style transfer model..')
    model, style_losses, content_losses = get_style_model_and_losses(cnn,
        normalization_mean, normalization_std, style_img, content_img)
    optimizer = get_input_optimizer(input_img)
    sg.track(model=model, optimizer=optimizer, input_img=input_img)

    printed.append('Optimizing..')
    run = [0]

    @sg.compile   # = @stepgraph.compile
    def lbfgs_step():
        def closure():
            # correct the values of updated input image
            input_img.data.clamp_(0, 1)

            optimizer.zero_grad()
            model(input_img)
            style_score = 0
            content_score = 0

            for sl in style_losses:
                style_score += sl.loss
            for cl in content_losses:
                content_score += cl.loss

            style_score *= style_weight
            content_score *= content_weight

            loss = style_score + content_score
            loss.backward()

            run[0] += 1
            if run[0] % 50 == 0:
                printed.append("run {}:".format(run))
                printed.append('Style Loss : {:4f} Content Loss: {:4f}'.format(
                    style_score.item(), content_score.item()))
                printed.append("")

            return style_score + content_score

        optimizer.step(closure)

    calls = 0
    while run[0] <= num_steps:
        lbfgs_step()
        calls += 1
        sg.log((run[0], input_img))
        if calls == steps:
            break

    # a last correction...
    input_img.data.clamp_(0, 1)

    return input_img


def main(sg, steps=8, device="cpu", amp=None):
    torch.manual_seed(0)
    cnn = tiny_vgg_features().to(device).eval()
    cnn_normalization_mean = torch.tensor([0.485, 0.456, 0.406]).to(device)
    cnn_normalization_std = torch.tensor([0.229, 0.224, 0.225]).to(device)
    style_img = torch.rand(1, 3, 16, 16, device=device)
    content_img = torch.rand(1, 3, 16, 16, device=device)
    input_img = content_img.clone()
    output = run_style_transfer(sg, steps, cnn, cnn_normalization_mean, cnn_normalization_std,
                                content_img, style_img, input_img)
    sg.log(output)
    sg.log(printed)
