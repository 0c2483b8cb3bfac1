"""eriklindernoren/PyTorch-GAN cyclegan: two ResNet generators (G_AB, G_BA: ReflectionPad,
InstanceNorm, residual blocks, Upsample) and two PatchGAN discriminators (D_A, D_B), MSE GAN loss,
L1 cycle and identity losses; three Adam optimizers (``itertools.chain`` of both generators'
parameters, one per discriminator; lr 2e-4, betas (0.5, 0.999)) with ``LambdaLR`` schedulers (the
repo's linear-decay ``LambdaLR(...).step`` as ``lr_lambda``) stepped per epoch. Each batch: the
generator update (``G_AB.train()``, identity, GAN and cycle losses, ``loss_G.backward()``), then
each discriminator's update on the real batch and on a fake drawn from the repo's image pool,
``fake_A_buffer.push_and_pop(fake_A)`` (``ReplayBuffer`` in utils.py: it keeps ``.data`` of
generated images across steps and, once full, swaps with probability ``random.uniform(0, 1) >
0.5`` a stored image at ``random.randint(0, max_size - 1)``: host random).

Model: vendor/pytorch_gan/cyclegan_models.py (models.py, restated: same modules, names and
forward, not a copy). Pool and schedule: vendor/pytorch_gan/cyclegan_utils.py (utils.py, restated
likewise: the pool's ``self.data`` list and its ``random`` draws as there). Loop: cyclegan.py
lines 148-265: the whole per-batch body is the step function (the batch dict passed in;
``valid``/``fake`` built in it from ``np.ones``/``np.zeros`` as written). The progress line's
``.item()`` reads (and its ETA) are taken on the step's returned tensors outside it;
``sample_images`` (``G_AB.eval()``, ``G_BA.eval()``, both generators on a validation batch;
``make_grid``/``save_image`` dropped) runs every ``sample_interval`` batches, as written, and
leaves the generators in eval mode until the next step's ``.train()``. Scaled down: 256x256 ->
32x32 images (the smallest the PatchGAN's InstanceNorm allows), n_residual_blocks 9 -> 2, batch 1
(the default), validation batch 5 -> 1, sample_interval 100 -> 4, 4 batches an epoch, n_epochs 200
-> 4 with decay_epoch 100 -> 2, and the pool's ``max_size`` 50 -> 2
(``ReplayBuffer(max_size=2)``), so that the loop reaches the pool's steady state, where it draws,
within the run (the program gets there after 50 batches).
Synthetic unaligned image pairs in [-1, 1].
"""
import itertools

import numpy as np
import torch
from torch.autograd import Variable

from clients.vendor.pytorch_gan.cyclegan_models import Discriminator, GeneratorResNet, weights_init_normal
from clients.vendor.pytorch_gan.cyclegan_utils import LambdaLR, ReplayBuffer

SOURCE = "https://github.com/eriklindernoren/PyTorch-GAN/blob/36d3c77e5ff20ebe0aeefd322326a134a279b93e/implementations/cyclegan/cyclegan.py"
LICENSE = "MIT"
TAGS = ("gan", "cyclegan", "instancenorm", "three-optimizers", "adam", "itertools.chain", "lambdalr",
        "image-pool", "host-random-in-step", "tensors-kept-across-steps", "dict-batch", "train-eval-flip")


class opt:  # argparse defaults of cyclegan.py, scaled down
    epoch = 0; n_epochs = 4; batch_size = 1; lr = 0.0002; b1 = 0.5; b2 = 0.999; decay_epoch = 2
    img_height = 32; img_width = 32; channels = 3; sample_interval = 4; checkpoint_interval = -1
    n_residual_blocks = 2; lambda_cyc = 10.0; lambda_id = 5.0


pool_size = 2


class _Pools:
    """The two image pools' stored images, for the harness to compare (not the program's)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def state_dict(self):
        return {"fake_A_buffer": list(self.a.data), "fake_B_buffer": list(self.b.data)}


def main(sg, steps=8, device="cpu", amp=None, pool_in_step=True):
    # Losses
    criterion_GAN = torch.nn.MSELoss()
    criterion_cycle = torch.nn.L1Loss()
    criterion_identity = torch.nn.L1Loss()

    cuda = device == "cuda"
    input_shape = (opt.channels, opt.img_height, opt.img_width)

    # Initialize generator and discriminator
    G_AB = GeneratorResNet(input_shape, opt.n_residual_blocks)
    G_BA = GeneratorResNet(input_shape, opt.n_residual_blocks)
    D_A = Discriminator(input_shape)
    D_B = Discriminator(input_shape)
    if cuda:
        G_AB, G_BA, D_A, D_B = G_AB.cuda(), G_BA.cuda(), D_A.cuda(), D_B.cuda()
    G_AB.apply(weights_init_normal)
    G_BA.apply(weights_init_normal)
    D_A.apply(weights_init_normal)
    D_B.apply(weights_init_normal)

    # Optimizers
    optimizer_G = torch.optim.Adam(
        itertools.chain(G_AB.parameters(), G_BA.parameters()), lr=opt.lr, betas=(opt.b1, opt.b2)
    )
    optimizer_D_A = torch.optim.Adam(D_A.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
    optimizer_D_B = torch.optim.Adam(D_B.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))

    # Learning rate update schedulers
    lr_scheduler_G = torch.optim.lr_scheduler.LambdaLR(
        optimizer_G, lr_lambda=LambdaLR(opt.n_epochs, opt.epoch, opt.decay_epoch).step
    )
    lr_scheduler_D_A = torch.optim.lr_scheduler.LambdaLR(
        optimizer_D_A, lr_lambda=LambdaLR(opt.n_epochs, opt.epoch, opt.decay_epoch).step
    )
    lr_scheduler_D_B = torch.optim.lr_scheduler.LambdaLR(
        optimizer_D_B, lr_lambda=LambdaLR(opt.n_epochs, opt.epoch, opt.decay_epoch).step
    )

    Tensor = torch.cuda.FloatTensor if cuda else torch.Tensor

    # Buffers of previously generated samples
    fake_A_buffer = ReplayBuffer(max_size=pool_size)
    fake_B_buffer = ReplayBuffer(max_size=pool_size)

    g = torch.Generator().manual_seed(1)
    per_epoch = 4
    dataloader = [{"A": torch.rand(opt.batch_size, *input_shape, generator=g) * 2 - 1,
                   "B": torch.rand(opt.batch_size, *input_shape, generator=g) * 2 - 1}
                  for _ in range(per_epoch)]
    val_batch = {"A": torch.rand(1, *input_shape, generator=g) * 2 - 1,
                 "B": torch.rand(1, *input_shape, generator=g) * 2 - 1}
    sg.track(G_AB=G_AB, G_BA=G_BA, D_A=D_A, D_B=D_B, optimizer_G=optimizer_G, optimizer_D_A=optimizer_D_A,
             optimizer_D_B=optimizer_D_B, pools=_Pools(fake_A_buffer, fake_B_buffer))

    def sample_images(batches_done):
        """Saves a generated sample from the test set"""
        imgs = val_batch
        G_AB.eval()
        G_BA.eval()
        real_A = Variable(imgs["A"].type(Tensor))
        fake_B = G_AB(real_A)
        real_B = Variable(imgs["B"].type(Tensor))
        fake_A = G_BA(real_B)
        # (make_grid of the four, torch.cat along y, save_image: dropped)

    @sg.compile
    def train_step(batch):
        # Set model input
        real_A = Variable(batch["A"].type(Tensor))
        real_B = Variable(batch["B"].type(Tensor))

        # Adversarial ground truths
        valid = Variable(Tensor(np.ones((real_A.size(0), *D_A.output_shape))), requires_grad=False)
        fake = Variable(Tensor(np.zeros((real_A.size(0), *D_A.output_shape))), requires_grad=False)

        # ------------------
        #  Train Generators
        # ------------------

        G_AB.train()
        G_BA.train()

        optimizer_G.zero_grad()

        # Identity loss
        loss_id_A = criterion_identity(G_BA(real_A), real_A)
        loss_id_B = criterion_identity(G_AB(real_B), real_B)

        loss_identity = (loss_id_A + loss_id_B) / 2

        # GAN loss
        fake_B = G_AB(real_A)
        loss_GAN_AB = criterion_GAN(D_B(fake_B), valid)
        fake_A = G_BA(real_B)
        loss_GAN_BA = criterion_GAN(D_A(fake_A), valid)

        loss_GAN = (loss_GAN_AB + loss_GAN_BA) / 2

        # Cycle loss
        recov_A = G_BA(fake_B)
        loss_cycle_A = criterion_cycle(recov_A, real_A)
        recov_B = G_AB(fake_A)
        loss_cycle_B = criterion_cycle(recov_B, real_B)

        loss_cycle = (loss_cycle_A + loss_cycle_B) / 2

        # Total loss
        loss_G = loss_GAN + opt.lambda_cyc * loss_cycle + opt.lambda_id * loss_identity

        loss_G.backward()
        optimizer_G.step()

        # -----------------------
        #  Train Discriminator A
        # -----------------------

        optimizer_D_A.zero_grad()

        # Real loss
        loss_real = criterion_GAN(D_A(real_A), valid)
        # Fake loss (on batch of previously generated samples)
        fake_A_ = fake_A_buffer.push_and_pop(fake_A)
        loss_fake = criterion_GAN(D_A(fake_A_.detach()), fake)
        # Total loss
        loss_D_A = (loss_real + loss_fake) / 2

        loss_D_A.backward()
        optimizer_D_A.step()

        # -----------------------
        #  Train Discriminator B
        # -----------------------

        optimizer_D_B.zero_grad()

        # Real loss
        loss_real = criterion_GAN(D_B(real_B), valid)
        # Fake loss (on batch of previously generated samples)
        fake_B_ = fake_B_buffer.push_and_pop(fake_B)
        loss_fake = criterion_GAN(D_B(fake_B_.detach()), fake)
        # Total loss
        loss_D_B = (loss_real + loss_fake) / 2

        loss_D_B.backward()
        optimizer_D_B.step()

        loss_D = (loss_D_A + loss_D_B) / 2
        return loss_D, loss_G, loss_GAN, loss_cycle, loss_identity

    # cyclegan_pool_outside: the same statements, split where the image pool is used, so the pool
    # runs in the loop between two steps (the fix the refusal names).
    @sg.compile
    def train_generators(batch):
        real_A = Variable(batch["A"].type(Tensor))
        real_B = Variable(batch["B"].type(Tensor))
        valid = Variable(Tensor(np.ones((real_A.size(0), *D_A.output_shape))), requires_grad=False)
        G_AB.train()
        G_BA.train()
        optimizer_G.zero_grad()
        loss_id_A = criterion_identity(G_BA(real_A), real_A)
        loss_id_B = criterion_identity(G_AB(real_B), real_B)
        loss_identity = (loss_id_A + loss_id_B) / 2
        fake_B = G_AB(real_A)
        loss_GAN_AB = criterion_GAN(D_B(fake_B), valid)
        fake_A = G_BA(real_B)
        loss_GAN_BA = criterion_GAN(D_A(fake_A), valid)
        loss_GAN = (loss_GAN_AB + loss_GAN_BA) / 2
        recov_A = G_BA(fake_B)
        loss_cycle_A = criterion_cycle(recov_A, real_A)
        recov_B = G_AB(fake_A)
        loss_cycle_B = criterion_cycle(recov_B, real_B)
        loss_cycle = (loss_cycle_A + loss_cycle_B) / 2
        loss_G = loss_GAN + opt.lambda_cyc * loss_cycle + opt.lambda_id * loss_identity
        loss_G.backward()
        optimizer_G.step()
        return fake_A, fake_B, (loss_G, loss_GAN, loss_cycle, loss_identity)

    @sg.compile
    def train_discriminators(batch, fake_A_, fake_B_):
        real_A = Variable(batch["A"].type(Tensor))
        real_B = Variable(batch["B"].type(Tensor))
        valid = Variable(Tensor(np.ones((real_A.size(0), *D_A.output_shape))), requires_grad=False)
        fake = Variable(Tensor(np.zeros((real_A.size(0), *D_A.output_shape))), requires_grad=False)
        optimizer_D_A.zero_grad()
        loss_real = criterion_GAN(D_A(real_A), valid)
        loss_fake = criterion_GAN(D_A(fake_A_.detach()), fake)
        loss_D_A = (loss_real + loss_fake) / 2
        loss_D_A.backward()
        optimizer_D_A.step()
        optimizer_D_B.zero_grad()
        loss_real = criterion_GAN(D_B(real_B), valid)
        loss_fake = criterion_GAN(D_B(fake_B_.detach()), fake)
        loss_D_B = (loss_real + loss_fake) / 2
        loss_D_B.backward()
        optimizer_D_B.step()
        loss_D = (loss_D_A + loss_D_B) / 2
        return loss_D

    def pool_outside(batch):
        fake_A, fake_B, (loss_G, loss_GAN, loss_cycle, loss_identity) = train_generators(batch)
        fake_A_ = fake_A_buffer.push_and_pop(fake_A)
        fake_B_ = fake_B_buffer.push_and_pop(fake_B)
        loss_D = train_discriminators(batch, fake_A_, fake_B_)
        return loss_D, loss_G, loss_GAN, loss_cycle, loss_identity

    it = 0
    for epoch in range(opt.epoch, opt.n_epochs):
        for i, batch in enumerate(dataloader):
            losses = train_step(batch) if pool_in_step else pool_outside(batch)
            sg.log(losses)
            loss_D, loss_G, loss_GAN, loss_cycle, loss_identity = losses

            # Determine approximate time left (the ETA: dropped)
            batches_done = epoch * len(dataloader) + i

            # Print log
            loss_D.item(), loss_G.item(), loss_GAN.item(), loss_cycle.item(), loss_identity.item()

            # If at sample interval save image
            if batches_done % opt.sample_interval == 0:
                sample_images(batches_done)
            it += 1
            if it >= steps:
                return

        # Update learning rates
        lr_scheduler_G.step()
        lr_scheduler_D_A.step()
        lr_scheduler_D_B.step()
