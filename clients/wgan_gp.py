"""eriklindernoren/PyTorch-GAN wgan_gp: a WGAN with gradient penalty. MLP generator (BatchNorm1d,
LeakyReLU, Tanh) and critic, two Adam optimizers (lr 2e-4, betas (0.5, 0.999)). Each batch: the
critic update (noise ``z`` from ``np.random.normal``, ``fake_imgs = generator(z)``, the critic on
real and fake, ``compute_gradient_penalty`` on ``real_imgs.data`` / ``fake_imgs.data``: an
interpolation with ``alpha`` from ``np.random.random``, ``autograd.grad(outputs=d_interpolates,
inputs=interpolates, grad_outputs=..., create_graph=True, retain_graph=True)`` and the penalty on
the gradient norm, so ``d_loss.backward()`` is a double backward), ``optimizer_G.zero_grad()``, and
every ``n_critic``-th batch (``if i % opt.n_critic == 0:``) the generator update and
``batches_done += opt.n_critic``.

Model and penalty: vendor/pytorch_gan/wgan_gp.py (``Generator``, ``Discriminator``, ``lambda_gp``,
``compute_gradient_penalty``, restated: same layers, names and ops, not a copy). Loop: wgan_gp.py
lines 141-200: the whole per-batch body is the step function (the batch index ``i`` passed in, the
branch on it inside, as written). The ``d_loss.item()`` / ``g_loss.item()`` the program prints
inside the branch and its ``save_image`` are taken on the step's returned tensors outside it.
``Variable`` and ``Tensor`` (``torch.FloatTensor`` on the CPU) as written. Scaled down: latent_dim
100 -> 8, img_size 28 -> 8, batch 64 -> 4, n_critic 5 -> 2 (so 8 steps take the generator branch 4
times), synthetic images in [-1, 1].

As written the step draws its noise with ``np.random`` (``z`` in the loop body, ``alpha`` in
``compute_gradient_penalty``): wgan_gp_noise_outside is the fix that refusal names applied.
"""
import numpy as np
import torch
from torch.autograd import Variable

import clients.vendor.pytorch_gan.wgan_gp as wgan_gp
from clients.vendor.pytorch_gan.wgan_gp import Discriminator, Generator, lambda_gp

SOURCE = "https://github.com/eriklindernoren/PyTorch-GAN/blob/36d3c77e5ff20ebe0aeefd322326a134a279b93e/implementations/wgan_gp/wgan_gp.py"
LICENSE = "MIT"
TAGS = ("gan", "wgan-gp", "double-backward", "autograd.grad", "create_graph", "n_critic-branch",
        "two-optimizers", "adam", "batchnorm", "numpy-random-in-step", "global-counter-in-step")


class opt:  # argparse defaults of wgan_gp.py, scaled down
    n_epochs = 200; batch_size = 4; lr = 0.0002; b1 = 0.5; b2 = 0.999; latent_dim = 8; img_size = 8
    channels = 1; n_critic = 2; clip_value = 0.01; sample_interval = 400


batches_done = 0


def penalty_with_alpha(D, real_samples, fake_samples, alpha):
    """compute_gradient_penalty with its ``alpha`` draw moved out to the caller (the fix)."""
    return wgan_gp.penalty_at(D, real_samples, fake_samples, alpha)


def main(sg, steps=8, device="cpu", amp=None, noise_in_step=True):
    global batches_done
    batches_done = 0
    img_shape = (opt.channels, opt.img_size, opt.img_size)
    cuda = device == "cuda"
    Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor
    # the vendored code reads these as module globals, as in wgan_gp.py
    wgan_gp.opt, wgan_gp.img_shape, wgan_gp.Tensor = opt, img_shape, Tensor

    generator = Generator()
    discriminator = Discriminator()
    if cuda:
        generator.cuda()
        discriminator.cuda()

    g = torch.Generator().manual_seed(1)
    per_epoch = 4
    images = torch.rand(per_epoch * opt.batch_size, *img_shape, generator=g) * 2 - 1
    dataloader = [(images[i:i + opt.batch_size], torch.zeros(opt.batch_size, dtype=torch.long))
                  for i in range(0, per_epoch * opt.batch_size, opt.batch_size)]
    n_epochs = (steps + per_epoch - 1) // per_epoch

    optimizer_G = torch.optim.Adam(generator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
    optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
    sg.track(generator=generator, discriminator=discriminator, optimizer_G=optimizer_G,
             optimizer_D=optimizer_D)

    @sg.compile
    def train_step(imgs, i, z=None, alpha=None):
        global batches_done
        # Configure input
        real_imgs = Variable(imgs.type(Tensor))

        # ---------------------
        #  Train Discriminator
        # ---------------------

        optimizer_D.zero_grad()

        # Sample noise as generator input
        if noise_in_step:
            z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0], opt.latent_dim))))

        # Generate a batch of images
        fake_imgs = generator(z)

        # Real images
        real_validity = discriminator(real_imgs)
        # Fake images
        fake_validity = discriminator(fake_imgs)
        # Gradient penalty
        if noise_in_step:
            gradient_penalty = wgan_gp.compute_gradient_penalty(discriminator, real_imgs.data, fake_imgs.data)
        else:
            gradient_penalty = penalty_with_alpha(discriminator, real_imgs.data, fake_imgs.data, alpha)
        # Adversarial loss
        d_loss = -torch.mean(real_validity) + torch.mean(fake_validity) + lambda_gp * gradient_penalty

        d_loss.backward()
        optimizer_D.step()

        optimizer_G.zero_grad()

        g_loss = None
        # Train the generator every n_critic steps
        if i % opt.n_critic == 0:

            # -----------------
            #  Train Generator
            # -----------------

            # Generate a batch of images
            fake_imgs = generator(z)
            # Loss measures generator's ability to fool the discriminator
            # Train on fake images
            fake_validity = discriminator(fake_imgs)
            g_loss = -torch.mean(fake_validity)

            g_loss.backward()
            optimizer_G.step()

            # (print of d_loss.item(), g_loss.item() and save_image: outside, on the outputs)

            batches_done += opt.n_critic
        return d_loss, g_loss, fake_imgs

    it = 0
    for epoch in range(n_epochs):
        for i, (imgs, _) in enumerate(dataloader):
            if noise_in_step:
                d_loss, g_loss, fake_imgs = train_step(imgs, i)
            else:
                z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0], opt.latent_dim))))
                alpha = Tensor(np.random.random((imgs.size(0), 1, 1, 1)))
                d_loss, g_loss, fake_imgs = train_step(imgs, i, z, alpha)
            sg.log((d_loss, g_loss, batches_done))
            if i % opt.n_critic == 0:
                d_loss.item(), g_loss.item()   # the print
                if batches_done % opt.sample_interval == 0:
                    fake_imgs.data[:25]          # (save_image)
            it += 1
            if it >= steps:
                return
