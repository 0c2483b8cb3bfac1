"""pytorch/examples siamese_network: a Siamese network (torchvision ResNet-18 trunk with a 1-channel
stem, shared across both inputs; concatenated features -> MLP -> sigmoid) trained with BCELoss,
Adadelta (lr 1.0) and StepLR(step_size=1, gamma=0.7) stepped per epoch; ``test`` between epochs.

Model: vendor/pytorch_examples/siamese_network_model.py (main.py lines 16-78, verbatim) on the
vendored torchvision ResNet-18 (vendor/pytorch_vision/resnet.py; ``torchvision.models.resnet18(
weights=None)`` is served by vendor/pytorch_vision/models_shim.py). Loop: main.py ``train`` (lines
190-208: the per-batch body, ``loss.item()`` in the log line every ``log_interval`` batches),
``test`` (211-234) and the epoch loop of ``main`` (292-295). Data: instead of APP_MATCHER over MNIST,
synthetic 1x28x28 image pairs with the dataset's targets (1.0 for even indices: same class; 0.0 for
odd). Scaled down: batch 64 -> 8, test batch 1000 -> 8 (one test batch), 4 batches an "epoch",
log_interval 10 -> 2.
"""
import torch
import torch.nn as nn
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

from clients.vendor.pytorch_examples.siamese_network_model import SiameseNetwork

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/siamese_network/main.py"
LICENSE = "BSD-3-Clause"
TAGS = ("cnn", "resnet", "siamese", "shared-weights", "batchnorm", "bce", "adadelta", "steplr", "item-in-log",
        "torchvision")


class args:  # argparse defaults of siamese_network/main.py, scaled down
    batch_size = 8; test_batch_size = 8; epochs = 14; lr = 1.0; gamma = 0.7; dry_run = False
    log_interval = 2


batches_per_epoch = 4


class SyntheticPairs:
    """APP_MATCHER's output format: (image_1, image_2, target) with target 1. for even indices."""

    def __init__(self, n, g):
        self.images_1 = torch.rand(n, 1, 28, 28, generator=g) * 255
        self.images_2 = torch.rand(n, 1, 28, 28, generator=g) * 255
        self.targets = (torch.arange(n) % 2 == 0).float()

    def __len__(self):
        return self.images_1.shape[0]

    def batches(self, batch_size, start=0, count=None):
        count = -(-len(self) // batch_size) if count is None else count
        for b in range(start, start + count):
            s = slice(b * batch_size, (b + 1) * batch_size)
            yield self.images_1[s], self.images_2[s], self.targets[s]


def main(sg, steps=8, device="cpu", amp=None):
    g = torch.Generator().manual_seed(1)
    train_dataset = SyntheticPairs(steps * args.batch_size, g)
    test_dataset = SyntheticPairs(args.test_batch_size, g)

    model = SiameseNetwork().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    sg.track(model=model, opt=optimizer)

    # we aren't using `TripletLoss` as the MNIST dataset is simple, so `BCELoss` can do the trick.
    criterion = nn.BCELoss()

    @sg.compile
    def train_step(images_1, images_2, targets):
        optimizer.zero_grad()
        outputs = model(images_1, images_2).squeeze()
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()
        return loss

    def train(args, model, device, epoch, start, count):
        model.train()
        n_batches = -(-len(train_dataset) // args.batch_size)
        for batch_idx, (images_1, images_2, targets) in enumerate(train_dataset.batches(args.batch_size, start, count)):
            images_1, images_2, targets = images_1.to(device), images_2.to(device), targets.to(device)
            loss = train_step(images_1, images_2, targets)
            sg.log(loss)
            if batch_idx % args.log_interval == 0:
                print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                    epoch, batch_idx * len(images_1), len(train_dataset),
                    100. * batch_idx / n_batches, loss.item()))
                if args.dry_run:
                    break

    def test(model, device):
        model.eval()
        test_loss = 0
        correct = 0

        # we aren't using `TripletLoss` as the MNIST dataset is simple, so `BCELoss` can do the trick.
        criterion = nn.BCELoss()

        with torch.no_grad():
            for (images_1, images_2, targets) in test_dataset.batches(args.test_batch_size):
                images_1, images_2, targets = images_1.to(device), images_2.to(device), targets.to(device)
                outputs = model(images_1, images_2).squeeze()
                test_loss += criterion(outputs, targets).sum().item()  # sum up batch loss
                pred = torch.where(outputs > 0.5, 1, 0)  # get the index of the max log-probability
                correct += pred.eq(targets.view_as(pred)).sum().item()

        test_loss /= len(test_dataset)

        print('\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n'.format(
            test_loss, correct, len(test_dataset),
            100. * correct / len(test_dataset)))

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    sg.track(sched=scheduler)
    done, epoch = 0, 1
    while done < steps and epoch <= args.epochs:
        count = min(batches_per_epoch, steps - done)
        train(args, model, device, epoch, done, count)
        done += count
        test(model, device)
        scheduler.step()
        epoch += 1
