"""milesial/Pytorch-UNet ``train.py`` (``train_model``): a U-Net for semantic segmentation trained
with RMSprop (``lr``, ``weight_decay=1e-8``, ``momentum=0.999``, ``foreach=True``),
``ReduceLROnPlateau(optimizer, 'max', patience=5)`` stepped on the validation Dice score at every
evaluation round (every ``n_train // (5 * batch_size)`` global steps, inside the batch loop), a
``torch.cuda.amp.GradScaler(enabled=amp)``, ``torch.autocast(device.type, enabled=amp)`` around the
forward and the loss, the loss ``CrossEntropyLoss + dice_loss(F.softmax(masks_pred, dim=1).float(),
F.one_hot(true_masks, n_classes).permute(0, 3, 1, 2).float(), multiclass=True)``,
``optimizer.zero_grad(set_to_none=True)``, ``grad_scaler.scale(loss).backward()``,
``grad_scaler.unscale_(optimizer)``, ``clip_grad_norm_(model.parameters(), gradient_clipping)``,
``grad_scaler.step(optimizer)``, ``grad_scaler.update()``, then ``global_step += 1``,
``epoch_loss += loss.item()`` and ``experiment.log({'train loss': loss.item(), 'step': global_step,
'epoch': epoch})``. The model and images are channels_last (``model.to(memory_format=
torch.channels_last)``, ``images.to(..., memory_format=torch.channels_last)``).

What a user of stepgraph changes: the per-batch body of ``train_model``'s ``for batch in
train_loader`` loop (from ``images, true_masks = batch['image'], batch['mask']`` to the
``experiment.log``) is the function ``train_batch(batch)`` decorated with ``sg.compile`` (=
``@stepgraph.compile``); ``global_step`` and ``epoch_loss`` stay ``train_model``'s locals, rebound
by the step (``nonlocal``). The evaluation round (``evaluate()`` under ``torch.inference_mode()``,
``scheduler.step(val_score)``) stays in the loop after the call, as the program has it after the
body. ``amp``: the harness's ``"bf16"`` is the script's ``--amp`` (on the CPU: ``torch.autocast('cpu',
enabled=True)``, bf16; ``torch.cuda.amp.GradScaler(enabled=True)`` disables itself without CUDA,
as the script would run).

Source: https://github.com/milesial/Pytorch-UNet/blob/21d7850f2af30a9695bbeea75f3136aa538cfc4a/train.py
(with unet/unet_model.py, unet/unet_parts.py, utils/dice_score.py, evaluate.py at that commit).
GPL-3.0. Restated after the source, not copied: same classes, names, ops and order.
Deviations: wandb is replaced by a stand-in ``experiment`` whose ``log`` keeps the dicts (the
histogram/image logging of the evaluation round, wandb-only, is left out); tqdm bars left out; no
checkpoint files; the Carvana dataset is a synthetic ``Dataset`` of dicts (``'image'`` float
3xHxW, ``'mask'`` long HxW in {0, 1}). Scaled down: channel widths /16 (64..1024 -> 4..64; the
``UNet`` takes a ``width`` argument for that), images 16x16 instead of Carvana's 959x640 at scale
0.5, 10 training + 4 validation images, batch 2 (5 batches an epoch, so ``division_step`` is 1: an
evaluation round after every step; the second epoch starts at step 6), ``ReduceLROnPlateau`` patience 5 -> 0 (so the lr does move within 8 steps), lr
1e-5 -> 1e-3, ``num_workers`` 0, no ``pin_memory``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor, optim
from torch.utils.data import DataLoader, Dataset, random_split

SOURCE = "https://github.com/milesial/Pytorch-UNet/blob/21d7850f2af30a9695bbeea75f3136aa538cfc4a/train.py"
LICENSE = "GPL-3.0"
TAGS = ("cnn", "unet", "segmentation", "batchnorm", "channels-last", "rmsprop-foreach", "reduce-lr-on-plateau",
        "grad-scaler", "autocast", "clip-grad-norm", "dice-loss", "one-hot", "item-in-step", "nonlocal-counter",
        "logger-call-in-step", "dataloader")

WIDTH = 4          # the program's 64 (every width of the net is a multiple of it)
IMG = 16
# Variant hooks (None: the program as written), set by variant runs of this client:
_SCALER = None       # e.g. lambda: torch.amp.GradScaler("cpu", enabled=True): an enabled scaler on the CPU
_RMSPROP_KW = {}     # e.g. {"foreach": False}, {"centered": True}

N_IMAGES = 14      # 10 train + 4 val (val_percent 0.1 of the program would give 1)


# --- unet/unet_parts.py ---

class DoubleConv(nn.Module):
    """(convolution => [BN] => ReLU) * 2"""

    def __init__(self, in_channels, out_channels, mid_channels=None):
        super().__init__()
        if not mid_channels:
            mid_channels = out_channels
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, mid_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )

    def forward(self, x):
        return self.double_conv(x)


class Down(nn.Module):
    """Downscaling with maxpool then double conv"""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))

    def forward(self, x):
        return self.maxpool_conv(x)


class Up(nn.Module):
    """Upscaling then double conv"""

    def __init__(self, in_channels, out_channels, bilinear=True):
        super().__init__()
        if bilinear:
            self.up = nn.Upsample(scale_factor=2, mode='bilinear', align_corners=True)
            self.conv = DoubleConv(in_channels, out_channels, in_channels // 2)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1, x2):
        x1 = self.up(x1)
        # input is CHW
        diffY = x2.size()[2] - x1.size()[2]
        diffX = x2.size()[3] - x1.size()[3]
        x1 = F.pad(x1, [diffX // 2, diffX - diffX // 2, diffY // 2, diffY - diffY // 2])
        x = torch.cat([x2, x1], dim=1)
        return self.conv(x)


class OutConv(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1)

    def forward(self, x):
        return self.conv(x)


# --- unet/unet_model.py (widths as multiples of ``width``: 64 in the program) ---

class UNet(nn.Module):
    def __init__(self, n_channels, n_classes, bilinear=False, width=64):
        super().__init__()
        self.n_channels = n_channels
        self.n_classes = n_classes
        self.bilinear = bilinear
        w = width
        self.inc = DoubleConv(n_channels, w)
        self.down1 = Down(w, 2 * w)
        self.down2 = Down(2 * w, 4 * w)
        self.down3 = Down(4 * w, 8 * w)
        factor = 2 if bilinear else 1
        self.down4 = Down(8 * w, 16 * w // factor)
        self.up1 = Up(16 * w, 8 * w // factor, bilinear)
        self.up2 = Up(8 * w, 4 * w // factor, bilinear)
        self.up3 = Up(4 * w, 2 * w // factor, bilinear)
        self.up4 = Up(2 * w, w, bilinear)
        self.outc = OutConv(w, n_classes)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x5 = self.down4(x4)
        x = self.up1(x5, x4)
        x = self.up2(x, x3)
        x = self.up3(x, x2)
        x = self.up4(x, x1)
        logits = self.outc(x)
        return logits


# --- utils/dice_score.py ---

def dice_coeff(input: Tensor, target: Tensor, reduce_batch_first: bool = False, epsilon: float = 1e-6):
    # Average of Dice coefficient for all batches, or for a single mask
    assert input.size() == target.size()
    assert input.dim() == 3 or not reduce_batch_first
    sum_dim = (-1, -2) if input.dim() == 2 or not reduce_batch_first else (-1, -2, -3)
    inter = 2 * (input * target).sum(dim=sum_dim)
    sets_sum = input.sum(dim=sum_dim) + target.sum(dim=sum_dim)
    sets_sum = torch.where(sets_sum == 0, inter, sets_sum)
    dice = (inter + epsilon) / (sets_sum + epsilon)
    return dice.mean()


def multiclass_dice_coeff(input: Tensor, target: Tensor, reduce_batch_first: bool = False, epsilon: float = 1e-6):
    # Average of Dice coefficient for all classes
    return dice_coeff(input.flatten(0, 1), target.flatten(0, 1), reduce_batch_first, epsilon)


def dice_loss(input: Tensor, target: Tensor, multiclass: bool = False):
    # Dice loss (objective to minimize) between 0 and 1
    fn = multiclass_dice_coeff if multiclass else dice_coeff
    return 1 - fn(input, target, reduce_batch_first=True)


# --- evaluate.py ---

@torch.inference_mode()
def evaluate(net, dataloader, device, amp):
    net.eval()
    num_val_batches = len(dataloader)
    dice_score = 0
    with torch.autocast(device.type if device.type != 'mps' else 'cpu', enabled=amp):
        for batch in dataloader:
            image, mask_true = batch['image'], batch['mask']
            image = image.to(device=device, dtype=torch.float32, memory_format=torch.channels_last)
            mask_true = mask_true.to(device=device, dtype=torch.long)
            mask_pred = net(image)
            if net.n_classes == 1:
                assert mask_true.min() >= 0 and mask_true.max() <= 1, 'True mask indices should be in [0, 1]'
                mask_pred = (F.sigmoid(mask_pred) > 0.5).float()
                dice_score += dice_coeff(mask_pred, mask_true, reduce_batch_first=False)
            else:
                assert mask_true.min() >= 0 and mask_true.max() < net.n_classes, \
                    'True mask indices should be in [0, n_classes['
                mask_true = F.one_hot(mask_true, net.n_classes).permute(0, 3, 1, 2).float()
                mask_pred = F.one_hot(mask_pred.argmax(dim=1), net.n_classes).permute(0, 3, 1, 2).float()
                # compute the Dice score, ignoring background
                dice_score += multiclass_dice_coeff(mask_pred[:, 1:], mask_true[:, 1:], reduce_batch_first=False)
    net.train()
    return dice_score / max(num_val_batches, 1)


# --- stand-ins for the data set and wandb ---

class SyntheticCarvana(Dataset):
    def __init__(self, n, g):
        self.images = torch.rand(n, 3, IMG, IMG, generator=g)
        # masks: a blob where the image's red channel is bright (so there is something to learn)
        self.masks = (self.images[:, 0] > 0.6).long()

    def __len__(self):
        return len(self.images)

    def __getitem__(self, idx):
        return {'image': self.images[idx].contiguous(), 'mask': self.masks[idx].contiguous()}


class _Run:
    """What ``wandb.init(...)`` returns, as far as the loop uses it: ``log(dict)``."""

    def __init__(self):
        self.history = []

    def log(self, d):
        self.history.append(dict(d))


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    amp = amp is not None                      # the script's --amp
    model = UNet(n_channels=3, n_classes=2, bilinear=False, width=WIDTH)
    model = model.to(memory_format=torch.channels_last)
    model.to(device=device)

    epochs, batch_size, learning_rate = 2, 2, 1e-3
    val_percent, weight_decay, momentum, gradient_clipping = 4 / N_IMAGES, 1e-8, 0.999, 1.0

    # 1-3. dataset, split, loaders
    dataset = SyntheticCarvana(N_IMAGES, torch.Generator().manual_seed(1))
    n_val = int(len(dataset) * val_percent)
    n_train = len(dataset) - n_val
    train_set, val_set = random_split(dataset, [n_train, n_val], generator=torch.Generator().manual_seed(0))
    loader_args = dict(batch_size=batch_size, num_workers=0)
    train_loader = DataLoader(train_set, shuffle=True, **loader_args)
    val_loader = DataLoader(val_set, shuffle=False, drop_last=True, **loader_args)
    experiment = _Run()

    # 4. optimizer, loss, lr scheduler, loss scaling for AMP
    optimizer = optim.RMSprop(model.parameters(),
                              lr=learning_rate, weight_decay=weight_decay, momentum=momentum, foreach=True)
    if _RMSPROP_KW:   # (variant hook)
        optimizer = optim.RMSprop(model.parameters(), **{**optimizer.defaults, **_RMSPROP_KW})
    scheduler = optim.lr_scheduler.ReduceLROnPlateau(optimizer, 'max', patience=0)  # goal: maximize Dice score
    grad_scaler = torch.cuda.amp.GradScaler(enabled=amp)
    if _SCALER is not None:   # (variant hook)
        grad_scaler = _SCALER()
    criterion = nn.CrossEntropyLoss() if model.n_classes > 1 else nn.BCEWithLogitsLoss()
    global_step = 0
    sg.track(model=model, opt=optimizer, sched=scheduler, scaler=grad_scaler)

    epoch = 0
    epoch_loss = 0

    @sg.compile
    def train_batch(batch):
        nonlocal global_step, epoch_loss
        images, true_masks = batch['image'], batch['mask']

        assert images.shape[1] == model.n_channels, \
            f'Network has been defined with {model.n_channels} input channels, ' \
            f'but loaded images have {images.shape[1]} channels. Please check that ' \
            'the images are loaded correctly.'

        images = images.to(device=device, dtype=torch.float32, memory_format=torch.channels_last)
        true_masks = true_masks.to(device=device, dtype=torch.long)

        with torch.autocast(device.type if device.type != 'mps' else 'cpu', enabled=amp):
            masks_pred = model(images)
            if model.n_classes == 1:
                loss = criterion(masks_pred.squeeze(1), true_masks.float())
                loss += dice_loss(F.sigmoid(masks_pred.squeeze(1)), true_masks.float(), multiclass=False)
            else:
                loss = criterion(masks_pred, true_masks)
                loss += dice_loss(
                    F.softmax(masks_pred, dim=1).float(),
                    F.one_hot(true_masks, model.n_classes).permute(0, 3, 1, 2).float(),
                    multiclass=True
                )

        optimizer.zero_grad(set_to_none=True)
        grad_scaler.scale(loss).backward()
        grad_scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), gradient_clipping)
        grad_scaler.step(optimizer)
        grad_scaler.update()

        global_step += 1
        epoch_loss += loss.item()
        experiment.log({
            'train loss': loss.item(),
            'step': global_step,
            'epoch': epoch
        })
        return loss, masks_pred

    # 5. Begin training
    done = 0
    for epoch in range(1, epochs + 1):
        if done == steps:
            break
        model.train()
        epoch_loss = 0
        for batch in train_loader:
            if done == steps:
                break
            loss, masks_pred = train_batch(batch)
            done += 1
            sg.log((loss, global_step, epoch_loss, len(experiment.history), experiment.history[-1]))

            # Evaluation round
            division_step = (n_train // (5 * batch_size))
            if division_step > 0:
                if global_step % division_step == 0:
                    val_score = evaluate(model, val_loader, device, amp)
                    scheduler.step(val_score)
                    sg.log((val_score, optimizer.param_groups[0]['lr']))
    sg.log(experiment.history)
