"""torchmetrics' overview page: module metrics in a plain PyTorch loop. ``train_accuracy =
BinaryAccuracy()`` and ``valid_accuracy = BinaryAccuracy()``; per epoch, for each training batch
``y_hat = model(x)`` and ``batch_acc = train_accuracy(y_hat, y)`` (the metric called as a module:
``Metric.forward`` updates the epoch state and returns the batch's value), printed; then each
validation batch ``valid_accuracy.update(y_hat, y)``; at the epoch's end ``train_accuracy.compute()``
and ``valid_accuracy.compute()`` printed, then both ``reset()``.

The page elides the training itself (``y_hat = model(x)`` only). It is written here as the same
docs' Lightning page writes its ``training_step`` (``preds = self(x)``, a loss, then
``batch_value = self.train_acc(preds, y)``): a logistic-regression model (one ``nn.Linear``),
``binary_cross_entropy_with_logits``, SGD, the metric on ``sigmoid`` probabilities. The step is the
body of the training batch loop; the validation loop, ``compute()``, the prints and ``reset()``
stay in the loop, as written.

Source: https://github.com/Lightning-AI/torchmetrics/blob/dab033394560ab3ce05e3d14c13f32e4cde6b351/docs/source/pages/overview.rst
(the plain-PyTorch example) and .../docs/source/pages/lightning.rst (``training_step`` with
``self.train_acc(preds, y)``), Apache-2.0. Data: synthetic, 8 features, 16 samples a batch, 3
training batches and 1 validation batch an epoch (the page's ``train_data`` / ``valid_data``).
"""
import torch
import torch.nn.functional as F
from torch import nn

SOURCE = ("https://github.com/Lightning-AI/torchmetrics/blob/dab033394560ab3ce05e3d14c13f32e4cde6b351/"
          "docs/source/pages/overview.rst")
LICENSE = "Apache-2.0"
TAGS = ("torchmetrics", "metric-in-step", "metric-reset-per-epoch", "library-module-state", "sgd")


def main(sg, steps=8, device="cpu", amp=None):
    from torchmetrics.classification import BinaryAccuracy

    per_epoch = 3
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(8, generator=g)

    def batch():
        x = torch.randn(16, 8, generator=g)
        y = ((x @ w_true + 0.5 * torch.randn(16, generator=g)) > 0).long()
        return x.to(device), y.to(device)
    epochs = [[batch() for _ in range(per_epoch)] for _ in range((steps + per_epoch - 1) // per_epoch)]
    valid_data = [batch()]

    model = nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train_accuracy = BinaryAccuracy().to(device)
    valid_accuracy = BinaryAccuracy().to(device)
    sg.track(model=model, opt=optimizer, train_accuracy=train_accuracy)

    @sg.compile
    def training_step(x, y):
        preds = model(x).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(preds, y.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch_acc = train_accuracy(preds.detach().sigmoid(), y)   # training step accuracy
        return loss, batch_acc

    done = 0
    for epoch, train_data in enumerate(epochs):
        for i, (x, y) in enumerate(train_data):
            if done == steps:
                break
            loss, batch_acc = training_step(x, y)
            done += 1
            sg.log((loss, batch_acc))
            f"Accuracy of batch{i} is {batch_acc}"   # (the page's print)
        with torch.no_grad():
            for x, y in valid_data:
                y_hat = model(x).squeeze(-1).sigmoid()
                valid_accuracy.update(y_hat, y)
        # total accuracy over all training batches / all validation batches
        total_train_accuracy = train_accuracy.compute()
        total_valid_accuracy = valid_accuracy.compute()
        sg.log((total_train_accuracy, total_valid_accuracy))
        # Reset metric states after each epoch
        train_accuracy.reset()
        valid_accuracy.reset()
