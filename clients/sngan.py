"""christiancosgrove/pytorch-spectral-normalization-gan: an SN-GAN (Miyato et al., spectral
normalization) on CIFAR-10 with the hinge loss. The discriminator's layers are wrapped in the
repository's own ``SpectralNorm`` module (spectral_normalization.py), not
``torch.nn.utils.spectral_norm``: at construction it deletes the wrapped layer's ``weight``
parameter and registers ``weight_u`` / ``weight_v`` (``Parameter(..., requires_grad=False)``,
normal draws, l2-normalised) and ``weight_bar`` (the weight); every forward runs one power
iteration that *rebinds* ``v.data`` and ``u.data`` (``v.data = l2normalize(mv(w.t(), u))``,
``u.data = l2normalize(mv(w, v))``), computes ``sigma = u.dot(w.view(h, -1).mv(v))`` and
``setattr``s the plain tensor ``w / sigma.expand_as(w)`` as the layer's ``weight`` before calling
the layer's own forward. The optimizers: ``Adam(filter(lambda p: p.requires_grad,
discriminator.parameters()), lr, betas=(0.0, 0.9))`` (so ``u`` / ``v`` are left out) and
``Adam(generator.parameters(), lr, betas=(0.0, 0.9))``; ``ExponentialLR(gamma=0.99)`` on both,
stepped once per epoch after the batches.

Per batch (main.py ``train``): ``disc_iters`` discriminator updates, each drawing
``z = torch.randn(batch_size, Z_dim)``, zeroing both optimizers, the hinge loss
``nn.ReLU()(1.0 - D(data)).mean() + nn.ReLU()(1.0 + D(G(z))).mean()`` (a fresh ``nn.ReLU()``
per term, ``G(z)`` not detached, so the generator gets grads it then discards), backward,
``optim_disc.step()``; then one generator update on a new ``z``: both zeroed,
``-D(G(z)).mean()``, backward, ``optim_gen.step()``. That whole per-batch body is the step
function, as the train loop runs it (D-iters then G). After each epoch: both schedulers step, and
``evaluate`` runs ``generator(fixed_z)`` (the generator is never put in eval mode, so this
forward updates its BatchNorm running statistics outside the step) for the sample grid.

Model: model.py (the DCGAN-like ``Generator`` / ``Discriminator``, the ``--model dcgan`` choice;
the default ``--model resnet`` is the same loop on model_resnet.py). Restated after the source,
not copied: same modules, names, ops, init and order of draws. Scaled down: Z_dim 128 -> 8,
batch 64 -> 4, every channel width / 16 (G 512-256-128-64 -> 32-16-8-4, D 64..512 -> 4..32),
CIFAR-10 -> synthetic 3x32x32 images in [-1, 1] (18 per epoch, so the last batch of 2 is skipped
by the program's ``if data.size()[0] != args.batch_size: continue``), disc_iters 5 as written,
the print interval 100 -> 2 batches. ``.cuda()`` calls follow ``device``. The program's print of
``disc_loss.data[0]`` fails on a 0-dim tensor in any PyTorch since 0.4; ``.item()`` is read
instead, outside the step on its returned losses. The matplotlib grid and ``torch.save`` of the
checkpoints are left out.

Source: https://github.com/christiancosgrove/pytorch-spectral-normalization-gan/blob/12dcf945a6359301d63d1e0da3708cd0f0590b19/main.py
(and model.py, spectral_normalization.py there), MIT, Copyright (c) 2017 Christian Cosgrove.
"""
import torch
import torch.nn as nn
import torch.optim as optim
from torch.autograd import Variable
from torch.nn import Parameter

SOURCE = ("https://github.com/christiancosgrove/pytorch-spectral-normalization-gan/blob/"
          "12dcf945a6359301d63d1e0da3708cd0f0590b19/main.py")
LICENSE = "MIT"
TAGS = ("gan", "sngan", "spectral-norm", "power-iteration", "param-data-rebind", "hinge-loss",
        "disc-iters-loop", "two-optimizers", "adam", "exponential-lr", "batchnorm", "torch-randn-in-step")


# ---- spectral_normalization.py (restated) ----

def l2normalize(v, eps=1e-12):
    return v / (v.norm() + eps)


class SpectralNorm(nn.Module):
    def __init__(self, module, name='weight', power_iterations=1):
        super(SpectralNorm, self).__init__()
        self.module = module
        self.name = name
        self.power_iterations = power_iterations
        if not self._made_params():
            self._make_params()

    def _update_u_v(self):
        u = getattr(self.module, self.name + "_u")
        v = getattr(self.module, self.name + "_v")
        w = getattr(self.module, self.name + "_bar")

        height = w.data.shape[0]
        for _ in range(self.power_iterations):
            # one power-iteration step on the detached weight, written into u / v by rebinding .data
            v.data = l2normalize(torch.mv(torch.t(w.view(height, -1).data), u.data))
            u.data = l2normalize(torch.mv(w.view(height, -1).data, v.data))

        sigma = u.dot(w.view(height, -1).mv(v))
        setattr(self.module, self.name, w / sigma.expand_as(w))

    def _made_params(self):
        try:
            getattr(self.module, self.name + "_u")
            getattr(self.module, self.name + "_v")
            getattr(self.module, self.name + "_bar")
            return True
        except AttributeError:
            return False

    def _make_params(self):
        w = getattr(self.module, self.name)
        height = w.data.shape[0]
        width = w.view(height, -1).data.shape[1]

        u = Parameter(w.data.new(height).normal_(0, 1), requires_grad=False)
        v = Parameter(w.data.new(width).normal_(0, 1), requires_grad=False)
        u.data = l2normalize(u.data)
        v.data = l2normalize(v.data)
        w_bar = Parameter(w.data)

        del self.module._parameters[self.name]
        self.module.register_parameter(self.name + "_u", u)
        self.module.register_parameter(self.name + "_v", v)
        self.module.register_parameter(self.name + "_bar", w_bar)

    def forward(self, *args):
        self._update_u_v()
        return self.module.forward(*args)


# ---- model.py (DCGAN-like, restated; widths / 16) ----

channels = 3
leak = 0.1
w_g = 4


class Generator(nn.Module):
    def __init__(self, z_dim):
        super(Generator, self).__init__()
        self.z_dim = z_dim
        self.model = nn.Sequential(
            nn.ConvTranspose2d(z_dim, 32, 4, stride=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=(1, 1)),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.ConvTranspose2d(16, 8, 4, stride=2, padding=(1, 1)),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.ConvTranspose2d(8, 4, 4, stride=2, padding=(1, 1)),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.ConvTranspose2d(4, channels, 3, stride=1, padding=(1, 1)),
            nn.Tanh())

    def forward(self, z):
        return self.model(z.view(-1, self.z_dim, 1, 1))


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()
        self.conv1 = SpectralNorm(nn.Conv2d(channels, 4, 3, stride=1, padding=(1, 1)))
        self.conv2 = SpectralNorm(nn.Conv2d(4, 4, 4, stride=2, padding=(1, 1)))
        self.conv3 = SpectralNorm(nn.Conv2d(4, 8, 3, stride=1, padding=(1, 1)))
        self.conv4 = SpectralNorm(nn.Conv2d(8, 8, 4, stride=2, padding=(1, 1)))
        self.conv5 = SpectralNorm(nn.Conv2d(8, 16, 3, stride=1, padding=(1, 1)))
        self.conv6 = SpectralNorm(nn.Conv2d(16, 16, 4, stride=2, padding=(1, 1)))
        self.conv7 = SpectralNorm(nn.Conv2d(16, 32, 3, stride=1, padding=(1, 1)))
        self.fc = SpectralNorm(nn.Linear(w_g * w_g * 32, 1))

    def forward(self, x):
        m = x
        m = nn.LeakyReLU(leak)(self.conv1(m))
        m = nn.LeakyReLU(leak)(self.conv2(m))
        m = nn.LeakyReLU(leak)(self.conv3(m))
        m = nn.LeakyReLU(leak)(self.conv4(m))
        m = nn.LeakyReLU(leak)(self.conv5(m))
        m = nn.LeakyReLU(leak)(self.conv6(m))
        m = nn.LeakyReLU(leak)(self.conv7(m))
        return self.fc(m.view(-1, w_g * w_g * 32))


# ---- main.py (restated) ----

class args:  # argparse defaults of main.py, scaled down
    batch_size = 4; lr = 2e-4; loss = 'hinge'; checkpoint_dir = 'checkpoints'; model = 'dcgan'


Z_dim = 8
# number of updates to the discriminator for every update to the generator
disc_iters = 5


def main(sg, steps=8, device="cpu", amp=None):
    g = torch.Generator().manual_seed(3)
    n_images = 4 * args.batch_size + 2
    images = torch.rand(n_images, channels, 32, 32, generator=g) * 2 - 1
    labels = torch.randint(0, 10, (n_images,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels),
                                         batch_size=args.batch_size, shuffle=True, num_workers=0)

    discriminator = Discriminator().to(device)
    generator = Generator(Z_dim).to(device)

    # u and v are Parameters that don't require grad: only those that do are optimised
    optim_disc = optim.Adam(filter(lambda p: p.requires_grad, discriminator.parameters()),
                            lr=args.lr, betas=(0.0, 0.9))
    optim_gen = optim.Adam(generator.parameters(), lr=args.lr, betas=(0.0, 0.9))

    # exponentially decaying learning rate
    scheduler_d = optim.lr_scheduler.ExponentialLR(optim_disc, gamma=0.99)
    scheduler_g = optim.lr_scheduler.ExponentialLR(optim_gen, gamma=0.99)
    sg.track(discriminator=discriminator, generator=generator, optim_disc=optim_disc,
             optim_gen=optim_gen, scheduler_d=scheduler_d, scheduler_g=scheduler_g)

    @sg.compile
    def train_batch(data, target):
        # update discriminator
        for _ in range(disc_iters):
            z = Variable(torch.randn(args.batch_size, Z_dim, device=device))
            optim_disc.zero_grad()
            optim_gen.zero_grad()
            if args.loss == 'hinge':
                disc_loss = nn.ReLU()(1.0 - discriminator(data)).mean() + \
                    nn.ReLU()(1.0 + discriminator(generator(z))).mean()
            elif args.loss == 'wasserstein':
                disc_loss = -discriminator(data).mean() + discriminator(generator(z)).mean()
            else:
                ones = Variable(torch.ones(args.batch_size, 1, device=device))
                zeros = Variable(torch.zeros(args.batch_size, 1, device=device))
                disc_loss = nn.BCEWithLogitsLoss()(discriminator(data), ones) + \
                    nn.BCEWithLogitsLoss()(discriminator(generator(z)), zeros)
            disc_loss.backward()
            optim_disc.step()

        z = Variable(torch.randn(args.batch_size, Z_dim, device=device))

        # update generator
        optim_disc.zero_grad()
        optim_gen.zero_grad()
        if args.loss == 'hinge' or args.loss == 'wasserstein':
            gen_loss = -discriminator(generator(z)).mean()
        else:
            gen_loss = nn.BCEWithLogitsLoss()(discriminator(generator(z)),
                                              Variable(torch.ones(args.batch_size, 1, device=device)))
        gen_loss.backward()
        optim_gen.step()
        return disc_loss, gen_loss

    done = [0]

    def train(epoch):
        for batch_idx, (data, target) in enumerate(loader):
            if data.size()[0] != args.batch_size:
                continue
            if done[0] == steps:
                return
            data, target = Variable(data.to(device)), Variable(target.to(device))
            disc_loss, gen_loss = train_batch(data, target)
            sg.log((disc_loss, gen_loss))
            done[0] += 1
            if batch_idx % 2 == 0:
                disc_loss.item(), gen_loss.item()   # print('disc loss', ..., 'gen loss', ...)
        scheduler_d.step()
        scheduler_g.step()

    fixed_z = Variable(torch.randn(args.batch_size, Z_dim, device=device))

    def evaluate(epoch):
        samples = generator(fixed_z).cpu().data.numpy()[:64]
        sg.log(torch.from_numpy(samples))   # (the sample grid it plots)

    epoch = 0
    while done[0] < steps:   # for epoch in range(2000):
        train(epoch)
        evaluate(epoch)
        epoch += 1
