"""Quantization-aware training as the PyTorch tutorial "(beta) Static Quantization with Eager Mode
in PyTorch", section 5 "Quantization-aware training", writes it: the tutorial's quantizable
``MobileNetV2`` (``QuantStub``/``DeQuantStub`` around the network, ``ConvBNReLU`` as an
``nn.Sequential`` of conv / BatchNorm2d / ReLU, ``InvertedResidual`` whose skip is
``nn.quantized.FloatFunctional().add``, ``_make_divisible``, ``x.mean([2, 3])``, a Dropout(0.2) +
Linear classifier, its init) with ``fuse_model(is_qat=True)`` (``fuse_modules_qat`` of every ConvBNReLU and
conv+BN pair, in training mode: QAT's ``ConvBnReLU2d``/``ConvBn2d``), ``optimizer =
torch.optim.SGD(qat_model.parameters(), lr=0.0001)``, ``qat_model.qconfig =
get_default_qat_qconfig(...)``, ``prepare_qat(qat_model, inplace=True)``; then per epoch
``train_one_epoch(...)`` (three ``AverageMeter``s, per batch ``start_time = time.time()``,
``print('.', end='')``, ``cnt += 1``, ``.to(device)``, forward, ``criterion``, ``zero_grad`` /
``backward`` / ``step``, ``accuracy(output, target, topk=(1, 5))``, the meters' ``update`` (the
loss meter with the loss *tensor*), and ``if cnt >= ntrain_batches:`` the two summary prints and
``return``), then ``if nepoch > ...: qat_model.apply(torch.ao.quantization.disable_observer)``,
``if nepoch > ...: qat_model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)``, and
``quantized_model = convert(qat_model.eval(), inplace=False)`` evaluated on the test batches.
The fake-quant modules' observers update their min/max, scale and zero-point buffers in every
training forward until ``disable_observer``; ``freeze_bn_stats`` switches the fused conv-BN
modules to the running statistics.

What a user of stepgraph changes: the per-batch body of ``train_one_epoch``'s ``for image, target
in data_loader`` loop is decorated with ``sg.compile`` as ``train_batch(image, target)``: its
names are ``train_one_epoch``'s locals (the meters, ``cnt``: ``nonlocal``), made per epoch as the
program makes them; the body's ``return`` out of the epoch becomes ``return True`` (the loop
``break``s on it).

Scaled down / replaced: no pretrained weights (``load_model`` builds ``MobileNetV2()`` without
``torch.load``); ImageNet-1k is synthetic 3x32x32 images, 10 classes, batch 30 -> 8, through a
``DataLoader`` with a ``RandomSampler``; ``inverted_residual_setting`` is ``[[1, 16, 1, 1], [6, 24,
2, 2]]`` and ``last_channel`` 1280 -> 64; 8 epochs -> 4 of ``num_train_batches`` 20 -> 2;
``disable_observer`` after ``nepoch > 3`` -> ``> 1`` and ``freeze_bn_stats`` after ``> 2`` ->
``> 0`` (so both happen within the 4 epochs); 10 eval batches -> 1. The tutorial at the pinned
commit writes ``torch.quantization.*``, the ``'fbgemm'`` qconfig and ``fuse_model()``; this uses the same
functions from ``torch.ao.quantization``, the ``'x86'`` qconfig (this torch's default engine; both
are ``FusedMovingAvgObsFakeQuantize`` configs) and ``fuse_model(is_qat=True)`` choosing
``fuse_modules_qat`` (as the tutorial's current text does: this torch's ``fuse_modules`` asserts
"Fusion only for eval!" on a training model).

Source: https://github.com/pytorch/tutorials/blob/d2c833ec2da007f883a13406508cf0e220c0cf98/advanced_source/static_quantization_tutorial.py
(BSD-3-Clause). Restated after the source, not copied.
"""
import time

import torch
import torch.nn as nn
import torch.ao.nn.intrinsic.qat
from torch.ao.quantization import DeQuantStub, QuantStub
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

SOURCE = "https://github.com/pytorch/tutorials/blob/d2c833ec2da007f883a13406508cf0e220c0cf98/advanced_source/static_quantization_tutorial.py"
LICENSE = "BSD-3-Clause"
DEVICES = ("cpu",)   # "quantization is currently only supported for CPUs" (the tutorial)
TAGS = ("cnn", "mobilenet", "qat", "fake-quant", "observers", "fused-conv-bn", "freeze-bn", "disable-observer",
        "batchnorm", "dropout", "meters-in-step", "print-in-step", "time-in-step", "topk-accuracy",
        "module-apply-between-epochs", "convert-between-epochs")

train_batch_size = 8
eval_batch_size = 8
num_train_batches = 2
num_eval_batches = 1


def _make_divisible(v, divisor, min_value=None):
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    # Make sure that round down does not go down by more than 10%.
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvBNReLU(nn.Sequential):
    def __init__(self, in_planes, out_planes, kernel_size=3, stride=1, groups=1):
        padding = (kernel_size - 1) // 2
        super(ConvBNReLU, self).__init__(
            nn.Conv2d(in_planes, out_planes, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_planes, momentum=0.1),
            nn.ReLU(inplace=False),
        )


class InvertedResidual(nn.Module):
    def __init__(self, inp, oup, stride, expand_ratio):
        super(InvertedResidual, self).__init__()
        self.stride = stride
        assert stride in [1, 2]
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = self.stride == 1 and inp == oup
        layers = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU(inp, hidden_dim, kernel_size=1))   # pw
        layers.extend([
            ConvBNReLU(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),   # dw
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),   # pw-linear
            nn.BatchNorm2d(oup, momentum=0.1),
        ])
        self.conv = nn.Sequential(*layers)
        self.skip_add = nn.quantized.FloatFunctional()

    def forward(self, x):
        if self.use_res_connect:
            return self.skip_add.add(x, self.conv(x))
        return self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=10, width_mult=1.0, inverted_residual_setting=None, round_nearest=8,
                 last_channel=64):
        super(MobileNetV2, self).__init__()
        block = InvertedResidual
        input_channel = 32
        if inverted_residual_setting is None:
            inverted_residual_setting = [
                # t, c, n, s
                [1, 16, 1, 1],
                [6, 24, 2, 2],
            ]
        input_channel = _make_divisible(input_channel * width_mult, round_nearest)
        self.last_channel = _make_divisible(last_channel * max(1.0, width_mult), round_nearest)
        features = [ConvBNReLU(3, input_channel, stride=2)]
        for t, c, n, s in inverted_residual_setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(block(input_channel, output_channel, stride, expand_ratio=t))
                input_channel = output_channel
        features.append(ConvBNReLU(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.quant = QuantStub()
        self.dequant = DeQuantStub()
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(self.last_channel, num_classes))

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out')
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.quant(x)
        x = self.features(x)
        x = x.mean([2, 3])
        x = self.classifier(x)
        x = self.dequant(x)
        return x

    # Fuse Conv+BN and Conv+BN+Relu modules prior to quantization
    def fuse_model(self, is_qat=False):
        fuse_modules = torch.ao.quantization.fuse_modules_qat if is_qat else torch.ao.quantization.fuse_modules
        for m in self.modules():
            if type(m) == ConvBNReLU:
                fuse_modules(m, ['0', '1', '2'], inplace=True)
            if type(m) == InvertedResidual:
                for idx in range(len(m.conv)):
                    if type(m.conv[idx]) == nn.Conv2d:
                        fuse_modules(m.conv, [str(idx), str(idx + 1)], inplace=True)


class AverageMeter(object):
    """Computes and stores the average and current value"""
    def __init__(self, name, fmt=':f'):
        self.name = name
        self.fmt = fmt
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        fmtstr = '{name} {val' + self.fmt + '} ({avg' + self.fmt + '})'
        return fmtstr.format(**self.__dict__)


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


def evaluate(model, criterion, data_loader, neval_batches):
    model.eval()
    top1 = AverageMeter('Acc@1', ':6.2f')
    top5 = AverageMeter('Acc@5', ':6.2f')
    cnt = 0
    with torch.no_grad():
        for image, target in data_loader:
            output = model(image)
            loss = criterion(output, target)
            cnt += 1
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            print('.', end='')
            top1.update(acc1[0], image.size(0))
            top5.update(acc5[0], image.size(0))
            if cnt >= neval_batches:
                return top1, top5
    return top1, top5


def load_model():
    model = MobileNetV2()   # (no pretrained state_dict: see the docstring)
    model.to('cpu')
    return model


def main(sg, steps=8, device="cpu", amp=None, detach_meter=False, qconfig_version=1):
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(24, 3, 32, 32, generator=g), torch.randint(0, 10, (24,), generator=g))
    dataset_test = TensorDataset(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    data_loader = DataLoader(dataset, batch_size=train_batch_size, sampler=RandomSampler(dataset))
    data_loader_test = DataLoader(dataset_test, batch_size=eval_batch_size)
    criterion = nn.CrossEntropyLoss()

    qat_model = load_model()
    qat_model.fuse_model(is_qat=True)
    optimizer = torch.optim.SGD(qat_model.parameters(), lr=0.0001)
    qat_model.qconfig = torch.ao.quantization.get_default_qat_qconfig('x86', version=qconfig_version)
    torch.ao.quantization.prepare_qat(qat_model, inplace=True)
    sg.track(model=qat_model, optimizer=optimizer)

    # train_one_epoch's locals (made per epoch below, as the program makes them)
    top1 = top5 = avgloss = None
    cnt = 0
    ntrain_batches = num_train_batches

    @sg.compile
    def train_batch(image, target):
        nonlocal cnt
        start_time = time.time()
        print('.', end='')
        cnt += 1
        image, target = image.to(device), target.to(device)
        output = qat_model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        top1.update(acc1[0], image.size(0))
        top5.update(acc5[0], image.size(0))
        avgloss.update(loss.detach() if detach_meter else loss, image.size(0))
        if cnt >= ntrain_batches:
            print('Loss', avgloss.avg)
            print('Training: * Acc@1 {top1.avg:.3f} Acc@5 {top5.avg:.3f}'.format(top1=top1, top5=top5))
            return True
        return False

    done = 0

    def train_one_epoch(model, criterion, optimizer, data_loader, device, ntrain_batches):
        nonlocal top1, top5, avgloss, cnt, done
        model.train()
        top1 = AverageMeter('Acc@1', ':6.2f')
        top5 = AverageMeter('Acc@5', ':6.2f')
        avgloss = AverageMeter('Loss', '1.5f')
        cnt = 0
        for image, target in data_loader:
            stop = train_batch(image, target)
            done += 1
            sg.log((avgloss.avg, top1.avg, top5.avg, cnt))
            if stop or done == steps:
                return

    for nepoch in range(steps // num_train_batches):
        train_one_epoch(qat_model, criterion, optimizer, data_loader, torch.device('cpu'), num_train_batches)
        if nepoch > 1:
            # Freeze quantizer parameters
            qat_model.apply(torch.ao.quantization.disable_observer)
        if nepoch > 0:
            # Freeze batch norm mean and variance estimates
            qat_model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)

        # Check the accuracy after each epoch
        quantized_model = torch.ao.quantization.convert(qat_model.eval(), inplace=False)
        quantized_model.eval()
        top1_e, top5_e = evaluate(quantized_model, criterion, data_loader_test, neval_batches=num_eval_batches)
        print('Epoch %d :Evaluation accuracy on %d images, %2.2f' % (nepoch, num_eval_batches * eval_batch_size,
                                                                      top1_e.avg))
        sg.log((nepoch, top1_e.avg, top5_e.avg))
