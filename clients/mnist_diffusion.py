"""bot66/MNISTDiffusion: a DDPM on MNIST. A small U-Net (ShuffleNet-v2 style residual bottlenecks,
BatchNorm, SiLU, ``ChannelShuffle`` views, a time embedding) predicts the noise; the model's forward
draws the timesteps itself (``torch.randint`` on the CPU, ``.to(x.device)``) and gathers from its
registered cosine-schedule buffers; the step draws the noise (``torch.randn_like``). AdamW (lr 1e-3),
OneCycleLR stepped inside the step, and an EMA of the weights: torchvision's
``ExponentialMovingAverage`` (an ``AveragedModel`` with ``use_buffers=True``) updated inside the step
when ``global_steps % model_ema_steps == 0``, the counter ``global_steps += 1`` incremented there too.

Model: vendor/mnist_diffusion/ (model.py, unet.py, utils.py, verbatim). Loop: train_mnist.py ``main``
(lines 78-90): the step function is the per-batch body from ``noise=torch.randn_like(image)`` to
``global_steps+=1``; the ``loss.item()`` / ``get_last_lr()`` print every ``log_freq`` steps runs in
the loop on the returned loss. Scaled down: base_dim 8 instead of 64 (dim_mults [2,4] as main.py
passes), batch 8 instead of 128, synthetic 1x28x28 images in [-1, 1] (seeded), 4 batches an epoch,
``model_ema_steps`` 1 instead of 10 (the EMA updates at every step, as timm's ModelEma does; with
3, the branch on the counter gives a second graph, parity held, but each capture traces ~10k aten
ops (single-tensor AdamW and the EMA over ~130 tensors): 20-50 s on a loaded 2-core box),
``log_freq`` 2; the per-epoch checkpoint and the 1000-step sampling of 36 images are cut.
"""
import torch
import torch.nn as nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import OneCycleLR

from clients.vendor.mnist_diffusion.model import MNISTDiffusion
from clients.vendor.mnist_diffusion.utils import ExponentialMovingAverage

SOURCE = "https://github.com/bot66/MNISTDiffusion/blob/c7ba8e0/train_mnist.py"
LICENSE = "MIT"
TAGS = ("diffusion", "ddpm", "unet", "ema", "averaged-model", "rng-in-step", "randint-in-forward", "buffer-gather",
        "onecycle-in-step", "python-counter-in-step", "branch-on-counter", "adamw", "batchnorm")


class args:  # argparse defaults of train_mnist.py, scaled down
    lr = 0.001; batch_size = 8; epochs = 2; model_base_dim = 8; timesteps = 1000; model_ema_steps = 1
    model_ema_decay = 0.995; log_freq = 2


def main(sg, steps=8, device="cpu", amp=None):
    per_epoch = 4
    args.epochs = (steps + per_epoch - 1) // per_epoch
    g = torch.Generator().manual_seed(1)
    images = torch.rand(args.epochs * per_epoch * args.batch_size, 1, 28, 28, generator=g) * 2 - 1
    train_dataloader = [(images[i:i + args.batch_size], torch.zeros(args.batch_size, dtype=torch.long))
                        for i in range(0, len(images), args.batch_size)][:per_epoch]

    model=MNISTDiffusion(timesteps=args.timesteps,
                image_size=28,
                in_channels=1,
                base_dim=args.model_base_dim,
                dim_mults=[2,4]).to(device)

    #torchvision ema setting
    #https://github.com/pytorch/vision/blob/main/references/classification/train.py#L317
    adjust = 1* args.batch_size * args.model_ema_steps / args.epochs
    alpha = 1.0 - args.model_ema_decay
    alpha = min(1.0, alpha * adjust)
    model_ema = ExponentialMovingAverage(model, device=device, decay=1.0 - alpha)

    optimizer=AdamW(model.parameters(),lr=args.lr)
    scheduler=OneCycleLR(optimizer,args.lr,total_steps=args.epochs*len(train_dataloader),pct_start=0.25,anneal_strategy='cos')
    loss_fn=nn.MSELoss(reduction='mean')
    sg.track(model=model, model_ema=model_ema, optimizer=optimizer, scheduler=scheduler)

    global_steps=0

    @sg.compile
    def train_step(image):
        nonlocal global_steps
        noise=torch.randn_like(image).to(device)
        image=image.to(device)
        pred=model(image,noise)
        loss=loss_fn(pred,noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if global_steps%args.model_ema_steps==0:
            model_ema.update_parameters(model)
        global_steps+=1
        return loss

    it = 0
    for i in range(args.epochs):
        model.train()
        for j,(image,target) in enumerate(train_dataloader):
            loss = train_step(image)
            sg.log((loss, global_steps))
            if j%args.log_freq==0:
                loss.detach().cpu().item(), scheduler.get_last_lr()[0]  # print("Epoch[{}/{}],Step[{}/{}],loss:...")
            it += 1
            if it >= steps:
                return
