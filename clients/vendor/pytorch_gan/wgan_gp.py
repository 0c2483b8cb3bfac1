# Restates the model code of PyTorch-GAN's WGAN-GP script (Generator, Discriminator, lambda_gp,
# compute_gradient_penalty, here split in two: the draw, then ``penalty_at``):
#   https://github.com/eriklindernoren/PyTorch-GAN/blob/36d3c77e5ff20ebe0aeefd322326a134a279b93e/implementations/wgan_gp/wgan_gp.py
# Copyright (c) 2018 Erik Linder-Norén. MIT License (see LICENSE beside this file).
# Restated after the source, not copied: the lookup service this was written with does not allow
# committing its text. Same layers in the same Sequential positions (parameter names
# model.<i>.weight as in the script), same ops in the same order, including the script's quirks
# that change numerics (BatchNorm1d's second positional argument 0.8 is its eps; the penalty's
# interpolation weight is drawn with numpy's global generator inside the function).
#
# As in the script, this code reads three module globals the script sets from argparse and CUDA
# availability: ``opt`` (latent_dim), ``img_shape`` and ``Tensor`` (torch.FloatTensor or its
# CUDA form). clients/wgan_gp.py assigns them on this module before building the models.
import numpy as np
import torch
import torch.autograd as autograd
import torch.nn as nn
from torch.autograd import Variable

opt = img_shape = Tensor = None   # set by the client, as the script sets them

# weight of the gradient penalty in the critic's loss
lambda_gp = 10


def _dense(n_in, n_out, bn=True):
    """Linear, optionally BatchNorm1d (eps=0.8, as the script passes it), LeakyReLU(0.2)."""
    out = [nn.Linear(n_in, n_out)]
    if bn:
        out.append(nn.BatchNorm1d(n_out, 0.8))
    out.append(nn.LeakyReLU(0.2, inplace=True))
    return out


class Generator(nn.Module):
    """latent_dim -> 128 -> 256 -> 512 -> 1024 -> image, tanh output."""

    def __init__(self):
        super(Generator, self).__init__()
        widths = [opt.latent_dim, 128, 256, 512, 1024]
        hidden = []
        for k in range(4):
            hidden += _dense(widths[k], widths[k + 1], bn=k > 0)
        self.model = nn.Sequential(*hidden, nn.Linear(1024, int(np.prod(img_shape))), nn.Tanh())

    def forward(self, z):
        flat = self.model(z)
        return flat.view(flat.shape[0], *img_shape)


class Discriminator(nn.Module):
    """The critic: flattened image -> 512 -> 256 -> one unbounded score."""

    def __init__(self):
        super(Discriminator, self).__init__()
        self.model = nn.Sequential(
            nn.Linear(int(np.prod(img_shape)), 512), nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(512, 256), nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 1),
        )

    def forward(self, img):
        return self.model(img.view(img.shape[0], -1))


def compute_gradient_penalty(D, real_samples, fake_samples):
    """(||grad_x D(x)||_2 - 1)^2 averaged over points x on random real-fake segments."""
    # one mixing weight per sample, from numpy's global generator
    alpha = Tensor(np.random.random((real_samples.size(0), 1, 1, 1)))
    return penalty_at(D, real_samples, fake_samples, alpha)


def penalty_at(D, real_samples, fake_samples, alpha):
    """The penalty for given mixing weights (the script's function body after its ``alpha``
    draw; clients/wgan_gp_noise_outside passes the weights drawn outside the step)."""
    mixed = (alpha * real_samples + ((1 - alpha) * fake_samples)).requires_grad_(True)
    score = D(mixed)
    ones = Variable(Tensor(real_samples.shape[0], 1).fill_(1.0), requires_grad=False)
    # create_graph: the penalty is differentiated again by the critic's backward
    (grad,) = autograd.grad(outputs=score, inputs=mixed, grad_outputs=ones,
                            create_graph=True, retain_graph=True, only_inputs=True)
    grad = grad.view(grad.size(0), -1)
    return ((grad.norm(2, dim=1) - 1) ** 2).mean()
