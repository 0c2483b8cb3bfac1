"""facebookresearch/moco, MoCo v2 settings (``--mlp --moco-t 0.2 --aug-plus --cos``): momentum
contrast. ``MoCo`` (moco/builder.py) holds a query encoder and a key encoder (torchvision ResNets
with ``num_classes=dim``; with ``mlp`` their ``fc`` becomes Linear-ReLU-fc), the key encoder's
parameters copied from the query's and frozen, and two buffers: ``queue`` (dim x K, columns
L2-normalised at construction) and ``queue_ptr`` (one long). Each forward: the query features
(normalised); under ``no_grad`` the momentum update of the key encoder (``param_k.data =
param_k.data * m + param_q.data * (1. - m)``: the ``.data`` of every key parameter rebound to a
new tensor), ``_batch_shuffle_ddp`` (``concat_all_gather`` = ``dist.all_gather`` into a list of
``ones_like`` + ``torch.cat``; ``torch.randperm`` of the gathered batch, ``dist.broadcast`` of it
from rank 0, ``torch.argsort`` for the inverse, the rank's slice through ``dist.get_rank()``), the
key encoder on the shuffled keys, ``_batch_unshuffle_ddp``; the logits ``[l_pos, l_neg]`` by
``einsum`` against ``queue.clone().detach()``, divided in place by T; labels ``torch.zeros(N,
dtype=long)``; ``_dequeue_and_enqueue`` (``concat_all_gather`` of the keys, ``ptr =
int(self.queue_ptr)``, ``self.queue[:, ptr:ptr + batch_size] = keys.T``, ``self.queue_ptr[0] =
ptr`` advanced modulo K). The model is in ``DistributedDataParallel`` (main_moco.py raises
without it: here a one-process gloo group, as clients/dino.py); CrossEntropyLoss; SGD (lr 0.03,
momentum 0.9, weight decay 1e-4) over ``model.parameters()`` (the key encoder's included, with
requires_grad False).

Loop: main_moco.py ``main_worker``'s epoch loop (``adjust_learning_rate(optimizer, epoch, args)``
before each epoch: the cosine schedule, ``param_group['lr'] = lr``, outside the step) and
``train()``: its per-batch body from "compute output" to ``optimizer.step()`` is the step function
(the model on ``im_q=images[0], im_k=images[1]``, the criterion, ``accuracy(output, target,
topk=(1, 5))``, the AverageMeters ``losses.update(loss.item(), ...)``, ``top1.update(acc1[0],
...)``, ``top5.update(acc5[0], ...)``, ``zero_grad``, ``backward``, ``step``); the data / batch
timing and ``progress.display(i)`` every ``print_freq`` stay in the loop; no checkpoint files.

Source: https://github.com/facebookresearch/moco/blob/78b69cafae80bc74cd1a89ac3fb365dc20d157d3/moco/builder.py
and main_moco.py there, CC-BY-NC-4.0. Restated after the source, not copied: same modules, names,
ops and order; the ``.cuda()`` of ``idx_shuffle`` and of the labels are ``.to(<the batch's
device>)`` so that the program runs on the CPU. Model: vendor/pytorch_vision/resnet.py's
``resnet18`` (torchvision's, verbatim) instead of resnet50. Data: instead of ImageNet with
TwoCropsTransform(aug_plus), two synthetic 32x32 views per image. Scaled down: resnet50 ->
resnet18, moco_dim 128 -> 16, moco_k 65536 -> 32 (K % batch == 0 as the program asserts, so the
queue pointer takes K / batch = 8 values, 256 in the original), batch 256 -> 4, epochs 200 -> 4
with 2 batches an epoch, print_freq 10 -> 2.
"""
import math
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from clients.vendor.pytorch_vision import resnet as models

SOURCE = ("https://github.com/facebookresearch/moco/blob/78b69cafae80bc74cd1a89ac3fb365dc20d157d3/"
          "moco/builder.py")
LICENSE = "CC-BY-NC-4.0"
TAGS = ("self-supervised", "contrastive", "momentum-encoder", "data-rebind", "queue-buffer", "int-of-buffer",
        "ddp", "all_gather", "broadcast", "randperm-in-step", "shuffle-bn", "resnet", "batchnorm", "sgd-momentum",
        "cosine-per-epoch", "item-in-step", "topk-accuracy")


class args:  # argparse defaults of main_moco.py with the MoCo v2 flags, scaled down
    arch = "resnet18"; epochs = 4; start_epoch = 0; batch_size = 4; lr = 0.03; schedule = [120, 160]
    momentum = 0.9; weight_decay = 1e-4; print_freq = 2; gpu = None
    moco_dim = 16; moco_k = 32; moco_m = 0.999; moco_t = 0.2; mlp = True; aug_plus = True; cos = True


batches_per_epoch = 2
image_size = 32


# ---- moco/builder.py (restated) ----

class MoCo(nn.Module):
    """MoCo: a query encoder, a momentum-updated key encoder, and a queue of keys."""

    def __init__(self, base_encoder, dim=128, K=65536, m=0.999, T=0.07, mlp=False):
        super(MoCo, self).__init__()
        self.K = K
        self.m = m
        self.T = T

        # the two encoders; num_classes sets the width of their output fc
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)

        if mlp:  # replace each fc by an MLP head
            dim_mlp = self.encoder_q.fc.weight.shape[1]
            self.encoder_q.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_q.fc)
            self.encoder_k.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_k.fc)

        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)  # start equal
            param_k.requires_grad = False     # the key encoder gets no gradient

        # the queue of keys, one column per key
        self.register_buffer("queue", torch.randn(dim, K))
        self.queue = nn.functional.normalize(self.queue, dim=0)

        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        """key encoder <- m * key encoder + (1 - m) * query encoder"""
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1. - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        # the keys of every process, before the queue is written
        keys = concat_all_gather(keys)

        batch_size = keys.shape[0]

        ptr = int(self.queue_ptr)
        assert self.K % batch_size == 0  # kept simple

        # overwrite the oldest keys at ptr
        self.queue[:, ptr:ptr + batch_size] = keys.T
        ptr = (ptr + batch_size) % self.K  # advance the pointer

        self.queue_ptr[0] = ptr

    @torch.no_grad()
    def _batch_shuffle_ddp(self, x):
        """Shuffle the batch across processes (for BatchNorm). DDP only."""
        batch_size_this = x.shape[0]
        x_gather = concat_all_gather(x)
        batch_size_all = x_gather.shape[0]

        num_gpus = batch_size_all // batch_size_this

        # a random permutation of the whole batch
        idx_shuffle = torch.randperm(batch_size_all).to(x.device)   # (.cuda() in the source)

        # every process uses rank 0's permutation
        torch.distributed.broadcast(idx_shuffle, src=0)

        # the inverse permutation
        idx_unshuffle = torch.argsort(idx_shuffle)

        # this process's part of the shuffled batch
        gpu_idx = torch.distributed.get_rank()
        idx_this = idx_shuffle.view(num_gpus, -1)[gpu_idx]

        return x_gather[idx_this], idx_unshuffle

    @torch.no_grad()
    def _batch_unshuffle_ddp(self, x, idx_unshuffle):
        """Undo _batch_shuffle_ddp. DDP only."""
        batch_size_this = x.shape[0]
        x_gather = concat_all_gather(x)
        batch_size_all = x_gather.shape[0]

        num_gpus = batch_size_all // batch_size_this

        gpu_idx = torch.distributed.get_rank()
        idx_this = idx_unshuffle.view(num_gpus, -1)[gpu_idx]

        return x_gather[idx_this]

    def forward(self, im_q, im_k):
        """im_q, im_k: query and key images. Returns logits and targets."""
        # query features: N x C
        q = self.encoder_q(im_q)
        q = nn.functional.normalize(q, dim=1)

        # key features, without gradient
        with torch.no_grad():
            self._momentum_update_key_encoder()

            # shuffle so that BatchNorm cannot cheat
            im_k, idx_unshuffle = self._batch_shuffle_ddp(im_k)

            k = self.encoder_k(im_k)  # N x C
            k = nn.functional.normalize(k, dim=1)

            k = self._batch_unshuffle_ddp(k, idx_unshuffle)

        # positive logits: N x 1
        l_pos = torch.einsum('nc,nc->n', [q, k]).unsqueeze(-1)
        # negative logits: N x K
        l_neg = torch.einsum('nc,ck->nk', [q, self.queue.clone().detach()])

        # N x (1 + K)
        logits = torch.cat([l_pos, l_neg], dim=1)

        # temperature
        logits /= self.T

        # the positive key is at index 0
        labels = torch.zeros(logits.shape[0], dtype=torch.long).to(logits.device)   # (.cuda() in the source)

        self._dequeue_and_enqueue(k)

        return logits, labels


@torch.no_grad()
def concat_all_gather(tensor):
    """all_gather of ``tensor`` from every process, concatenated (no gradient flows through)."""
    tensors_gather = [torch.ones_like(tensor)
                      for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(tensors_gather, tensor, async_op=False)

    output = torch.cat(tensors_gather, dim=0)
    return output


# ---- main_moco.py helpers (restated) ----

class AverageMeter(object):
    """The current value and the running average of a metric."""
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


class ProgressMeter(object):
    def __init__(self, num_batches, meters, prefix=""):
        self.batch_fmtstr = self._get_batch_fmtstr(num_batches)
        self.meters = meters
        self.prefix = prefix

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch)]
        entries += [str(meter) for meter in self.meters]
        print('\t'.join(entries))

    def _get_batch_fmtstr(self, num_batches):
        num_digits = len(str(num_batches // 1))
        fmt = '{:' + str(num_digits) + 'd}'
        return '[' + fmt + '/' + fmt.format(num_batches) + ']'


def adjust_learning_rate(optimizer, epoch, args):
    """The lr of this epoch: cosine, or step-wise at the milestones."""
    lr = args.lr
    if args.cos:
        lr *= 0.5 * (1. + math.cos(math.pi * epoch / args.epochs))
    else:
        for milestone in args.schedule:
            lr *= 0.1 if epoch >= milestone else 1.
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr


def accuracy(output, target, topk=(1,)):
    """Top-k accuracies (in percent) for each k in topk."""
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


def main(sg, steps=8, device="cpu", amp=None):
    own_group = not dist.is_initialized()
    if own_group:   # (main_worker: dist.init_process_group; here one process)
        dist.init_process_group("nccl" if device == "cuda" else "gloo",   # (the program's backend on GPUs)
                                init_method=f"file://{tempfile.mktemp(prefix='moco_pg_')}",
                                world_size=1, rank=0)
    try:
        _main_worker(sg, steps, device)
    finally:
        if own_group:
            dist.destroy_process_group()


def _main_worker(sg, steps, device):
    model = MoCo(
        models.__dict__[args.arch],
        args.moco_dim, args.moco_k, args.moco_m, args.moco_t, args.mlp)
    model.to(device)
    # DistributedDataParallel will divide and allocate batch_size to all
    # available devices if device_ids are not set
    model = torch.nn.parallel.DistributedDataParallel(model)

    criterion = nn.CrossEntropyLoss().to(device)

    optimizer = torch.optim.SGD(model.parameters(), args.lr,
                                momentum=args.momentum,
                                weight_decay=args.weight_decay)
    sg.track(model=model.module, optimizer=optimizer)

    # synthetic TwoCropsTransform output: [query view, key view] per batch
    g = torch.Generator().manual_seed(1)
    n_epochs = -(-steps // batches_per_epoch)
    train_loader = [([torch.randn(args.batch_size, 3, image_size, image_size, generator=g),
                      torch.randn(args.batch_size, 3, image_size, image_size, generator=g)],
                     torch.zeros(args.batch_size, dtype=torch.long)) for _ in range(batches_per_epoch)]

    meters = {}

    @sg.compile
    def train_step(images):
        losses, top1, top5 = meters["losses"], meters["top1"], meters["top5"]
        # compute output
        output, target = model(im_q=images[0], im_k=images[1])
        loss = criterion(output, target)

        # acc1/acc5: accuracy of the (K+1)-way contrastive classifier
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images[0].size(0))
        top1.update(acc1[0], images[0].size(0))
        top5.update(acc5[0], images[0].size(0))

        # compute gradient and do SGD step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    def train(train_loader, model, criterion, optimizer, epoch, args, n_batches):
        batch_time = AverageMeter('Time', ':6.3f')
        data_time = AverageMeter('Data', ':6.3f')
        losses = AverageMeter('Loss', ':.4e')
        top1 = AverageMeter('Acc@1', ':6.2f')
        top5 = AverageMeter('Acc@5', ':6.2f')
        meters.update(losses=losses, top1=top1, top5=top5)
        progress = ProgressMeter(
            len(train_loader),
            [batch_time, data_time, losses, top1, top5],
            prefix="Epoch: [{}]".format(epoch))

        # switch to train mode
        model.train()

        end = time.time()
        for i, (images, _) in enumerate(train_loader[:n_batches]):
            data_time.update(time.time() - end)

            images[0] = images[0].to(device, non_blocking=True)
            images[1] = images[1].to(device, non_blocking=True)

            loss = train_step(images)
            sg.log(loss)

            batch_time.update(time.time() - end)
            end = time.time()

            if i % args.print_freq == 0:
                progress.display(i)
        sg.log(losses.avg)

    done = 0
    for epoch in range(args.start_epoch, n_epochs):
        adjust_learning_rate(optimizer, epoch, args)

        # train for one epoch
        n = min(batches_per_epoch, steps - done)
        train(train_loader, model, criterion, optimizer, epoch, args, n)
        done += n
