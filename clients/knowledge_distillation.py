"""haitongli/knowledge-distillation-pytorch train.py ``train_kd``: Hinton knowledge distillation of
the 5-layer CNN student (``net.Net``: three conv-BN-maxpool-ReLU stages, fc-BN-ReLU-dropout, fc)
from a ResNet-18 teacher (``resnet.ResNet18``, CIFAR-style) that is put in ``eval()`` and run under
``torch.no_grad()`` inside the loop body on the same batch; ``net.loss_fn_kd``:
``KLDivLoss()(log_softmax(outputs/T), softmax(teacher_outputs/T)) * (alpha*T*T) +
cross_entropy(outputs, labels) * (1 - alpha)``; Adam (``cnn_distill``); a ``RunningAverage`` of the
loss updated every batch; every ``save_summary_steps`` batches the outputs and labels go to numpy
for the accuracy metric. ``StepLR(step_size=100, gamma=0.2)`` stepped at each epoch's start, and
``evaluate_kd`` (the student in eval mode, no_grad) after each epoch.

The step is ``train_kd``'s per-batch body from the student's forward to ``optimizer.step()`` and
``loss_avg.update(loss.item())`` (the script's ``loss.data[0]``, which current PyTorch spells
``.item()``); the numpy summary every ``save_summary_steps`` batches stays in the loop, on the
outputs the step returns (the script's ``Variable`` wrappers are no-ops today and left out).

Restated after the source, not copied: the lookup service this was written with does not allow
committing its text (train.py ``train_kd`` / ``train_and_evaluate_kd``, model/net.py ``Net``,
``loss_fn_kd``, ``accuracy``, model/resnet.py ``BasicBlock`` / ``ResNet`` / ``ResNet18``, utils.py
``RunningAverage``). Scaled down: num_channels 8 (32), the teacher ResNet with one BasicBlock per
stage and widths 8-16-32-64 (64-512), alpha 0.9, temperature 4 (the repo's cnn_distill
params.json: 0.9 / 20 -> 4), dropout_rate 0.5, 32x32 synthetic CIFAR batches of 8, 3 batches an
epoch, save_summary_steps 2. The teacher's weights are random (its checkpoint is not loaded).
"""
import logging

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

SOURCE = ("https://github.com/haitongli/knowledge-distillation-pytorch/blob/"
          "b1e4b6acb8d4e138ad12ba1aac22d5da42a85c10/train.py")
LICENSE = "MIT"
TAGS = ("cnn", "distillation", "teacher-eval", "no-grad-in-step", "kl-div", "temperature", "batchnorm",
        "dropout", "adam", "steplr", "item-in-step", "running-average", "numpy-metrics")


class Params:  # experiments/cnn_distill/params.json, scaled down
    learning_rate = 1e-3; batch_size = 8; num_epochs = 2; dropout_rate = 0.5; num_channels = 8
    save_summary_steps = 2; alpha = 0.9; temperature = 4; model_version = "cnn_distill"; teacher = "resnet18"


batches_per_epoch = 3


# ---- model/net.py (restated) -------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self, params):
        super(Net, self).__init__()
        self.num_channels = params.num_channels
        c = self.num_channels
        self.conv1 = nn.Conv2d(3, c, 3, stride=1, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c * 2, 3, stride=1, padding=1)
        self.bn2 = nn.BatchNorm2d(c * 2)
        self.conv3 = nn.Conv2d(c * 2, c * 4, 3, stride=1, padding=1)
        self.bn3 = nn.BatchNorm2d(c * 4)
        self.fc1 = nn.Linear(4 * 4 * c * 4, c * 4)
        self.fcbn1 = nn.BatchNorm1d(c * 4)
        self.fc2 = nn.Linear(c * 4, 10)
        self.dropout_rate = params.dropout_rate

    def forward(self, s):
        # three stages: conv, batch norm, 2x2 max-pool, ReLU (32 -> 16 -> 8 -> 4)
        s = F.relu(F.max_pool2d(self.bn1(self.conv1(s)), 2))
        s = F.relu(F.max_pool2d(self.bn2(self.conv2(s)), 2))
        s = F.relu(F.max_pool2d(self.bn3(self.conv3(s)), 2))
        s = s.view(-1, 4 * 4 * self.num_channels * 4)
        s = F.dropout(F.relu(self.fcbn1(self.fc1(s))), p=self.dropout_rate, training=self.training)
        return self.fc2(s)


def loss_fn_kd(outputs, labels, teacher_outputs, params):
    """Hinton's KD loss: the KL divergence of the temperature-softened distributions (scaled by
    alpha * T^2) plus (1 - alpha) times the hard-label cross-entropy."""
    alpha = params.alpha
    T = params.temperature
    soft = nn.KLDivLoss()(F.log_softmax(outputs / T, dim=1), F.softmax(teacher_outputs / T, dim=1))
    return soft * (alpha * T * T) + F.cross_entropy(outputs, labels) * (1. - alpha)


def accuracy(outputs, labels):
    return np.sum(np.argmax(outputs, axis=1) == labels) / float(labels.size)


metrics = {"accuracy": accuracy}


# ---- model/resnet.py (restated, narrowed) ------------------------------------------------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super(BasicBlock, self).__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != self.expansion * planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, self.expansion * planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(self.expansion * planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, block, num_blocks, num_classes=10, width=8):
        super(ResNet, self).__init__()
        self.in_planes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._make_layer(block, width, num_blocks[0], stride=1)
        self.layer2 = self._make_layer(block, width * 2, num_blocks[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, num_blocks[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, num_blocks[3], stride=2)
        self.linear = nn.Linear(width * 8 * block.expansion, num_classes)

    def _make_layer(self, block, planes, num_blocks, stride):
        layers = []
        for s in [stride] + [1] * (num_blocks - 1):
            layers.append(block(self.in_planes, planes, s))
            self.in_planes = planes * block.expansion
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.avg_pool2d(out, 4)
        return self.linear(out.view(out.size(0), -1))


def ResNet18():
    return ResNet(BasicBlock, [1, 1, 1, 1])   # [2, 2, 2, 2] at widths 64-512 in the repo


# ---- utils.py (restated) -----------------------------------------------------------------------
class RunningAverage():
    def __init__(self):
        self.steps = 0
        self.total = 0

    def update(self, val):
        self.total += val
        self.steps += 1

    def __call__(self):
        return self.total / float(self.steps)


def main(sg, steps=8, device="cpu", amp=None):
    params = Params()
    model = Net(params).to(device)
    optimizer = optim.Adam(model.parameters(), lr=params.learning_rate)
    teacher_model = ResNet18().to(device)
    scheduler = StepLR(optimizer, step_size=100, gamma=0.2)
    sg.track(model=model, optimizer=optimizer, teacher=teacher_model, scheduler=scheduler)

    g = torch.Generator().manual_seed(1)
    n_epochs = -(-steps // batches_per_epoch)
    train_dl = [[(torch.randn(params.batch_size, 3, 32, 32, generator=g),
                  torch.randint(0, 10, (params.batch_size,), generator=g))
                 for _ in range(min(batches_per_epoch, steps - e * batches_per_epoch))] for e in range(n_epochs)]
    dev_dl = [(torch.randn(params.batch_size, 3, 32, 32, generator=g),
               torch.randint(0, 10, (params.batch_size,), generator=g))]
    state = {}

    @sg.compile
    def train_kd_step(train_batch, labels_batch):
        loss_avg = state["loss_avg"]
        output_batch = model(train_batch)
        with torch.no_grad():
            output_teacher_batch = teacher_model(train_batch)
        loss = loss_fn_kd(output_batch, labels_batch, output_teacher_batch, params)

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        loss_avg.update(loss.item())
        return output_batch, loss

    def train_kd(dataloader):
        model.train()
        teacher_model.eval()
        summ = []
        loss_avg = RunningAverage()
        state["loss_avg"] = loss_avg
        for i, (train_batch, labels_batch) in enumerate(dataloader):
            train_batch, labels_batch = train_batch.to(device), labels_batch.to(device)
            output_batch, loss = train_kd_step(train_batch, labels_batch)
            sg.log({"loss": loss, "loss_avg": loss_avg(), "steps": loss_avg.steps})
            if i % params.save_summary_steps == 0:
                output_batch = output_batch.data.cpu().numpy()
                labels_batch = labels_batch.data.cpu().numpy()
                summary_batch = {metric: metrics[metric](output_batch, labels_batch) for metric in metrics}
                summary_batch["loss"] = loss.item()
                summ.append(summary_batch)
        metrics_mean = {metric: np.mean([x[metric] for x in summ]) for metric in summ[0]}
        logging.info("- Train metrics: " + " ; ".join(f"{k}: {v:05.3f}" for k, v in metrics_mean.items()))
        sg.log({k: float(v) for k, v in metrics_mean.items()})

    def evaluate_kd(dataloader):
        model.eval()
        summ = []
        for data_batch, labels_batch in dataloader:
            with torch.no_grad():
                output_batch = model(data_batch.to(device))
            summ.append({"accuracy": accuracy(output_batch.cpu().numpy(), labels_batch.numpy())})
        return {m: np.mean([x[m] for x in summ]) for m in summ[0]}

    for epoch in range(n_epochs):
        scheduler.step()   # (at the epoch's start, as the script does)
        logging.info("Epoch {}/{}".format(epoch + 1, params.num_epochs))
        train_kd(train_dl[epoch])
        val_metrics = evaluate_kd(dev_dl)
        sg.log({"val_accuracy": float(val_metrics["accuracy"])})
