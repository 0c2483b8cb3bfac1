"""pytorch/examples dcgan: a DCGAN (ConvTranspose generator, Conv discriminator, BatchNorm in both,
``weights_init`` via ``.apply``), ``nn.BCELoss``, two Adam optimizers (lr 2e-4, betas (0.5, 0.999)).
Each iteration: the D update (``netD.zero_grad()``, real batch with ``torch.full`` labels, fake batch
from ``torch.randn`` noise with ``label.fill_(fake_label)`` and ``fake.detach()``, ``optimizerD.step()``)
then the G update (``netG.zero_grad()``, ``label.fill_(real_label)``, D on the non-detached ``fake``,
``optimizerG.step()``). The whole iteration body is one step function (``fake`` and ``label`` flow
from the D half into the G half), the way a user would decorate it; the noise is drawn inside it
from the global RNG as main.py does.

Model: vendor/pytorch_examples/dcgan_main.py (``weights_init``, ``Generator``, ``Discriminator``,
verbatim). Loop: main.py lines 220-265. The ``.item()`` reads the program prints (``D_x``, ``D_G_z1``,
``D_G_z2``, ``errD``, ``errG``) are taken on the step's returned tensors outside it. Every 100
iterations main.py runs ``netG(fixed_noise)`` (in train mode, outside no_grad: it updates netG's
BatchNorm running stats) to save images: kept at i == 0, the image saving dropped. Scaled down: nz 16,
ngf = ndf = 8, batch 4 instead of 64, nc 3 (the ``fake`` dataset), image 64x64 (the architecture's
fixed size), synthetic images in [-1, 1] from a seeded generator; 4 iterations per epoch; no
``cudnn.benchmark`` (a process-wide switch), no checkpoint saving, no printing.
"""
import types

import torch
import torch.nn as nn
import torch.optim as optim

import clients.vendor.pytorch_examples.dcgan_main as dcgan_main
from clients.vendor.pytorch_examples.dcgan_main import Discriminator, Generator, weights_init

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/dcgan/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("gan", "cnn", "batchnorm", "two-optimizers", "adam", "detach", "fill_", "rng-in-step")


class opt:  # argparse defaults of main.py, scaled down
    batchSize = 4; imageSize = 64; nz = 16; ngf = 8; ndf = 8; lr = 0.0002; beta1 = 0.5; ngpu = 1; niter = 2


def build(sg, steps, device):
    """The models, data and optimizers as main.py sets them up (shared with dcgan_print_in_step)."""
    ngpu = int(opt.ngpu)
    nz = int(opt.nz)
    ngf = int(opt.ngf)
    ndf = int(opt.ndf)
    nc = 3
    # the vendored classes read these as module globals, as in main.py
    dcgan_main.nz, dcgan_main.ngf, dcgan_main.ndf, dcgan_main.nc = nz, ngf, ndf, nc

    g = torch.Generator().manual_seed(1)
    images = torch.rand(steps * opt.batchSize, nc, opt.imageSize, opt.imageSize, generator=g) * 2 - 1
    dataset = [(images[i:i + opt.batchSize], torch.zeros(opt.batchSize, dtype=torch.long))
               for i in range(0, steps * opt.batchSize, opt.batchSize)]
    per_epoch = 4
    opt.niter = (steps + per_epoch - 1) // per_epoch

    netG = Generator(ngpu).to(device)
    netG.apply(weights_init)
    netD = Discriminator(ngpu).to(device)
    netD.apply(weights_init)

    criterion = nn.BCELoss()

    fixed_noise = torch.randn(opt.batchSize, nz, 1, 1, device=device)
    real_label = 1
    fake_label = 0

    # setup optimizer
    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    sg.track(netG=netG, netD=netD, optimizerD=optimizerD, optimizerG=optimizerG)
    return types.SimpleNamespace(**locals())


def run(s, steps, device, one) -> None:
    """main.py's loop: ``one(real_cpu, epoch, i)`` is an iteration's step and what it logs."""
    it = 0
    for epoch in range(opt.niter):
        for i, data in enumerate(s.dataset[epoch * s.per_epoch:(epoch + 1) * s.per_epoch], 0):
            real_cpu = data[0].to(device)
            one(real_cpu, epoch, i)
            if i % 100 == 0:
                fake = s.netG(s.fixed_noise)  # noqa: F841 (vutils.save_image of real_cpu and fake.detach())
            it += 1
            if it >= steps:
                return


def main(sg, steps=8, device="cpu", amp=None):
    s = build(sg, steps, device)
    netD, netG, criterion, nz = s.netD, s.netG, s.criterion, s.nz
    optimizerD, optimizerG, real_label, fake_label = s.optimizerD, s.optimizerG, s.real_label, s.fake_label

    @sg.compile
    def train_step(real_cpu):
        ############################
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        ###########################
        # train with real
        netD.zero_grad()
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label,
                           dtype=real_cpu.dtype, device=device)

        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean()

        # train with fake
        noise = torch.randn(batch_size, nz, 1, 1, device=device)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean()
        errD = errD_real + errD_fake
        optimizerD.step()

        ############################
        # (2) Update G network: maximize log(D(G(z)))
        ###########################
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean()
        optimizerG.step()
        return errD, errG, D_x, D_G_z1, D_G_z2

    def one(real_cpu, epoch, i):
        errD, errG, D_x, D_G_z1, D_G_z2 = train_step(real_cpu)
        sg.log((errD, errG, D_x, D_G_z1, D_G_z2))
        # main.py prints Loss_D, Loss_G, D(x), D(G(z)) from these
        errD.item(), errG.item(), D_x.item(), D_G_z1.item(), D_G_z2.item()
    run(s, steps, device, one)
