"""PyTorch's Stochastic Weight Averaging recipe (``torch.optim.swa_utils``) as the PyTorch docs
("Weight Averaging (SWA and EMA)" in ``docs/source/optim.md``) and the blog post "PyTorch 1.6 now
includes Stochastic Weight Averaging" write it: ``swa_model = AveragedModel(model)``, a
``CosineAnnealingLR(optimizer, T_max=...)`` before ``swa_start``, ``swa_scheduler =
SWALR(optimizer, swa_lr=0.05)`` after it; per batch ``optimizer.zero_grad()``,
``loss_fn(model(input), target).backward()``, ``optimizer.step()``; per epoch ``if epoch >
swa_start: swa_model.update_parameters(model); swa_scheduler.step()`` else ``scheduler.step()``;
at the end ``torch.optim.swa_utils.update_bn(loader, swa_model)`` and ``preds =
swa_model(test_input)``.

What a user of stepgraph changes: the per-batch body (zero_grad / backward / step) is decorated
with ``sg.compile`` (``@stepgraph.compile``). Variants (``main``'s keywords, used by the corpus
clients ``swa_recipe_in_step`` and ``swa_recipe_plateau``):

* ``in_step=True``: the SWA update and both schedulers run per iteration inside the step
  (``if epoch > swa_start: swa_model.update_parameters(model); swa_scheduler.step() else:
  scheduler.step()`` moved into the batch body, ``epoch`` passed in): per-iteration averaging, as
  SWA on a per-iteration cycle does.
* ``plateau=True``: the pre-SWA scheduler is ``ReduceLROnPlateau(optimizer)`` stepped between
  epochs with a validation loss (``scheduler.step(val_loss)``), as the docs' ReduceLROnPlateau
  example writes it.

Scaled down / replaced: the model (left as ``model = ...`` in the docs) is a small CNN with
BatchNorm written here (conv-BN-ReLU-maxpool twice, global average pool, linear); data are
synthetic 3x16x16 images in a ``TensorDataset`` read by ``DataLoader(batch_size=8,
shuffle=True)`` (2 batches an epoch); SGD(lr=0.1, momentum=0.9); epochs 300 -> 4, T_max 300 -> 4,
swa_start 160 -> 1, SWALR's default anneal_epochs 10 -> 2.

Source: https://github.com/pytorch/pytorch/blob/38b56d956a2f17140aa724bcf798903f91f049a1/docs/source/optim.md
(BSD-3-Clause; blog: https://pytorch.org/blog/pytorch-1.6-now-includes-stochastic-weight-averaging/).
Restated after the source, not copied.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, ReduceLROnPlateau
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "https://github.com/pytorch/pytorch/blob/38b56d956a2f17140aa724bcf798903f91f049a1/docs/source/optim.md"
LICENSE = "BSD-3-Clause"
DEVICES = ("cpu", "cuda")
TAGS = ("cnn", "batchnorm", "swa", "averaged-model", "swalr", "cosine-lr", "update-bn", "sgd-momentum",
        "dataloader", "scheduler-between-epochs")


class SmallCNN(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


def main(sg, steps=8, device="cpu", amp=None, in_step=False, plateau=False):
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))
    val = (torch.randn(8, 3, 16, 16, generator=g).to(device), torch.randint(0, 10, (8,), generator=g).to(device))
    test_input = torch.randn(4, 3, 16, 16, generator=g).to(device)
    loader = DataLoader(dataset, batch_size=8, shuffle=True)

    model = SmallCNN().to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    swa_model = AveragedModel(model)
    if plateau:
        scheduler = ReduceLROnPlateau(optimizer, patience=0)   # (patience 10 -> 0: it acts in 4 epochs)
    else:
        scheduler = CosineAnnealingLR(optimizer, T_max=4)
    swa_start = 1
    swa_scheduler = SWALR(optimizer, swa_lr=0.05, anneal_epochs=2)
    sg.track(model=model, swa_model=swa_model, optimizer=optimizer, scheduler=scheduler,
             swa_scheduler=swa_scheduler)

    if not in_step:
        @sg.compile
        def train_step(input, target):
            optimizer.zero_grad()
            loss_fn(model(input), target).backward()
            optimizer.step()
    else:
        @sg.compile
        def train_step(input, target, epoch):
            optimizer.zero_grad()
            loss_fn(model(input), target).backward()
            optimizer.step()
            if epoch > swa_start:
                swa_model.update_parameters(model)
                swa_scheduler.step()
            else:
                scheduler.step()

    done = 0
    epochs = steps // len(loader)
    for epoch in range(epochs):
        model.train()
        for input, target in loader:
            input, target = input.to(device), target.to(device)
            if in_step:
                train_step(input, target, epoch)
            else:
                train_step(input, target)
            done += 1
            sg.log(optimizer.param_groups[0]["lr"])
        if not in_step:
            if epoch > swa_start:
                swa_model.update_parameters(model)
                swa_scheduler.step()
            elif plateau:
                model.eval()
                with torch.no_grad():
                    val_loss = loss_fn(model(val[0]), val[1])
                scheduler.step(val_loss)
            else:
                scheduler.step()
        sg.log((epoch, optimizer.param_groups[0]["lr"], swa_model.n_averaged))

    # Update bn statistics for the swa_model at the end
    update_bn(loader, swa_model, device=torch.device(device))
    # Use swa_model to make predictions on test data
    preds = swa_model(test_input)
    sg.log(preds)
