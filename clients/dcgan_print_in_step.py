"""pytorch/examples dcgan with its print inside the step: the iteration body as main.py writes it,
``D_x = output.mean().item()`` and the per-iteration ``print('[%d/%d][%d/%d] Loss_D: %.4f ...' %
(epoch, opt.niter, i, len(dataloader), errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))``, decorated
whole (``epoch`` and ``i`` passed in). The rest (models, data, optimizers, loop) is clients/dcgan.py's.
"""
import torch

from clients.dcgan import LICENSE, SOURCE, TAGS as _TAGS, build, opt, run  # noqa: F401

TAGS = ("print-in-step",) + _TAGS


def main(sg, steps=8, device="cpu", amp=None):
    s = build(sg, steps, device)
    netD, netG, criterion, nz = s.netD, s.netG, s.criterion, s.nz
    optimizerD, optimizerG, real_label, fake_label = s.optimizerD, s.optimizerG, s.real_label, s.fake_label
    dataloader = [None] * s.per_epoch   # (its length is what the print shows)

    @sg.compile
    def train_step(real_cpu, epoch, i):
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
        D_x = output.mean().item()

        # train with fake
        noise = torch.randn(batch_size, nz, 1, 1, device=device)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
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
        D_G_z2 = output.mean().item()
        optimizerG.step()

        print('[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f'
              % (epoch, opt.niter, i, len(dataloader),
                 errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))
        return errD.detach(), errG.detach()

    def one(real_cpu, epoch, i):
        sg.log(train_step(real_cpu, epoch, i))
    run(s, steps, device, one)
