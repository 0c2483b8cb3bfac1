"""TeaPearce/Conditional_Diffusion_MNIST script.py (a minimal class-conditional DDPM "modified from
cloneofsimo/minDiffusion"): a ``ContextUnet`` (ResidualConvBlocks with BatchNorm and GELU, MaxPool
downs, ConvTranspose ups, GroupNorm, one-hot class and time embeddings through small MLPs,
classifier-free-guidance context masking) inside ``DDPM``, whose ``forward`` is the DDPM training
loss: ``torch.randint(1, n_T + 1, ...)`` timesteps (drawn on the CPU, then ``.to(device)``),
``torch.randn_like`` noise, ``x_t`` from the registered ``sqrtab`` / ``sqrtmab`` schedule buffers
indexed by the timesteps, a context-dropout mask ``torch.bernoulli(torch.zeros_like(c) + drop_prob)``,
and ``nn.MSELoss`` between the noise and the prediction. ``train_mnist``: Adam(lr 1e-4), the lr
decayed linearly per epoch (``optim.param_groups[0]['lr'] = lrate*(1-ep/n_epoch)``), ``ddpm.train()``
at each epoch's start, and per batch ``optim.zero_grad()``, ``loss = ddpm(x, c)``,
``loss.backward()``, the running ``loss_ema`` from ``loss.item()`` shown in the tqdm bar, then
``optim.step()``. The program keeps no EMA of the model (``loss_ema`` is the logged loss's).

Model: vendor/conditional_diffusion_mnist/script.py (the model classes, ``ddpm_schedules`` and
``DDPM`` without its sampler, verbatim). Loop: ``train_mnist`` (script.py lines 303-349): the whole
batch body is the step (``loss_ema`` is a closure variable the step rebinds, ``nonlocal``), as a
user would decorate it. Scaled down / replaced: n_feat 128 -> 16 (the script's knob), batch 256 ->
8, n_epoch 20 (kept; 2 batches an "epoch", so the lr changes every 2 steps), MNIST -> seeded
random 28x28 images in [0, 1) and labels (28x28 is fixed by the model's ``AvgPool2d(7)``);
the ``tqdm`` progress bar writes to a ``StringIO`` instead of stderr; the per-epoch
guided sampling (``ddpm.eval()``, ``ddpm.sample`` over all n_T=400 steps, image/gif saving) is
cut except the ``ddpm.eval()`` the next epoch's ``ddpm.train()`` undoes; no model saving.
"""
import io

import torch
from tqdm import tqdm

from clients.vendor.conditional_diffusion_mnist.script import DDPM, ContextUnet

SOURCE = "https://github.com/TeaPearce/Conditional_Diffusion_MNIST/blob/657b49854bbf844caa5580177243ae607c79339f/script.py"
LICENSE = "MIT"
TAGS = ("diffusion", "ddpm", "unet", "batchnorm", "groupnorm", "rng-in-step", "randint", "bernoulli",
        "adam", "per-epoch-lr", "item-in-step", "nonlocal-rebound-float", "tqdm")


def main(sg, steps=8, device="cpu", amp=None):
    # hardcoding these here
    n_epoch = 20
    batch_size = 8        # 256
    n_T = 400  # 500
    n_classes = 10
    n_feat = 16           # 128 ok, 256 better (but slower)
    lrate = 1e-4
    per_epoch = 2         # batches an "epoch" (MNIST: 235 of 256)

    ddpm = DDPM(nn_model=ContextUnet(in_channels=1, n_feat=n_feat, n_classes=n_classes), betas=(1e-4, 0.02), n_T=n_T, device=device, drop_prob=0.1)
    ddpm.to(device)

    g = torch.Generator().manual_seed(1)
    data = [(torch.rand(batch_size, 1, 28, 28, generator=g), torch.randint(0, n_classes, (batch_size,), generator=g))
            for _ in range(steps)]
    dataloader = [data[i:i + per_epoch] for i in range(0, steps, per_epoch)]
    optim = torch.optim.Adam(ddpm.parameters(), lr=lrate)
    sg.track(ddpm=ddpm, optim=optim)

    loss_ema = None
    pbar = None

    @sg.compile
    def train_batch(x, c):
        nonlocal loss_ema
        optim.zero_grad()
        x = x.to(device)
        c = c.to(device)
        loss = ddpm(x, c)
        loss.backward()
        if loss_ema is None:
            loss_ema = loss.item()
        else:
            loss_ema = 0.95 * loss_ema + 0.05 * loss.item()
        pbar.set_description(f"loss: {loss_ema:.4f}")
        optim.step()
        return loss

    for ep in range(n_epoch):
        if ep == len(dataloader):
            break
        ddpm.train()

        # linear lrate decay
        optim.param_groups[0]['lr'] = lrate*(1-ep/n_epoch)

        pbar = tqdm(dataloader[ep], file=io.StringIO())
        loss_ema = None
        for x, c in pbar:
            loss = train_batch(x, c)
            sg.log((loss, loss_ema, pbar.desc))

        # (the script then samples guided images in eval mode under no_grad and saves them)
        ddpm.eval()
