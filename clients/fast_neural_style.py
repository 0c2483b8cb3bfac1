"""pytorch/examples fast_neural_style: a TransformerNet (reflection-padded convs, affine InstanceNorm,
five residual blocks, nearest-upsample convs) trained against a frozen VGG-16 (``requires_grad=False``
parameters, outputs in a ``namedtuple``): content loss on ``relu2_2``, style loss from Gram matrices
(``bmm``) of four VGG outputs against the style image's, accumulated from a Python ``0.`` into a
tensor; Adam (lr 1e-3). ``utils.normalize_batch`` divides its argument in place (``batch.div_(255.0)``)
: the step mutates its own input ``x`` and the generator's output ``y``.

Model: vendor/pytorch_examples/fast_neural_style_{transformer_net,vgg,utils}.py (verbatim; VGG-16's
features from vendor/pytorch_vision, random weights in place of the ImageNet download). Loop:
neural_style.py ``train()`` (lines 73-100): the step function is the per-batch body from
``optimizer.zero_grad()`` to ``optimizer.step()``; the ``agg_content_loss += content_loss.item()`` /
``agg_style_loss += style_loss.item()`` after it and the log message are taken in the loop on the
returned losses. Scaled down: 32x32 images (synthetic, in [0, 255], seeded) instead of 256x256, batch
2 instead of 4, a 32x32 style image, 4 batches an epoch, log_interval 2; content/style weights and lr
are the argparse defaults (1e5, 1e10, 1e-3). No checkpoints, no ONNX export.
"""
import torch
from torch.optim import Adam

import clients.vendor.pytorch_examples.fast_neural_style_utils as utils
from clients.vendor.pytorch_examples.fast_neural_style_transformer_net import TransformerNet
from clients.vendor.pytorch_examples.fast_neural_style_vgg import Vgg16

SOURCE = "https://github.com/pytorch/examples/blob/77f55b9/fast_neural_style/neural_style/neural_style.py"
LICENSE = "BSD-3-Clause"
TAGS = ("style-transfer", "frozen-feature-extractor", "instancenorm", "reflection-pad", "upsample", "gram-matrix",
        "namedtuple-output", "in-place-input", "adam")


class args:  # argparse defaults of neural_style.py train, scaled down
    epochs = 2; batch_size = 2; image_size = 32; style_size = 32; lr = 1e-3
    content_weight = 1e5; style_weight = 1e10; log_interval = 2; seed = 42


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    per_epoch = 4
    args.epochs = (steps + per_epoch - 1) // per_epoch
    g = torch.Generator().manual_seed(1)
    # (ImageFolder through Resize, CenterCrop, ToTensor, Lambda(x.mul(255)))
    images = torch.rand(steps * args.batch_size, 3, args.image_size, args.image_size, generator=g).mul(255)
    train_loader = [(images[i:i + args.batch_size], torch.zeros(args.batch_size, dtype=torch.long))
                    for i in range(0, steps * args.batch_size, args.batch_size)]
    train_dataset = images

    transformer = TransformerNet().to(device)
    optimizer = Adam(transformer.parameters(), args.lr)
    mse_loss = torch.nn.MSELoss()

    vgg = Vgg16(requires_grad=False).to(device)
    style = torch.rand(3, args.style_size, args.style_size, generator=g).mul(255)  # (load_image + style_transform)
    style = style.repeat(args.batch_size, 1, 1, 1).to(device)

    features_style = vgg(utils.normalize_batch(style))
    gram_style = [utils.gram_matrix(y) for y in features_style]
    sg.track(transformer=transformer, optimizer=optimizer, vgg=vgg)

    @sg.compile
    def train_step(x, n_batch):
        optimizer.zero_grad()

        x = x.to(device)
        y = transformer(x)

        y = utils.normalize_batch(y)
        x = utils.normalize_batch(x)

        features_y = vgg(y)
        features_x = vgg(x)

        content_loss = args.content_weight * mse_loss(features_y.relu2_2, features_x.relu2_2)

        style_loss = 0.
        for ft_y, gm_s in zip(features_y, gram_style):
            gm_y = utils.gram_matrix(ft_y)
            style_loss += mse_loss(gm_y, gm_s[:n_batch, :, :])
        style_loss *= args.style_weight

        total_loss = content_loss + style_loss
        total_loss.backward()
        optimizer.step()
        return content_loss, style_loss

    it = 0
    for e in range(args.epochs):
        transformer.train()
        agg_content_loss = 0.
        agg_style_loss = 0.
        count = 0
        for batch_id, (x, _) in enumerate(train_loader[e * per_epoch:(e + 1) * per_epoch]):
            n_batch = len(x)
            count += n_batch
            x = x.clone()  # (a fresh batch from the DataLoader: the step divides it in place)
            content_loss, style_loss = train_step(x, n_batch)
            sg.log((content_loss, style_loss, x))

            agg_content_loss += content_loss.item()
            agg_style_loss += style_loss.item()

            if (batch_id + 1) % args.log_interval == 0:
                sg.log((agg_content_loss / (batch_id + 1), agg_style_loss / (batch_id + 1),
                        (agg_content_loss + agg_style_loss) / (batch_id + 1), count, len(train_dataset)))
            it += 1
            if it >= steps:
                return
