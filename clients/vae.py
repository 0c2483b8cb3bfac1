"""pytorch/examples vae: the MNIST variational autoencoder. An MLP encoder (784 -> 400, ReLU, then
two 400 -> 20 heads for the mean and the log-variance), the reparameterization trick drawing its
noise with ``torch.randn_like`` inside the forward, an MLP decoder (20 -> 400, ReLU, 400 -> 784,
sigmoid); the loss is the summed binary cross-entropy of the reconstruction plus the KL divergence
to N(0, I); Adam lr 1e-3. Each epoch: ``train()`` (``model.train()``, per batch ``zero_grad``,
forward, loss, ``backward()``, ``train_loss += loss.item()``, ``step()``), then ``test()`` under
``model.eval()`` + ``torch.no_grad()``, then 64 images decoded from ``torch.randn(64, 20)``: so
the global RNG moves between epochs outside the step, and the step's own draw must follow it.

Model and loss: main.py lines 46-72 (``class VAE``) and 79-89 (``loss_function``), restated here
(no vendor file). Loop: ``train(epoch)`` (lines 92-110); the step is its batch body (lines 97-102)
with ``train_loss += loss.item()`` kept where main.py has it, between ``backward()`` and ``step()``
(a host read inside the step; ``train_loss`` is a module global here, reset by ``train()``, so the
step can add to it); the per-batch print's ``loss.item() / len(data)`` (lines 103-107) is read on
the returned loss. ``test(epoch)`` (lines 113-129) and the epoch loop (lines 131-139). Scaled down:
synthetic MNIST-like 1x28x28 images in [0, 1] (``transforms.ToTensor()``'s range, which
``binary_cross_entropy`` needs) from a seeded ``torch.Generator``, batch 8 instead of 128, 2
batches per epoch (``steps=8`` is 4 epochs), one 8-image test batch, log_interval 1; no torchvision,
no image saving, no printing (the printed values are logged with ``sg.log``). ``amp`` is ignored:
main.py has no autocast path.

Restated after the source, not copied.
"""
import torch
from torch import nn, optim
from torch.nn import functional as F

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/vae/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("vae", "mlp", "adam", "rng-in-step", "sum-loss", "item-in-step", "global-accumulators",
        "train-eval-toggle")


class args:  # argparse defaults of main.py, scaled down
    batch_size = 8; log_interval = 1


class VAE(nn.Module):
    """main.py's VAE: same layers, created in the same order (so the same initial weights)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 400)   # encoder trunk
        self.fc21 = nn.Linear(400, 20)   # mean head
        self.fc22 = nn.Linear(400, 20)   # log-variance head
        self.fc3 = nn.Linear(20, 400)    # decoder trunk
        self.fc4 = nn.Linear(400, 784)   # decoder output

    def encode(self, x):
        hidden = F.relu(self.fc1(x))
        return self.fc21(hidden), self.fc22(hidden)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        noise = torch.randn_like(std)    # drawn from the global RNG at every forward
        return mu + noise * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        return self.decode(self.reparameterize(mu, logvar)), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    """Summed reconstruction BCE plus KL(q(z|x) || N(0, I)) (Kingma & Welling, appendix B)."""
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction='sum')
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


model = optimizer = train_loader = test_loader = device = train_step = _sg = None
train_loss = 0  # main.py's train()-local accumulator, global so the step can add to it


def train(epoch):
    global train_loss
    model.train()
    train_loss = 0
    for batch_idx, (data, _) in enumerate(train_loader):
        data = data.to(device)
        loss = train_step(data)
        _sg.log(loss)
        if batch_idx % args.log_interval == 0:
            _sg.log(loss.item() / len(data))  # 'Train Epoch: ... Loss: {:.6f}'
    _sg.log(train_loss / (len(train_loader) * args.batch_size))  # '====> Epoch: {} Average loss'


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
                comparison = torch.cat([data[:n], recon_batch.view(args.batch_size, 1, 28, 28)[:n]])
                _sg.log(comparison)  # (save_image of the reconstructions)
    test_loss /= len(test_loader) * args.batch_size
    _sg.log(test_loss)  # '====> Test set loss: {:.4f}'


def main(sg, steps=8, device="cpu", amp=None):
    global model, optimizer, train_loader, test_loader, train_step, _sg
    _sg = sg
    globals()["device"] = device  # main.py's module-level `device`

    per_epoch = 2
    g = torch.Generator().manual_seed(1)
    images = torch.rand(steps * args.batch_size, 1, 28, 28, generator=g)
    labels = torch.zeros(steps * args.batch_size, dtype=torch.long)  # (MNIST labels, unused)
    batches = [(images[i:i + args.batch_size], labels[i:i + args.batch_size])
               for i in range(0, steps * args.batch_size, args.batch_size)]
    test_loader = [(torch.rand(args.batch_size, 1, 28, 28, generator=g),
                    torch.zeros(args.batch_size, dtype=torch.long))]
    epochs = [batches[i:i + per_epoch] for i in range(0, steps, per_epoch)]

    model = VAE().to(device)
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    sg.track(model=model, optimizer=optimizer)

    @sg.compile
    def train_step(data):
        global train_loss
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        train_loss += loss.item()
        optimizer.step()
        return loss

    for epoch in range(1, len(epochs) + 1):
        train_loader = epochs[epoch - 1]
        train(epoch)
        test(epoch)
        with torch.no_grad():
            sample = model.decode(torch.randn(64, 20).to(device)).cpu()
            _sg.log(sample)  # (save_image(sample.view(64, 1, 28, 28), ...))
