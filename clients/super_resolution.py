"""pytorch/examples super_resolution: ESPCN (four convs with orthogonal init, ``nn.PixelShuffle``
sub-pixel upsampling) trained on the Y channel with ``nn.MSELoss`` and Adam (lr 0.01); the per-batch
body accumulates ``epoch_loss += loss.item()`` between the forward and ``loss.backward()``, and
``test()`` computes PSNR with ``math.log10(1 / mse.item())`` under ``torch.no_grad()`` between epochs.

Model: vendor/pytorch_examples/super_resolution_model.py (verbatim). Loop: main.py ``train(epoch)``
(lines 46-59) and ``test()`` (62-71), the epoch loop (80-83). The step function is the per-batch body
of ``train`` from ``optimizer.zero_grad()`` to ``optimizer.step()``, as a user would decorate it; the
accumulator ``epoch_loss`` is a local of ``train()`` in main.py, a module global here (a step function
at module level reaches it with ``global``). Scaled down: ``--upscale_factor 3`` (the README's),
synthetic 1x16x16 inputs and 1x48x48 targets (main.py: BSDS300 crops, Y channel) from a seeded
generator, batch 4, 4 batches an epoch, 4 test images; no printing, no checkpoint files.
"""
from math import log10

import torch
import torch.nn as nn
import torch.optim as optim

from clients.vendor.pytorch_examples.super_resolution_model import Net

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/super_resolution/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("cnn", "pixel-shuffle", "orthogonal-init", "mse", "adam", "item-in-step", "python-accumulator")


class opt:  # argparse defaults of main.py (and the README's upscale factor), scaled down
    upscale_factor = 3; batchSize = 4; testBatchSize = 4; nEpochs = 2; lr = 0.01; seed = 123


epoch_loss = 0


def main(sg, steps=8, device="cpu", amp=None):
    per_epoch = 4
    g = torch.Generator().manual_seed(1)
    hi = torch.rand(steps * opt.batchSize + opt.testBatchSize, 1, 48, 48, generator=g)
    lo = torch.nn.functional.avg_pool2d(hi, opt.upscale_factor)  # (main.py: Resize(crop // factor))
    training_data_loader = [(lo[i:i + opt.batchSize], hi[i:i + opt.batchSize])
                            for i in range(0, steps * opt.batchSize, opt.batchSize)]
    testing_data_loader = [(lo[-opt.testBatchSize:], hi[-opt.testBatchSize:])]
    opt.nEpochs = (steps + per_epoch - 1) // per_epoch

    model = Net(upscale_factor=opt.upscale_factor).to(device)
    criterion = nn.MSELoss()

    optimizer = optim.Adam(model.parameters(), lr=opt.lr)
    sg.track(model=model, optimizer=optimizer)

    @sg.compile
    def train_step(input, target):
        global epoch_loss
        optimizer.zero_grad()
        loss = criterion(model(input), target)
        epoch_loss += loss.item()
        loss.backward()
        optimizer.step()
        return loss

    def train(epoch):
        global epoch_loss
        epoch_loss = 0
        for iteration, batch in enumerate(training_data_loader[(epoch - 1) * per_epoch:epoch * per_epoch], 1):
            input, target = batch[0].to(device), batch[1].to(device)
            loss = train_step(input, target)
            sg.log(loss)
            loss.item()  # print("===> Epoch[{}]({}/{}): Loss: {:.4f}" ...)
        sg.log(epoch_loss / per_epoch)  # print("===> Epoch {} Complete: Avg. Loss: {:.4f}" ...)

    def test():
        avg_psnr = 0
        with torch.no_grad():
            for batch in testing_data_loader:
                input, target = batch[0].to(device), batch[1].to(device)

                prediction = model(input)
                mse = criterion(prediction, target)
                psnr = 10 * log10(1 / mse.item())
                avg_psnr += psnr
        sg.log(avg_psnr / len(testing_data_loader))

    for epoch in range(1, opt.nEpochs + 1):
        train(epoch)
        test()
