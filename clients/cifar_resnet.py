"""kuangliu/pytorch-cifar: ResNet18 (CIFAR variant: 3x3 stem, no maxpool) trained with SGD (lr 0.1,
momentum 0.9, weight decay 5e-4) and CosineAnnealingLR(T_max=200) stepped once an epoch; the
per-batch body accumulates ``train_loss += loss.item()`` and
``correct += predicted.eq(targets).sum().item()`` (host reads inside the step).

Model: vendor/pytorch_cifar/resnet.py (models/resnet.py, verbatim), ``ResNet18()``. Loop: main.py
``train(epoch)`` (lines 93-113), ``test(epoch)`` (116-148) and the epoch loop (151-154). Scaled down:
synthetic 32x32 images (the model's ``avg_pool2d(out, 4)`` needs 32x32), batch 4 (128 in main.py),
4 batches an "epoch", one test batch. Left out: ``progress_bar`` (utils.py reads ``stty size`` at
import, so it cannot be imported without a terminal; its message string is still formatted),
DataParallel/cudnn.benchmark (cuda only), the checkpoint file written by ``test``.
"""
import torch
import torch.nn as nn
import torch.optim as optim

from clients.vendor.pytorch_cifar.resnet import ResNet18

SOURCE = "https://github.com/kuangliu/pytorch-cifar/blob/49b7aa9/main.py"
LICENSE = "MIT"
TAGS = ("cnn", "resnet", "batchnorm", "sgd-momentum", "cosine-lr", "item-in-step", "global-accumulators")

batch_size = 4
batches_per_epoch = 4

device = 'cpu'
best_acc = 0  # best test accuracy
start_epoch = 0  # start from epoch 0 or last checkpoint epoch
net = criterion = optimizer = scheduler = None
train_loss = correct = total = 0
last_message = ""


def progress_bar(current, total, msg=None):
    """Stand-in for utils.progress_bar (a terminal progress bar): keeps the message, prints nothing."""
    global last_message
    last_message = msg


def main(sg, steps=8, device="cpu", amp=None):
    global net, criterion, optimizer, scheduler
    globals()["device"] = device

    # Model
    net = ResNet18()
    net = net.to(device)

    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(net.parameters(), lr=0.1,
                          momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)
    sg.track(net=net, opt=optimizer, sched=scheduler)

    g = torch.Generator().manual_seed(1)
    n_epochs = -(-steps // batches_per_epoch)
    trainloader = [(torch.randn(batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g))
                   for _ in range(steps)]
    testloader = [(torch.randn(batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g))]

    @sg.compile
    def train_batch(inputs, targets):
        global train_loss, correct, total
        optimizer.zero_grad()
        outputs = net(inputs)
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()

        train_loss += loss.item()
        _, predicted = outputs.max(1)
        total += targets.size(0)
        correct += predicted.eq(targets).sum().item()
        return loss

    # Training
    def train(epoch):
        global train_loss, correct, total
        print('\nEpoch: %d' % epoch)
        net.train()
        train_loss = 0
        correct = 0
        total = 0
        batches = trainloader[epoch * batches_per_epoch:(epoch + 1) * batches_per_epoch]
        for batch_idx, (inputs, targets) in enumerate(batches):
            inputs, targets = inputs.to(device), targets.to(device)
            loss = train_batch(inputs, targets)
            sg.log(loss)

            progress_bar(batch_idx, len(batches), 'Loss: %.3f | Acc: %.3f%% (%d/%d)'
                         % (train_loss/(batch_idx+1), 100.*correct/total, correct, total))

    def test(epoch):
        global best_acc
        net.eval()
        test_loss = 0
        correct = 0
        total = 0
        with torch.no_grad():
            for batch_idx, (inputs, targets) in enumerate(testloader):
                inputs, targets = inputs.to(device), targets.to(device)
                outputs = net(inputs)
                loss = criterion(outputs, targets)

                test_loss += loss.item()
                _, predicted = outputs.max(1)
                total += targets.size(0)
                correct += predicted.eq(targets).sum().item()

                progress_bar(batch_idx, len(testloader), 'Loss: %.3f | Acc: %.3f%% (%d/%d)'
                             % (test_loss/(batch_idx+1), 100.*correct/total, correct, total))

        # Save checkpoint. (the torch.save of the state is left out)
        acc = 100.*correct/total
        if acc > best_acc:
            best_acc = acc

    for epoch in range(start_epoch, start_epoch+n_epochs):
        train(epoch)
        test(epoch)
        scheduler.step()
