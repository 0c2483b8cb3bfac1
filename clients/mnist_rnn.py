"""pytorch/examples mnist_rnn: MNIST rows fed to an ``nn.LSTM`` (batch_first, hidden 64), the last
output through ``BatchNorm1d``, ``Dropout2d`` on a 2-d tensor (PyTorch treats it as unbatched
channels), two linears and ``log_softmax``; Adadelta (lr 0.1) with a StepLR (gamma 0.7) stepped once
per epoch, ``F.nll_loss``; ``model.train()`` in ``train()``, ``model.eval()`` + ``torch.no_grad()`` in
``test()`` between epochs (BatchNorm and dropout switch between step calls).

Model: vendor/pytorch_examples/mnist_rnn_main.py (``class Net``, verbatim). Loop: main.py's ``train()``
(lines 42-56: ``optimizer.zero_grad()``, forward, ``F.nll_loss``, ``backward()``, ``optimizer.step()``,
``loss.item()`` every ``log_interval`` batches), ``test()`` (lines 59-78) and the epoch loop of
``main()`` (lines 128-132). Scaled down: synthetic 1x28x28 images (the LSTM reads 28 rows of 28) and
labels from a seeded generator, batch 8 instead of 64, 2 batches per epoch (``steps=8`` is 4 epochs),
a 16-image test set, log_interval 1; no printing, no torchvision, no ``--save-model``.
"""
import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

from clients.vendor.pytorch_examples.mnist_rnn_main import Net

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/mnist_rnn/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("rnn", "lstm", "batchnorm1d", "dropout2d", "classification", "adadelta", "steplr", "train-eval-toggle")


class args:  # argparse defaults of main.py, scaled down
    batch_size = 8; test_batch_size = 16; lr = 0.1; gamma = 0.7; log_interval = 1; dry_run = False


def main(sg, steps=8, device="cpu", amp=None):
    per_epoch = 2
    g = torch.Generator().manual_seed(1)
    images = (torch.rand(steps * args.batch_size, 1, 28, 28, generator=g) - 0.1307) / 0.3081
    labels = torch.randint(0, 10, (steps * args.batch_size,), generator=g)
    batches = [(images[i:i + args.batch_size], labels[i:i + args.batch_size])
               for i in range(0, steps * args.batch_size, args.batch_size)]
    test_images = (torch.rand(args.test_batch_size, 1, 28, 28, generator=g) - 0.1307) / 0.3081
    test_labels = torch.randint(0, 10, (args.test_batch_size,), generator=g)
    test_loader = [(test_images, test_labels)]
    epochs = [batches[i:i + per_epoch] for i in range(0, steps, per_epoch)]

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    sg.track(model=model, opt=optimizer)

    @sg.compile
    def train_step(data, target):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        return loss

    def train(args, model, device, train_loader, optimizer, epoch):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            loss = train_step(data, target)
            sg.log(loss)
            if batch_idx % args.log_interval == 0:
                loss.item()  # main.py prints 'Train Epoch: ... Loss: {:.6f}'
                if args.dry_run:
                    break

    def test(args, model, device, test_loader):
        model.eval()
        test_loss = 0
        correct = 0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction='sum').item()  # sum up batch loss
                pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
                correct += pred.eq(target.view_as(pred)).sum().item()
                if args.dry_run:
                    break
        test_loss /= args.test_batch_size
        sg.log((test_loss, correct))

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    sg.track(scheduler=scheduler)
    for epoch in range(1, len(epochs) + 1):
        train(args, model, device, epochs[epoch - 1], optimizer, epoch)
        test(args, model, device, test_loader)
        scheduler.step()
