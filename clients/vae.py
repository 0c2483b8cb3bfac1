"""pytorch/examples vae: the MNIST variational autoencoder (784-400-20 encoder, reparameterization
with ``torch.randn_like`` inside the forward, 20-400-784 decoder), the summed BCE + KLD
``loss_function``, Adam lr 1e-3; ``model.train()`` per epoch, ``test()`` under ``model.eval()`` +
``no_grad`` and a ``decode`` of ``torch.randn(64, 20)`` samples after each epoch.

Model: vendor/pytorch_examples/vae_main.py (``class VAE`` and ``loss_function``, verbatim). Loop:
main.py's ``train()`` (lines 90-108: ``optimizer.zero_grad()``, forward, ``loss_function``,
``backward()``, ``train_loss += loss.item()``, ``optimizer.step()``) with its ``test()`` (lines
111-126) and epoch loop (lines 129-135). ``train_loss += loss.item()`` sits between ``backward()``
and ``step()`` in main.py; here it reads the step's returned loss right after the step. Scaled
down: synthetic 1x28x28 "images" in [0, 1] from a seeded generator (``transforms.ToTensor()``
range; ``binary_cross_entropy`` needs targets in [0, 1]), batch 16 instead of 128, 4 batches per
epoch, a 16-image test set, log_interval 1; no image saving, no printing.
"""
import torch
from torch import optim

from clients.vendor.pytorch_examples.vae_main import VAE, loss_function

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/vae/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("vae", "mlp", "adam", "rng-in-step", "sum-loss", "train-eval-toggle")


class args:  # argparse defaults of main.py, scaled down
    batch_size = 16; log_interval = 1


model = None
optimizer = None
train_loader = None
test_loader = None
device = None
train_step = None
_sg = None  # the harness's recorder, for the values main.py prints


def train(epoch):
    model.train()
    train_loss = 0
    for batch_idx, (data, _) in enumerate(train_loader):
        data = data.to(device)
        loss = train_step(data)
        _sg.log(loss)
        train_loss += loss.item()
        if batch_idx % args.log_interval == 0:
            loss.item() / len(data)  # main.py prints 'Train Epoch: ... Loss: {:.6f}'
    _sg.log(train_loss / (len(train_loader) * args.batch_size))  # '====> Epoch: {} Average loss: {:.4f}'


def test(epoch):
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for i, (data, _) in enumerate(test_loader):
            data = data.to(device)
            recon_batch, mu, logvar = model(data)
            test_loss += loss_function(recon_batch, data, mu, logvar).item()
            if i == 0:
                n = min(data.size(0), 8)
                comparison = torch.cat([data[:n],
                                      recon_batch.view(args.batch_size, 1, 28, 28)[:n]])
                # (save_image(comparison.cpu(), 'results/reconstruction_' + str(epoch) + '.png', nrow=n))

    test_loss /= len(test_loader) * args.batch_size
    _sg.log(test_loss)


def main(sg, steps=8, device="cpu", amp=None):
    global model, optimizer, train_loader, test_loader, train_step, _sg
    _sg = sg
    globals()["device"] = device  # main.py's module-level `device` (this parameter shadows the name here)

    per_epoch = 4
    g = torch.Generator().manual_seed(1)
    images = torch.rand(steps * args.batch_size, 1, 28, 28, generator=g)
    batches = [(images[i:i + args.batch_size], torch.zeros(args.batch_size, dtype=torch.long))
               for i in range(0, steps * args.batch_size, args.batch_size)]
    test_loader = [(torch.rand(args.batch_size, 1, 28, 28, generator=g), torch.zeros(args.batch_size, dtype=torch.long))]
    epochs = [batches[i:i + per_epoch] for i in range(0, steps, per_epoch)]

    model = VAE().to(device)
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    sg.track(model=model, optimizer=optimizer)

    @sg.compile
    def train_step(data):
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        optimizer.step()
        return loss

    for epoch in range(1, len(epochs) + 1):
        train_loader = epochs[epoch - 1]
        train(epoch)
        test(epoch)
        with torch.no_grad():
            sample = torch.randn(64, 20).to(device)
            sample = model.decode(sample).cpu()
            _sg.log(sample)  # (save_image(sample.view(64, 1, 28, 28), 'results/sample_' + str(epoch) + '.png'))
