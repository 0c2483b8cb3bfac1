"""pytorch/examples super_resolution: the sub-pixel convolution network of Shi et al. (ESPCN)
trained to upscale the luminance channel of an image. ``Net`` (model.py): ``conv1`` 5x5 1->64,
``conv2`` 3x3 64->64, ``conv3`` 3x3 64->32 (each followed by the shared ``nn.ReLU``), ``conv4`` 3x3
32->upscale_factor**2 and ``nn.PixelShuffle(upscale_factor)`` rearranging those channels into an
image ``upscale_factor`` times larger; ``_initialize_weights`` draws every conv weight with
``init.orthogonal_`` (gain ``calculate_gain('relu')`` for conv1-3, 1 for conv4), biases keep
Conv2d's default init. main.py: ``torch.manual_seed(opt.seed)``, ``nn.MSELoss()``,
``optim.Adam(model.parameters(), lr=opt.lr)``; per epoch ``train(epoch)`` (``epoch_loss = 0``;
per batch ``input, target = batch[0].to(device), batch[1].to(device)``, ``optimizer.zero_grad()``,
``loss = criterion(model(input), target)``, ``epoch_loss += loss.item()``, ``loss.backward()``,
``optimizer.step()``, and the per-iteration print of ``loss.item()``; then the epoch's average),
then ``test()`` (PSNR ``10 * log10(1 / mse.item())`` under ``torch.no_grad()``) and
``checkpoint(epoch)``.

The step is the per-batch body of ``train(epoch)``, from the ``.to(device)`` to the print, as a
user putting ``@stepgraph.compile`` on it would write it: the batch and the iteration number
passed in, ``epoch_loss`` written through ``nonlocal`` (the one restructuring: ``epoch_loss`` lives
in ``main``'s scope, reset by ``train(epoch)`` at the start of each epoch, instead of being
``train``'s local, so that the step is defined once). The epoch's summary print, ``test()`` and the
loop over epochs stay as the program writes them.

Source: https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/super_resolution/main.py
(and model.py there), BSD-3-Clause. Restated after the source, not copied: same modules, names,
init, ops and order. Deviations: the BSDS300 download and its ``DatasetFromFolder`` (YCbCr images,
Y channel; target ``CenterCrop(crop_size)``, input additionally ``Resize(crop_size //
upscale_factor)``) are replaced by synthetic luminance crops in [0, 1] with the low-resolution
input made from each by bilinear antialiased downsampling, in a ``TensorDataset`` read by the same
``DataLoader(shuffle=True)`` (``num_workers`` 0); ``checkpoint(epoch)``'s ``torch.save`` of the
model is left out (no files); argparse replaced by an ``opt`` class. Scaled down: crop 256 -> 24
(upscale_factor 3, so inputs 8x8), batchSize 64 -> 4, 16 training images (4 batches an epoch),
testBatchSize 10 -> 4 with 4 test images, nEpochs 2 (as the default).
"""
from math import log10

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.init as init
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

SOURCE = ("https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/"
          "super_resolution/main.py")
LICENSE = "BSD-3-Clause"
TAGS = ("cnn", "super-resolution", "pixel-shuffle", "orthogonal-init", "mse", "adam", "item-in-step",
        "nonlocal-accumulator", "print-in-step", "dataloader")


class Net(nn.Module):
    def __init__(self, upscale_factor):
        super(Net, self).__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(1, 64, (5, 5), (1, 1), (2, 2))
        self.conv2 = nn.Conv2d(64, 64, (3, 3), (1, 1), (1, 1))
        self.conv3 = nn.Conv2d(64, 32, (3, 3), (1, 1), (1, 1))
        self.conv4 = nn.Conv2d(32, upscale_factor ** 2, (3, 3), (1, 1), (1, 1))
        self.pixel_shuffle = nn.PixelShuffle(upscale_factor)
        self._initialize_weights()

    def forward(self, x):
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        x = self.relu(self.conv3(x))
        return self.pixel_shuffle(self.conv4(x))

    def _initialize_weights(self):
        relu_gain = init.calculate_gain('relu')
        init.orthogonal_(self.conv1.weight, relu_gain)
        init.orthogonal_(self.conv2.weight, relu_gain)
        init.orthogonal_(self.conv3.weight, relu_gain)
        init.orthogonal_(self.conv4.weight)


class opt:  # main.py's arguments, scaled down (--upscale_factor 3 is the README's command)
    upscale_factor = 3; batchSize = 4; testBatchSize = 4; nEpochs = 2; lr = 0.01; accel = False
    threads = 0; seed = 123


crop_size = 24      # calculate_valid_crop_size(256, 3) = 255 in the program
n_train, n_test = 16, 4


def _synthetic_set(n, g):
    """(input, target) pairs as DatasetFromFolder gives them: the Y channel of a crop, and the same
    crop downscaled by upscale_factor."""
    target = torch.rand(n, 1, crop_size, crop_size, generator=g)
    input = F.interpolate(target, size=crop_size // opt.upscale_factor, mode='bilinear', antialias=True,
                          align_corners=False).clamp_(0, 1)
    return TensorDataset(input, target)


def main(sg, steps=8, device="cpu", amp=None):
    torch.manual_seed(opt.seed)
    device = torch.device(device)

    g = torch.Generator().manual_seed(1)
    train_set = _synthetic_set(n_train, g)
    test_set = _synthetic_set(n_test, g)
    training_data_loader = DataLoader(dataset=train_set, num_workers=opt.threads, batch_size=opt.batchSize,
                                      shuffle=True)
    testing_data_loader = DataLoader(dataset=test_set, num_workers=opt.threads, batch_size=opt.testBatchSize,
                                     shuffle=False)

    model = Net(upscale_factor=opt.upscale_factor).to(device)
    criterion = nn.MSELoss()
    optimizer = optim.Adam(model.parameters(), lr=opt.lr)
    sg.track(model=model, optimizer=optimizer)

    epoch_loss = 0

    @sg.compile
    def train_batch(batch, epoch, iteration):
        nonlocal epoch_loss
        input, target = batch[0].to(device), batch[1].to(device)

        optimizer.zero_grad()
        loss = criterion(model(input), target)
        epoch_loss += loss.item()
        loss.backward()
        optimizer.step()

        print("===> Epoch[{}]({}/{}): Loss: {:.4f}".format(epoch, iteration, len(training_data_loader),
                                                         loss.item()))
        return loss

    done = 0

    def train(epoch):
        nonlocal epoch_loss, done
        epoch_loss = 0
        for iteration, batch in enumerate(training_data_loader, 1):
            if done == steps:
                break
            loss = train_batch(batch, epoch, iteration)
            sg.log((loss, epoch_loss))
            done += 1

        print("===> Epoch {} Complete: Avg. Loss: {:.4f}".format(epoch, epoch_loss / len(training_data_loader)))

    def test():
        avg_psnr = 0
        with torch.no_grad():
            for batch in testing_data_loader:
                input, target = batch[0].to(device), batch[1].to(device)

                prediction = model(input)
                mse = criterion(prediction, target)
                psnr = 10 * log10(1 / mse.item())
                avg_psnr += psnr
        print("===> Avg. PSNR: {:.4f} dB".format(avg_psnr / len(testing_data_loader)))
        return avg_psnr / len(testing_data_loader)

    for epoch in range(1, opt.nEpochs + 1):
        train(epoch)
        sg.log(test())
        # checkpoint(epoch): torch.save(model, ...) left out (no files)
